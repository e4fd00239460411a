"""Wall-clock time to a target loss under stragglers: local updates against ``ddp`` and H = 1.

One race of the Hydra app (``python -m lightning_stale.train``, the real engine: `StaleStrategy`
with P = 4 learner processes on CPU/gloo, one launch for every contestant, as
``recipes/race_ddp.yaml``) on the default race's digits MLP (64-64-10, SGD lr 0.1, batch 32 per
learner). Every contestant faces the same shifted-exponential stragglers, X = 0.01 s +
Exp(mean 0.05 s) per mini-batch, drawn from the same seeded model: the server engine's learners
add their draw after backward; stock ``ddp`` (the race's ``sync@ddp`` contestant) sleeps it after
backward on every rank, so each all-reduce waits for the slowest rank.

Contestants: ``ddp``, and for each ``--variants`` entry (default: sync, K-sync with K = 3,
K-batch-async with K = 2) one contestant per ``--h`` (default 1, 4, 8), given as race contestants
with the override ``variant.local_steps: H`` (docs/how-to/local-updates.md). The outer step is
plain averaging (local SGD, Wang and Joshi, "Cooperative SGD", JMLR 2021), or with
``--outer nesterov`` DiLoCo's SGD with Nesterov momentum, lr 0.7, momentum 0.9 (Douillard et al.,
2023) for the sync family (it diverges on stale pseudo-gradients, so the async family keeps
plain averaging). ``ddp`` runs ``--ddp-steps`` steps; every other contestant ``--budget``
times as many inner steps (``max_steps`` counts inner steps: ceil(steps / H) updates), so that
each has room to reach the target.

Definitions (those of the race, `lightning_stale.analysis.race`):

* smoothed loss: the mean training loss of the last ``--window`` updates (an update's loss is the
  mean mini-batch loss of its pushes; with H > 1 a push's loss is the mean over its H inner
  steps, and a window of W updates spans W x H inner steps, so the smoothed loss of H > 1 lags
  its parameters more than H = 1's: the measure is conservative for local updates);
* target loss, one for all: ddp's smoothed loss at the end of its budget (its final loss), never
  chosen per contestant;
* time to the target: ``time/train_s`` (training seconds of rank 0, validation excluded; there is
  none here) of the first update whose smoothed loss is at or below the target; ``updates`` and
  ``inner_steps`` (updates x H, the inner steps along the server's trajectory, what
  ``global_step`` counts) at that update;
* ``ddp/this``: ddp's time to the target over this contestant's (above 1: this one is faster);
  ``h1/this``: the same with the H = 1 contestant of the same variant and K.

The best local-update contestant is the one with H > 1 that reaches the target first.

    python benchmarks/time_to_target.py [--ddp-steps 300] [--budget 2] [--h 1 4 8]
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from _common import base_parser, prepare_out, table, write_results
from lightning_stale.analysis.race import final_loss, time_to_loss, write_race_report
from lightning_stale.analysis.runs import load_run
from lightning_stale.config import parse_contestant

NESTEROV = "{class_path: torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9, nesterov: true}}"
SYNC_FAMILY = ("sync", "k_sync", "k_batch_sync")


def contestants(args) -> list[dict]:
    """The race's contestants, ddp first, each with the (variant, K, H, outer) it stands for."""
    found = [dict(spec=f"{{variant: sync, engine: ddp, overrides: {{trainer.max_steps: {args.ddp_steps}}}}}",
                  variant="ddp", k=None, h=1, outer="")]
    for index, spec in enumerate(args.variants, start=1):
        parsed = parse_contestant(spec, "server", index)  # (the race's VARIANT[:K], checked)
        name, k = parsed.variant, parsed.k
        for h in args.h:
            nesterov = args.outer == "nesterov" and h > 1 and name in SYNC_FAMILY
            overrides = [f"variant.local_steps: {h}"] + ([f"variant.outer_optimizer: {NESTEROV}"]
                                                        if nesterov else [])
            text = f"{{variant: {name}, " + (f"k: {k}, " if k is not None else "") + \
                f"overrides: {{{', '.join(overrides)}}}}}"
            found.append(dict(spec=text, variant=name, k=k, h=h,
                              outer="" if h == 1 else ("nesterov" if nesterov else "average")))
    return found


def race_overrides(args, race_dir: Path, entries: list[dict]) -> list[str]:
    """The app's command-line overrides for the race of ``entries`` into ``race_dir``."""
    specs = [entry["spec"] for entry in entries]
    return [f"hydra.run.dir={race_dir}", f"seed={args.seed}", f"delay.seed={args.seed}",
            f"delay.shift={args.shift}", f"delay.mean={args.mean}", f"trainer.devices={args.learners}",
            f"trainer.max_steps={args.budget_steps}", "validate=false",
            "trainer.check_val_every_n_epoch=100000", f"race.window={args.window}",
            "race.target_loss=null", f"race.contestants=[{','.join(specs)}]"]


def run_race(args, race_dir: Path, entries: list[dict]) -> None:
    """The race in its own P processes (Lightning's popen launcher re-runs the app's command)."""
    command = [sys.executable, "-m", "lightning_stale.train", *race_overrides(args, race_dir, entries)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, env=env)


