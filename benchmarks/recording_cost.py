"""Cost of recording the event log (`StaleStrategy(record_events=...)`, docs/replay.md) on the
real engine, side by side with recording off.

Same model, data, batch size, number of processes (``--devices``, default 4) and server updates
per fit; no injected delay. Two models: an MLP 64-267-10 (0.02M parameters) and an MLP
64-1850-1850-10 (3.5M). Modes: ``off``; ``on`` (the default, ``digest_every=100``: a digest of
the server's parameters and optimizer state after every 100th update and at the stop);
``on_digest_every_1`` (a digest after every update); ``on_stop_digest`` (``digest_every=0``:
pushes, updates and a digest at the stop only). Throughput is training
samples per second in the steady state: (samples in the gradients applied per update) /
``mean_update_interval_s``. ``vs_off`` is the median over repeats of (this mode's samples/s) /
(``off``'s in the same repeat); the modes run interleaved in one launch, ``--repeats`` times,
so that load changes on the shared machine hit every mode alike. The server path is forced
(``--server``, default central: the path where updates carry digests).

Target: ``on`` >= 0.98 x ``off`` at both sizes on P = 4.

    python benchmarks/recording_cost.py [--devices 4] [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

from pytorch_lightning import Trainer, seed_everything

from _common import (MLPClassifier, base_parser, classification_loader, is_rank_zero, median, rank_print,
                     run_per_device_count, table, trainer_kwargs, write_results)
from lightning_stale import StaleStrategy
from lightning_stale.replay.setup import DIGEST_EVERY

SIZES = {"0.02M": (267,), "3.5M": (1850, 1850)}
# mode -> digest_every (None: off)
MODES = {"off": None, "on": DIGEST_EVERY, "on_digest_every_1": 1, "on_stop_digest": 0}
TARGET = 0.98


def measure(hidden: tuple[int, ...], digest_every: int | None, p: int, *, variant: str, k: int, server: str,
            steps: int, batch_size: int, seed: int, folder: Path) -> dict | None:
    seed_everything(seed, verbose=False)
    model = MLPClassifier(features=64, hidden=hidden, classes=10, lr=0.05)
    loader = classification_loader(batch_size * p * (steps + 50) * 2, batch_size=batch_size, seed=seed)
    record = False if digest_every is None else folder / "events.jsonl"
    strategy = StaleStrategy(variant, k, delay=None, seed=seed, record_trace=False, server=server,
                             record_events=record, digest_every=digest_every if digest_every is not None else DIGEST_EVERY)
    trainer = Trainer(devices=p, strategy=strategy, max_steps=steps, **trainer_kwargs())
    start = time.monotonic()
    trainer.fit(model, train_dataloaders=loader)
    wall = time.monotonic() - start
    if not is_rank_zero():
        return None
    stats = trainer.strategy.stats
    interval, updates = stats["mean_update_interval_s"], stats["updates"]
    samples_per_update = stats["gradients_applied"] * batch_size / max(1, updates)
    log_bytes = Path(stats["events_path"]).stat().st_size if "events_path" in stats else 0
    return {"updates": updates, "interval_s": interval, "samples_per_s": samples_per_update / interval,
            "fit_wall_s": wall, "log_bytes": log_bytes,
            "parameters": sum(t.numel() for t in model.parameters())}


def run_launch(args) -> None:
    p = args.child_devices
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for size, hidden in SIZES.items():
                for mode, digest_every in MODES.items():
                    row = measure(hidden, digest_every, p, variant=args.variant, k=args.k, server=args.server,
                                  steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                                  folder=Path(folder))
                    if row is None:
                        continue
                    rows.append({"devices": p, "size": size, "mode": mode, "repeat": repeat, **row})
                    rank_print(f"P={p} repeat {repeat} {size:6s} {mode:15s}: {row['samples_per_s']:9.0f} samples/s "
                               f"({row['fit_wall_s']:.1f} s, log {row['log_bytes']} bytes)")
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def summarise(rows: list[dict]) -> list[dict]:
    summary = []
    for (p, size) in dict.fromkeys((r["devices"], r["size"]) for r in rows):
        here = [r for r in rows if r["devices"] == p and r["size"] == size]
        for mode in MODES:
            mine = [r for r in here if r["mode"] == mode]
            if not mine:
                continue
            per_repeat = []
            for r in mine:
                base = [o["samples_per_s"] for o in here if o["mode"] == "off" and o["repeat"] == r["repeat"]]
                if base:
                    per_repeat.append(r["samples_per_s"] / base[0])
            summary.append({"devices": p, "size": size, "parameters": mine[0]["parameters"], "mode": mode,
                            "samples_per_s": median([r["samples_per_s"] for r in mine]),
                            "vs_off": median(per_repeat) if per_repeat else math.nan,
                            "vs_off_per_repeat": " ".join(f"{x:.3f}" for x in per_repeat),
                            "log_bytes": median([r["log_bytes"] for r in mine]),
                            "target": TARGET if mode == "on" else ""})
    return summary


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4])
    parser.add_argument("--steps", type=int, default=200, help="server updates per fit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--variant", default="k_async")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--server", default="central", choices=["central", "collective", "sharded", "auto"])
    launched = run_per_device_count(parser, __file__, "recording_cost", run_launch)
    if launched is None:
        return
    args, out, rows, total = launched
    summary = summarise(rows)
    print()
    print(f"no injected delay, {args.variant} K={args.k}, server {args.server}, batch {args.batch_size}, "
          f"{args.steps} updates per fit, median of {args.repeats} interleaved repeats; target: on >= "
          f"{TARGET} x off")
    print(table(summary, ["devices", "size", "parameters", "mode", "samples_per_s", "vs_off", "vs_off_per_repeat",
                          "log_bytes", "target"]))
    print(f"total {total:.0f} s")
    paths = write_results(out, "recording_cost", summary,
                          {"runs": rows, "steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size,
                           "variant": args.variant, "k": args.k, "server": args.server, "threads": args.threads,
                           "total_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
