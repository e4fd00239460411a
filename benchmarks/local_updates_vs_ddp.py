"""Local updates (H inner steps per push) against Lightning's stock ``ddp``, with no injected delay.

Same model (an MLP 320-1024-1024-1024-1024-10, about 3.49M parameters, on synthetic
classification data, plain SGD at a constant learning rate), batch size per process, number of
processes P (``--devices``, default 4 then 2) and number of inner steps per fit (``--steps``:
``max_steps`` counts inner steps, so the server stops after ceil(steps / H) updates).
``StaleStrategy("sync", local_steps=H)`` runs on the central path with the default outer
optimizer (plain averaging of the pseudo-gradients, Wang and Joshi's local SGD), for each H of
``--local-steps`` (default 1, 4, 16).

Throughput is training samples per second in the steady state:

- ``ddp``: P x m / (mean time between optimizer steps on rank 0, after ``--warmup`` steps);
- local updates: (``gradients_applied`` x H x m) / (``updates`` x ``mean_update_interval_s``),
  that is, the inner steps of every pseudo-gradient the server applied, times the batch size m,
  per second of the server's steady state (the stats leave the first update out).

Bytes moved per learner per inner step are **computed from counts, not sniffed from the wire**:
a push carries the pseudo-gradient (one float32 per parameter) and the buffers (none in this
MLP), its answer the parameters and buffers, so per learner it is

    mean(pushes_per_learner) x 4 x (2 x parameters + 2 x buffers) / global_step

with ``global_step`` = H x updates, the inner steps along the server's trajectory (under
``sync`` every learner pushes once per update). It falls as 1/H. For ``ddp`` the column holds
what a ring all-reduce sends per rank per step, 2 (P - 1) / P x 4 x parameters, for reference.

Target (issue 33): at H = 4, samples/s >= 1.5 x ddp's; printed as met or not, never tuned.

Each process count is one launch of its own (a fresh Python process tree); inside a launch the
modes run interleaved, ``--repeats`` times, so that load changes on the shared machine hit every
mode alike. ``vs_ddp`` is the median over repeats of (this mode's samples/s) / (ddp's samples/s
in the same repeat); ``samples_per_s`` and ``ms_per_update`` are medians over repeats.

    python benchmarks/local_updates_vs_ddp.py [--devices 4 2] [--local-steps 1 4 16] [--steps 160] [--repeats 3]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from _common import (
    MLPClassifier,
    StepTimer,
    base_parser,
    classification_loader,
    is_rank_zero,
    median,
    rank_print,
    ratios_per_repeat,
    run_per_device_count,
    table,
    trainer_kwargs,
    write_results,
)
from pytorch_lightning import Trainer, seed_everything

from lightning_stale import StaleStrategy

TARGET_H, TARGET = 4, 1.5
FEATURES, HIDDEN, CLASSES = 320, (1024, 1024, 1024, 1024), 10


def build_model(lr: float) -> MLPClassifier:
    return MLPClassifier(features=FEATURES, hidden=HIDDEN, classes=CLASSES, lr=lr)


def measure(h: int | None, p: int, *, steps: int, batch_size: int, lr: float, warmup: int,
            seed: int) -> dict | None:
    """One fit on P processes, no injected delay: stock ``ddp`` (``h`` None) or ``sync`` with H
    = ``h`` local steps; on global rank 0 its steady-state rates and bytes per inner step (see
    the module docstring), None elsewhere."""
    seed_everything(seed, verbose=False)
    model = build_model(lr)
    params = sum(t.numel() for t in model.parameters())
    buffers = sum(t.numel() for t in model.buffers())
    samples = batch_size * p * (steps + 50) * 2  # no epoch ends (ddp shards it P ways)
    loader = classification_loader(samples, features=FEATURES, classes=CLASSES, batch_size=batch_size, seed=seed)
    timer = StepTimer(warmup=warmup)
    strategy = "ddp" if h is None else StaleStrategy("sync", p, delay=None, seed=seed, record_trace=False,
                                                      local_steps=h)
    trainer = Trainer(devices=p, strategy=strategy, max_steps=steps, callbacks=[timer], **trainer_kwargs())
    start = time.monotonic()
    trainer.fit(model, train_dataloaders=loader)
    wall = time.monotonic() - start
    if not is_rank_zero():
        return None
    if h is None:
        interval, updates = timer.mean_interval_s, trainer.global_step
        samples_per_s = p * batch_size / interval
        bytes_per_step = 2 * (p - 1) / p * 4 * params
        pushes = math.nan
    else:
        stats = trainer.strategy.stats
        interval, updates = stats["mean_update_interval_s"], stats["updates"]
        samples_per_s = stats["gradients_applied"] * h * batch_size / (max(1, updates) * interval)
        pushes = sum(stats["pushes_per_learner"]) / len(stats["pushes_per_learner"])
        bytes_per_step = pushes * 4 * (2 * params + 2 * buffers) / max(1, trainer.global_step)
    return {"updates": updates, "inner_steps": trainer.global_step, "pushes_per_learner": pushes,
            "interval_s": interval, "samples_per_s": samples_per_s, "bytes_per_inner_step": bytes_per_step,
            "parameters": params, "fit_wall_s": wall}


def run_launch(args) -> None:
    """One process tree of ``args.child_devices`` processes: ddp and every H, interleaved."""
    p = args.child_devices
    rows = []
    for repeat in range(args.repeats):
        for h in [None, *args.local_steps]:
            row = measure(h, p, steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                          seed=args.seed)
            if row is None:
                continue
            mode = "ddp" if h is None else "sync"
            rows.append({"devices": p, "mode": mode, "h": h, "repeat": repeat, **row})
            rank_print(f"P={p} repeat {repeat} {mode:4s} H={h}: {row['interval_s'] * 1e3:8.2f} ms/update, "
                       f"{row['samples_per_s']:7.0f} samples/s, {row['bytes_per_inner_step'] / 1e6:6.2f} MB "
                       f"per inner step ({row['fit_wall_s']:.1f} s)")
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def summarise(rows: list[dict], devices: list[int]) -> list[dict]:
    summary = []
    for p in devices:
        for mode, h in dict.fromkeys((r["mode"], r["h"]) for r in rows if r["devices"] == p):
            mine = [r for r in rows if r["devices"] == p and r["mode"] == mode and r["h"] == h]
            # The ratio of each repeat to the ddp run of the same repeat, then the median.
            per_repeat = ratios_per_repeat(mine, [d for d in rows if d["devices"] == p and d["mode"] == "ddp"])
            vs_ddp = median(per_repeat)
            target = f">= {TARGET}" if h == TARGET_H else ""
            summary.append({"devices": p, "mode": mode, "h": "" if h is None else h,
                            "samples_per_s": median([r["samples_per_s"] for r in mine]), "vs_ddp": vs_ddp,
                            "vs_ddp_per_repeat": " ".join(f"{x:.3f}" for x in per_repeat),
                            "target": target, "met": (vs_ddp >= TARGET) if target else "",
                            "bytes_per_inner_step": median([r["bytes_per_inner_step"] for r in mine]),
                            "ms_per_update": 1e3 * median([r["interval_s"] for r in mine]),
                            "updates": mine[0]["updates"], "parameters": mine[0]["parameters"]})
    return summary


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--local-steps", type=int, nargs="+", default=[1, 4, 16], help="the values of H")
    parser.add_argument("--steps", type=int, default=160, help="inner steps (max_steps) per fit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="ddp steps left out of its timing")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01, help="the inner SGD's constant learning rate")
    launched = run_per_device_count(parser, __file__, "local_updates_vs_ddp", run_launch)
    if launched is None:
        return
    args, out, rows, total = launched
    summary = summarise(rows, args.devices)
    params = summary[0]["parameters"] if summary else 0
    print()
    print(f"no injected delay, MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES} ({params} parameters), "
          f"batch {args.batch_size}, {args.steps} inner steps per fit, median of {args.repeats} interleaved "
          f"repeats; target: H = {TARGET_H} >= {TARGET} x ddp")
    print(table(summary, ["devices", "mode", "h", "samples_per_s", "vs_ddp", "vs_ddp_per_repeat", "target", "met",
                          "bytes_per_inner_step", "ms_per_update", "updates"]))
    for r in summary:
        if r["target"]:
            print(f"P={r['devices']}: H = {TARGET_H} at {r['vs_ddp']:.2f} x ddp: target "
                  f"{'met' if r['met'] else 'NOT met'}")
    print(f"total {total:.0f} s")
    paths = write_results(out, "local_updates_vs_ddp", summary,
                          {"runs": rows, "steps": args.steps, "repeats": args.repeats,
                           "local_steps": args.local_steps, "batch_size": args.batch_size, "lr": args.lr,
                           "model": f"MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}",
                           "parameters": params, "threads": args.threads,
                           "switch_interval_s": args.switch_interval, "total_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