def contestant_dirs(race_dir: Path) -> list[Path]:
    """The race's run directories in race order (``<n>-<name>``)."""
    found = [path for path in (race_dir / "contestants").iterdir() if path.is_dir()]
    return sorted(found, key=lambda path: int(re.match(r"\d+", path.name)[0]))


def measure(entries: list[dict], dirs: list[Path], window: int) -> tuple[list[dict], float]:
    """One row per contestant against the target, ddp's final smoothed loss."""
    runs = [load_run(path) for path in dirs]
    target = final_loss(runs[0].losses, window)
    rows = []
    for entry, run in zip(entries, runs):
        seconds, update = time_to_loss(run.times, run.losses, target, window)
        updates = len(run.losses)
        row = {"contestant": "ddp" if entry["variant"] == "ddp" else run.label,
               "variant": entry["variant"], "k": run.k, "h": entry["h"], "outer": entry["outer"],
               "t_target_s": seconds,
               "updates_at_target": update if update is not None else math.nan,
               "inner_steps_at_target": update * entry["h"] if update is not None else math.nan,
               "ddp/this": math.nan, "h1/this": math.nan,
               "updates": updates, "inner_steps": updates * entry["h"],
               "train_s": float(run.times[-1]) if updates else math.nan,
               "s_per_inner_step": float(run.times[-1]) / (updates * entry["h"]) if updates else math.nan,
               "final_loss": final_loss(run.losses, window)}
        rows.append(row)
    ddp = rows[0]["t_target_s"]
    for row in rows:
        row["ddp/this"] = ddp / row["t_target_s"] if row["t_target_s"] > 0 else math.nan
        same = next(r for r in rows if (r["variant"], r["k"], r["h"]) == (row["variant"], row["k"], 1))
        if row["variant"] != "ddp":
            row["h1/this"] = same["t_target_s"] / row["t_target_s"] if row["t_target_s"] > 0 else math.nan
    return rows, target


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--ddp-steps", type=int, default=300, help="ddp's steps, the target's budget")
    parser.add_argument("--budget", type=float, default=2.0,
                        help="every other contestant's inner steps, in multiples of --ddp-steps")
    parser.add_argument("--variants", nargs="+", default=["sync", "k_sync:3", "k_batch_async:2"],
                        help="VARIANT or VARIANT:K, each raced at every --h")
    parser.add_argument("--h", type=int, nargs="+", default=[1, 4, 8], help="local steps per push")
    parser.add_argument("--outer", choices=["average", "nesterov"], default="average",
                        help="outer step of the sync family at H > 1")
    parser.add_argument("--window", type=int, default=10, help="updates in the smoothed loss")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--shift", type=float, default=0.01)
    parser.add_argument("--mean", type=float, default=0.05, help="mean of the exponential part (s)")
    args = parser.parse_args()
    if 1 not in args.h:
        parser.error("--h must include 1: every H > 1 is compared with H = 1 of its variant")
    args.budget_steps = math.ceil(args.budget * args.ddp_steps)
    out = prepare_out(args.out)
    race_dir = (out / "runs" / f"time_to_target-race-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}").resolve()
    entries = contestants(args)
    start = time.monotonic()
    run_race(args, race_dir, entries)
    total = time.monotonic() - start
    dirs = contestant_dirs(race_dir)
    rows, target = measure(entries, dirs, args.window)
    # The race's figure and table again, with this benchmark's target.
    report = write_race_report(dirs, race_dir, labels=[row["contestant"] for row in rows],
                               target_loss=target, window=args.window)
    local = [r for r in rows if r["h"] > 1 and not math.isnan(r["t_target_s"])]
    best = min(local, key=lambda r: r["t_target_s"]) if local else None
    columns = ["contestant", "h", "outer", "t_target_s", "updates_at_target", "inner_steps_at_target",
               "ddp/this", "h1/this", "updates", "inner_steps", "s_per_inner_step", "final_loss"]
    print()
    print(f"P = {args.learners}, digits MLP, ShiftedExponential(shift={args.shift}, mean={args.mean}), "
          f"target loss {target:.4g} (ddp's final, mean of the last {args.window} updates)")
    print(table(rows, columns))
    if best:
        print(f"best local-update contestant: {best['contestant']}: {best['t_target_s']:.2f} s, "
              f"{best['ddp/this']:.3g} x ddp's speed, {best['h1/this']:.3g} x its H = 1's")
    print(f"race: {report.figure} ({total:.0f} s)")
    summary = {"target_loss": target, "window": args.window, "ddp_t_target_s": rows[0]["t_target_s"],
               "best_local": best["contestant"] if best else "none reached the target"}
    if best:
        summary.update({"best_h": best["h"], "best_t_target_s": best["t_target_s"],
                        "best_ddp/this": best["ddp/this"], "best_h1/this": best["h1/this"]})
    settings = {"learners": args.learners, "shift_s": args.shift, "exp_mean_s": args.mean,
                "ddp_steps": args.ddp_steps, "inner_step_budget": args.budget_steps,
                "variants": args.variants, "h": args.h, "outer": args.outer, "window": args.window,
                "target_loss": target, "threads": args.threads, "launch_wall_s": total,
                "summary": summary}
    paths = write_results(out, "time_to_target", rows, settings)
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
