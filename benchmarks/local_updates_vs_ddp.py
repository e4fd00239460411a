"""Local updates (H inner steps per push) against Lightning's stock ``ddp``, with no injected delay.

Same model (an MLP 320-1024-1024-1024-1024-10, about 3.49M parameters, on synthetic
classification data, plain SGD at a constant learning rate), batch size per process, number of
processes P (``--devices``, default 4 then 2) and number of inner steps per fit (``--steps``:
``max_steps`` counts inner steps, so the server stops after ceil(steps / H) updates).
``StaleStrategy("sync", local_steps=H, server=S)`` runs with the default outer optimizer (plain
averaging of the pseudo-gradients, Wang and Joshi's local SGD), for each H of ``--local-steps``
(default 1, 4, 16) and each path S of ``--servers`` (default both): ``central`` (the server on
rank 0 holds the model; pushes and answers carry it) and ``collective`` (a push is a header, the
pseudo-gradients meet in one all-reduce and every learner applies the outer step,
docs/how-to/local-updates.md). The ``server`` column names the path (empty for ``ddp``).

Throughput is training samples per second in the steady state:

- ``ddp``: P x m / (mean time between optimizer steps on rank 0, after ``--warmup`` steps);
- local updates: (``gradients_applied`` x H x m) / (``updates`` x ``mean_update_interval_s``),
  that is, the inner steps of every pseudo-gradient the server applied, times the batch size m,
  per second of the server's steady state (the stats leave the first update out).

Bytes moved per learner per inner step are **computed from counts, not sniffed from the wire**,
with ``global_step`` = H x updates, the inner steps along the server's trajectory (under
``sync`` every learner pushes once per update), so that both paths' figures fall as 1/H:

- central: a push carries the pseudo-gradient (one float32 per parameter) and the buffers (none
  in this MLP), its answer the parameters and buffers, so per learner (what it sends plus what it
  receives)

      mean(pushes_per_learner) x 4 x (2 x parameters + 2 x buffers) / global_step

  neglecting the two fixed-size headers (``HEADER_BYTES``) of each push and answer;
- collective (``paths/collective``): per push the learner sends a header alone (the
  pseudo-gradient stays with it), and per update it receives the server's decision (a header
  with ``update_payload`` inline: K, the pushes taken from each learner and the overlap flag,
  P + 2 float64) and takes part in one all-reduce of its push vector, the pseudo-gradient, the
  buffers and the presence mask (one value per parameter tensor), all float32, plus, where the
  module has integer buffers (BatchNorm's count; none here), a max all-reduce of those. A ring
  all-reduce of N values sends 2 (P - 1) / P x N per rank (Patarasuk and Yuan, 2009; it
  receives as much again), counted as the ``ddp`` row counts its own, so per learner

      [mean(pushes_per_learner) x HEADER_BYTES
       + updates x (HEADER_BYTES + 8 (P + 2)
                    + 2 (P - 1) / P x 4 x (parameters + buffers + parameter tensors + integer buffers))]
      / global_step

  (every learner takes part in every update's all-reduce, adding nothing where the update took
  none of its pushes). Included: the headers, the decision, the mask and the integer buffers'
  all-reduce (zero here). Neglected: the first parameters and the last messages of a fit (one
  each per fit, not per update), gloo's own framing of the all-reduce's chunks, and that rank 0's
  learner exchanges its headers with the server through an in-process queue, not the wire (its
  headers are counted as every learner's are, as the central formula counts its pushes).

For ``ddp`` the column holds what a ring all-reduce sends per rank per step, 2 (P - 1) / P x 4 x
parameters, for reference. So the ``ddp`` and collective rows count what a rank sends in its
all-reduces, the central rows what a learner sends and receives: at equal H the collective row
is about (P - 1) / P of the central one, where counting both directions would make it 2 (P - 1) / P.

Target (issue 33): at H = 4, samples/s >= 1.5 x ddp's; printed as met or not, never tuned.

Each process count is one launch of its own (a fresh Python process tree); inside a launch the
modes run interleaved, ``--repeats`` times, so that load changes on the shared machine hit every
mode alike. ``vs_ddp`` is the median over repeats of (this mode's samples/s) / (ddp's samples/s
in the same repeat); ``samples_per_s`` and ``ms_per_update`` are medians over repeats.

    python benchmarks/local_updates_vs_ddp.py [--devices 4 2] [--local-steps 1 4 16] [--servers central collective]
        [--steps 160] [--repeats 3]
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
from lightning_stale.engine.distributed.messages import HEADER_BYTES

TARGET_H, TARGET = 4, 1.5
FEATURES, HIDDEN, CLASSES = 320, (1024, 1024, 1024, 1024), 10
SERVERS = ("central", "collective")


def build_model(lr: float) -> MLPClassifier:
    return MLPClassifier(features=FEATURES, hidden=HIDDEN, classes=CLASSES, lr=lr)


def central_bytes(pushes: float, inner_steps: int, params: int, buffers: int) -> float:
    """Bytes per learner per inner step on the central path: each push carries the
    pseudo-gradient and buffers, its answer the parameters and buffers (module docstring)."""
    return pushes * 4 * (2 * params + 2 * buffers) / max(1, inner_steps)


def collective_bytes(pushes: float, updates: int, inner_steps: int, p: int, params: int, buffers: int,
                     tensors: int, integer_buffers: int) -> float:
    """Bytes per learner per inner step on the collective path (module docstring): a header per
    push; per update the decision (a header and P + 2 float64) and what a ring all-reduce sends
    per rank, 2 (P - 1) / P of its float32 values (Patarasuk and Yuan, 2009), for the push vector
    (pseudo-gradient, buffers, one presence value per parameter tensor) and the integer buffers."""
    ring = 2 * (p - 1) / p
    reduced = params + buffers + tensors + integer_buffers
    per_update = HEADER_BYTES + 8 * (p + 2) + ring * 4 * reduced
    return (pushes * HEADER_BYTES + updates * per_update) / max(1, inner_steps)


def measure(h: int | None, p: int, *, server: str = "central", steps: int, batch_size: int, lr: float,
            warmup: int, seed: int) -> dict | None:
    """One fit on P processes, no injected delay: stock ``ddp`` (``h`` None) or ``sync`` with H
    = ``h`` local steps on the ``server`` path; on global rank 0 its steady-state rates and bytes
    per inner step (see the module docstring), None elsewhere."""
    seed_everything(seed, verbose=False)
    model = build_model(lr)
    params = sum(t.numel() for t in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    buffers = sum(t.numel() for t in model.buffers())
    integer_buffers = sum(t.numel() for t in model.buffers() if not t.is_floating_point())
    samples = batch_size * p * (steps + 50) * 2  # no epoch ends (ddp shards it P ways)
    loader = classification_loader(samples, features=FEATURES, classes=CLASSES, batch_size=batch_size, seed=seed)
    timer = StepTimer(warmup=warmup)
    strategy = "ddp" if h is None else StaleStrategy("sync", p, delay=None, seed=seed, record_trace=False,
                                                      local_steps=h, server=server)
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
        if stats["server_path"] != server:
            raise SystemExit(f"local_updates_vs_ddp.py: asked for server={server!r}, "
                             f"the engine ran on {stats['server_path']!r}")
        interval, updates = stats["mean_update_interval_s"], stats["updates"]
        samples_per_s = stats["gradients_applied"] * h * batch_size / (max(1, updates) * interval)
        pushes = sum(stats["pushes_per_learner"]) / len(stats["pushes_per_learner"])
        if server == "central":
            bytes_per_step = central_bytes(pushes, trainer.global_step, params, buffers)
        else:
            bytes_per_step = collective_bytes(pushes, updates, trainer.global_step, p, params, buffers, tensors,
                                              integer_buffers)
    return {"updates": updates, "inner_steps": trainer.global_step, "pushes_per_learner": pushes,
            "interval_s": interval, "samples_per_s": samples_per_s, "bytes_per_inner_step": bytes_per_step,
            "parameters": params, "fit_wall_s": wall}


def run_launch(args) -> None:
    """One process tree of ``args.child_devices`` processes: ddp and every (H, path), interleaved."""
    p = args.child_devices
    rows = []
    modes = [(None, ""), *((h, server) for h in args.local_steps for server in args.servers)]
    for repeat in range(args.repeats):
        for h, server in modes:
            row = measure(h, p, server=server or "central", steps=args.steps, batch_size=args.batch_size,
                          lr=args.lr, warmup=args.warmup, seed=args.seed)
            if row is None:
                continue
            mode = "ddp" if h is None else "sync"
            rows.append({"devices": p, "mode": mode, "server": server, "h": h, "repeat": repeat, **row})
            rank_print(f"P={p} repeat {repeat} {mode:4s} {server:10s} H={h}: {row['interval_s'] * 1e3:8.2f} ms/update, "
                       f"{row['samples_per_s']:7.0f} samples/s, {row['bytes_per_inner_step'] / 1e6:6.2f} MB "
                       f"per inner step ({row['fit_wall_s']:.1f} s)")
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def summarise(rows: list[dict], devices: list[int]) -> list[dict]:
    summary = []
    for p in devices:
        for mode, server, h in dict.fromkeys((r["mode"], r.get("server", ""), r["h"]) for r in rows
                                             if r["devices"] == p):
            mine = [r for r in rows if r["devices"] == p and r["mode"] == mode and r.get("server", "") == server
                    and r["h"] == h]
            # The ratio of each repeat to the ddp run of the same repeat, then the median.
            per_repeat = ratios_per_repeat(mine, [d for d in rows if d["devices"] == p and d["mode"] == "ddp"])
            vs_ddp = median(per_repeat)
            target = f">= {TARGET}" if h == TARGET_H else ""
            summary.append({"devices": p, "mode": mode, "server": server, "h": "" if h is None else h,
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
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                        help="the paths that run the local updates, side by side")
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
    print(table(summary, ["devices", "mode", "server", "h", "samples_per_s", "vs_ddp", "vs_ddp_per_repeat", "target",
                          "met", "bytes_per_inner_step", "ms_per_update", "updates"]))
    for r in summary:
        if r["target"]:
            print(f"P={r['devices']} {r['server']}: H = {TARGET_H} at {r['vs_ddp']:.2f} x ddp: target "
                  f"{'met' if r['met'] else 'NOT met'}")
    print(f"total {total:.0f} s")
    paths = write_results(out, "local_updates_vs_ddp", summary,
                          {"runs": rows, "steps": args.steps, "repeats": args.repeats,
                           "local_steps": args.local_steps, "servers": args.servers,
                           "batch_size": args.batch_size, "lr": args.lr,
                           "model": f"MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}",
                           "parameters": params, "threads": args.threads,
                           "switch_interval_s": args.switch_interval, "total_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
