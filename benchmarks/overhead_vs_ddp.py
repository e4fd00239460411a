"""Cost of the parameter server against Lightning's stock ``ddp``, with no injected delay.

Same model (an MLP 64-64-10 on synthetic classification data), batch size, number of processes
and number of optimizer steps / server updates. Throughput is training samples per second in the
steady state: for ``ddp`` P x m / (mean time between optimizer steps on rank 0, after a warm-up);
for the server, (samples in the gradients applied per update) / ``mean_update_interval_s``.
For ``sync`` and ``k_sync`` with K = P every update averages P gradients of m samples, exactly as
a ddp step does, so their ratio to ddp is also the ratio of updates per second.

Targets: ``sync`` >= 0.9 x ddp, ``k_sync`` (K = P) >= 0.5 x ddp. The other variants are listed
for information (samples/s of the gradients applied).

Each process count (``--devices``, default 4 then 2) is one launch of its own (a fresh Python
process tree, here a subprocess of this script); inside a launch the modes run interleaved,
``--repeats`` times, so that load changes on the shared machine hit every mode alike. ``vs_ddp``
is the median over repeats of (this mode's samples/s) / (ddp's samples/s in the same repeat);
``ms_per_update`` and ``samples_per_s`` are medians over repeats.

    python benchmarks/overhead_vs_ddp.py [--devices 4 2] [--steps 500] [--repeats 5]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pytorch_lightning import Trainer, seed_everything

from _common import (MLPClassifier, StepTimer, base_parser, run_per_device_count,
                     classification_loader, is_rank_zero, median, rank_print, ratios_per_repeat, table,
                     trainer_kwargs, write_results)
from lightning_stale import StaleStrategy

TARGETS = {"sync": 0.9, "k_sync": 0.5}


def k_of(mode: str, p: int) -> int:
    """K = P for ``sync``/``k_sync``, 1 for ``async``, P/2 for the other K-variants."""
    return p if mode in ("sync", "k_sync") else 1 if mode == "async" else max(1, p // 2)


def modes(p: int, extra: bool) -> list[tuple[str, int | None]]:
    names = ["sync", "k_sync"] + (["k_batch_sync", "async", "k_async", "k_batch_async"] if extra else [])
    return [("ddp", None)] + [(mode, k_of(mode, p)) for mode in names]


def measure(mode: str, k: int | None, p: int, *, hidden: int, steps: int, batch_size: int = 32,
            warmup: int = 10, seed: int = 0) -> dict | None:
    """One fit of ``mode`` (stock ``ddp`` or a variant with K = ``k``) on P processes, no
    injected delay, on the MLP 64-``hidden``-10; on global rank 0 its steady-state rates (see
    the module docstring), None elsewhere."""
    seed_everything(seed, verbose=False)
    model = MLPClassifier(features=64, hidden=(hidden,), classes=10, lr=0.05)
    samples = batch_size * p * (steps + 50) * 2  # no epoch ends (ddp shards it P ways)
    loader = classification_loader(samples, batch_size=batch_size, seed=seed)
    timer = StepTimer(warmup=warmup)
    strategy = "ddp" if mode == "ddp" else StaleStrategy(mode, k, delay=None, seed=seed, record_trace=False)
    trainer = Trainer(devices=p, strategy=strategy, max_steps=steps, callbacks=[timer], **trainer_kwargs())
    start = time.monotonic()
    trainer.fit(model, train_dataloaders=loader)
    wall = time.monotonic() - start
    if not is_rank_zero():
        return None
    if mode == "ddp":
        interval, updates, samples_per_update = timer.mean_interval_s, trainer.global_step, p * batch_size
    else:
        stats = trainer.strategy.stats
        interval, updates = stats["mean_update_interval_s"], stats["updates"]
        samples_per_update = stats["gradients_applied"] * batch_size / max(1, updates)
    return {"updates": updates, "interval_s": interval, "updates_per_s": 1.0 / interval,
            "samples_per_s": samples_per_update / interval, "fit_wall_s": wall}


def run_launch(args) -> None:
    """One process tree of ``args.child_devices`` processes: every mode, interleaved."""
    p = args.child_devices
    rows = []
    for repeat in range(args.repeats):
        for mode, k in modes(p, args.extra):
            row = measure(mode, k, p, hidden=args.hidden, steps=args.steps, batch_size=args.batch_size,
                          warmup=args.warmup, seed=args.seed)
            if row is None:
                continue
            rows.append({"devices": p, "mode": mode, "k": k, "repeat": repeat, **row})
            rank_print(f"P={p} repeat {repeat} {mode:14s} K={k}: {row['interval_s'] * 1e3:7.3f} ms/update, "
                       f"{row['samples_per_s']:9.0f} samples/s ({row['fit_wall_s']:.1f} s)")
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def summarise(rows: list[dict], devices: list[int]) -> list[dict]:
    summary = []
    for p in devices:
        ddp = median([r["samples_per_s"] for r in rows if r["devices"] == p and r["mode"] == "ddp"])
        for mode in dict.fromkeys(r["mode"] for r in rows if r["devices"] == p):
            mine = [r for r in rows if r["devices"] == p and r["mode"] == mode]
            sps = median([r["samples_per_s"] for r in mine])
            # The ratio of each repeat to the ddp run of the same repeat, then the median.
            per_repeat = ratios_per_repeat(mine, [d for d in rows if d["devices"] == p and d["mode"] == "ddp"])
            summary.append({"devices": p, "mode": mode, "k": mine[0]["k"],
                            "ms_per_update": 1e3 * median([r["interval_s"] for r in mine]),
                            "samples_per_s": sps, "vs_ddp": median(per_repeat),
                            "vs_ddp_of_medians": sps / ddp if ddp else math.nan,
                            "vs_ddp_per_repeat": " ".join(f"{x:.3f}" for x in per_repeat),
                            "target": TARGETS.get(mode, "")})
    return summary


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps / server updates per fit")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="ddp steps left out of its timing")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--no-extra", dest="extra", action="store_false",
                        help="only ddp, sync and k_sync (K = P)")
    launched = run_per_device_count(parser, __file__, "overhead_vs_ddp", run_launch)
    if launched is None:
        return
    args, out, rows, total = launched
    summary = summarise(rows, args.devices)
    print()
    print(f"no injected delay, MLP 64-{args.hidden}-10, batch {args.batch_size}, {args.steps} steps per fit, "
          f"median of {args.repeats} interleaved repeats; targets: sync >= 0.9 x ddp, k_sync (K = P) >= 0.5 x ddp")
    print(table(summary, ["devices", "mode", "k", "ms_per_update", "samples_per_s", "vs_ddp",
                          "vs_ddp_per_repeat", "target"]))
    print(f"total {total:.0f} s")
    paths = write_results(out, "overhead_vs_ddp", summary,
                          {"runs": rows, "steps": args.steps, "repeats": args.repeats,
                           "batch_size": args.batch_size, "hidden": args.hidden,
                           "threads": args.threads, "switch_interval_s": args.switch_interval,
                           "total_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
