"""Wall-clock time to a training loss with stragglers: every variant and K against stock ``ddp``.

P learners (real engine, `StaleStrategy`) train the digits MLP (`lightning_stale.models.MLP`,
64-64-10, `Classifier`, plain SGD) with ShiftedExponential(shift, mean) delays. Stock ``ddp``
gets the same delays from a callback that sleeps ``delay.sample(rank)`` after each backward pass,
so every step waits for the slowest rank at the next all-reduce, as fully synchronous SGD does.

The clock is `WallClockLogger`'s ``time/train_s`` (training seconds from ``on_train_start`` on
rank 0, validation excluded; there is none here). The time to a target loss is the time of the
first update whose running-mean training loss (mean of the last ``--window`` update losses; an
update's loss is the mean of its gradients' mini-batch losses) is below the target.

``sim_*`` columns: the same configuration on the virtual clock (`SimulatedStaleStrategy`, same
delays model and seed, no engine overhead), computed in the launching process before the
P-process launch: the time the engine would take with zero overhead.

The digits training split (1,437 images) is tiled so that a server epoch (ceil(N / m) pushes of
all learners) outlasts a run: epoch ends (flush and pause) would otherwise come every 45 pushes.
Mini-batches are drawn uniformly, so tiling does not change what is learned.

    python benchmarks/straggler_win.py [--max-steps 300] [--targets 0.5 0.4]
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
from pytorch_lightning import Trainer, seed_everything

from _common import (DelayCallback, apply_process_settings, base_parser, digits_loader,
                     is_rank_zero, prepare_out, rank_print, table, trainer_kwargs, write_results)
from lightning_stale import SimulatedStaleStrategy, StaleStrategy, WallClockLogger
from lightning_stale.delays import ShiftedExponential
from lightning_stale.models import MLP, Classifier
from lightning_stale.method.theory import expected_iteration_time

K_VARIANTS = ("k_sync", "k_batch_sync", "k_async", "k_batch_async")


def configurations(p: int, ks: list[int]) -> list[tuple[str, int]]:
    runs = [("ddp", p), ("sync", p), ("async", 1)]
    runs += [(name, k) for name in K_VARIANTS for k in ks if 1 <= k <= p]
    return runs


def time_to_target(rows: list[dict], target: float, window: int) -> tuple[float, float]:
    """(train seconds, update) of the first update whose trailing mean loss is below target."""
    losses = np.array([r["train/loss"] for r in rows], dtype=float)
    for i in range(window - 1, len(losses)):
        if np.nanmean(losses[i - window + 1:i + 1]) < target:
            return float(rows[i]["time/train_s"]), float(rows[i]["update"])
    return math.nan, math.nan


def model(lr: float) -> Classifier:
    return Classifier(MLP((64,), 10, hidden_sizes=(64,)), lr=lr)


def delay_model(args, index: int) -> ShiftedExponential:
    return ShiftedExponential(shift=args.shift, mean=args.mean, seed=args.seed + index)


def summarise(rows: list[dict], args) -> dict:
    result = {"updates": len(rows), "train_s": rows[-1]["time/train_s"] if rows else math.nan,
              "final_loss": float(np.mean([r["train/loss"] for r in rows[-args.window:]])) if rows else math.nan}
    for target in args.targets:
        seconds, update = time_to_target(rows, target, args.window)
        result[f"t_{target}_s"] = seconds
        result[f"update_{target}"] = update
    return result


def simulate(args, p: int, runs, loader_repeat: int) -> dict[tuple[str, int], dict]:
    """Virtual-clock twin of every configuration (ddp's is the sync variant's)."""
    predictions = {}
    for index, (name, k) in enumerate(runs):
        seed_everything(args.seed, verbose=False)
        logger = WallClockLogger()
        strategy = SimulatedStaleStrategy("sync" if name == "ddp" else name, k, num_learners=p,
                                          delay=delay_model(args, index), seed=args.seed)
        trainer = Trainer(devices=1, max_steps=args.max_steps, strategy=strategy, callbacks=[logger],
                          **trainer_kwargs())
        trainer.fit(model(args.lr), train_dataloaders=digits_loader(args.batch_size, loader_repeat, args.seed))
        predictions[(name, k)] = summarise(logger.rows, args)
        print(f"simulated {name:14s} K={k}: " + ", ".join(
            f"t({t}) = {predictions[(name, k)][f't_{t}_s']:.2f} s" for t in args.targets), flush=True)
    return predictions


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=300, help="server updates / ddp steps per run")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.4],
                        help="training losses; the first one is the headline")
    parser.add_argument("--window", type=int, default=20, help="updates in the running mean")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--shift", type=float, default=0.01)
    parser.add_argument("--mean", type=float, default=0.05, help="mean of the exponential part (s)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-simulate", dest="simulate", action="store_false",
                        help="skip the virtual-clock predictions")
    args = parser.parse_args()
    apply_process_settings(args)
    p = args.learners
    runs = configurations(p, args.ks)
    # An epoch of the tiled set holds at least P x max_steps pushes (the sync variant's count).
    loader_repeat = max(1, math.ceil(1.2 * p * args.max_steps * args.batch_size / 1437))
    launching = "LOCAL_RANK" not in os.environ  # before the launch: the only process so far
    predictions = simulate(args, p, runs, loader_repeat) if args.simulate and launching else {}
    out = prepare_out(args.out) if is_rank_zero() else Path(args.out)
    rows = []
    launch = time.monotonic()
    for index, (name, k) in enumerate(runs):
        seed_everything(args.seed, verbose=False)
        logger = WallClockLogger()
        delay = delay_model(args, index)
        if name == "ddp":
            trainer = Trainer(devices=p, strategy="ddp", max_steps=args.max_steps,
                              callbacks=[logger, DelayCallback(delay)], **trainer_kwargs())
        else:
            strategy = StaleStrategy(name, k, delay=delay, seed=args.seed, record_trace=False)
            trainer = Trainer(devices=p, strategy=strategy, max_steps=args.max_steps, callbacks=[logger],
                              **trainer_kwargs())
        start = time.monotonic()
        trainer.fit(model(args.lr), train_dataloaders=digits_loader(args.batch_size, loader_repeat, args.seed))
        wall = time.monotonic() - start
        if not is_rank_zero():
            continue
        row = {"variant": name, "k": k, **summarise(logger.rows, args), "fit_wall_s": wall}
        row["s_per_update"] = row["train_s"] / max(1, row["updates"])
        theory_variant = "sync" if name == "ddp" else name
        try:
            row["theory_s_per_update"] = expected_iteration_time(
                theory_variant, p, k, ShiftedExponential(args.shift, args.mean), updates=20000)
        except ValueError:
            row["theory_s_per_update"] = math.nan
        if name != "ddp":
            stats = trainer.strategy.stats
            row["epochs_ended"] = stats.get("epochs")
            row["dropped"] = stats.get("gradients_dropped")
        sim = predictions.get((name, k))
        if sim:
            for target in args.targets:
                row[f"sim_t_{target}_s"] = sim[f"t_{target}_s"]
                row[f"real/sim_{target}"] = row[f"t_{target}_s"] / sim[f"t_{target}_s"]
        rows.append(row)
        rank_print(f"{name:14s} K={k}: " + ", ".join(f"t({t}) = {row[f't_{t}_s']:.2f} s" for t in args.targets)
                   + f", {row['updates']} updates in {row['train_s']:.1f} s, final loss {row['final_loss']:.3f}"
                   + f" (fit {wall:.0f} s)")
    if not is_rank_zero():
        return
    total = time.monotonic() - launch
    ddp = next(r for r in rows if r["variant"] == "ddp")
    for row in rows:
        for target in args.targets:
            row[f"ddp/this_{target}"] = ddp[f"t_{target}_s"] / row[f"t_{target}_s"]
    first = args.targets[0]
    columns = ["variant", "k", "theory_s_per_update", "s_per_update", f"t_{first}_s", f"update_{first}"]
    columns += [f"t_{target}_s" for target in args.targets[1:]]
    columns += [f"ddp/this_{first}"]
    if predictions:
        columns += [f"sim_t_{first}_s", f"real/sim_{first}"]
    columns += ["final_loss"]
    print()
    print(f"P = {p}, digits MLP, lr {args.lr}, batch {args.batch_size}, ShiftedExponential(shift={args.shift}, "
          f"mean={args.mean}), {args.max_steps} updates per run, running mean over {args.window} updates")
    print(table(rows, columns))
    ranked = sorted((r for r in rows if not math.isnan(r[f"t_{first}_s"])), key=lambda r: r[f"t_{first}_s"])
    print(f"fastest to loss {first}: " + ", ".join(f"{r['variant']}(K={r['k']}) {r[f't_{first}_s']:.2f} s"
                                                   for r in ranked[:5]))
    print(f"{len(rows)} runs in one launch: {total:.0f} s")
    paths = write_results(out, "straggler_win", rows,
                          {"learners": p, "shift_s": args.shift, "exp_mean_s": args.mean, "lr": args.lr,
                           "batch_size": args.batch_size, "max_steps": args.max_steps,
                           "targets": args.targets, "window": args.window, "threads": args.threads,
                           "switch_interval_s": args.switch_interval, "loader_repeat": loader_repeat,
                           "launch_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
