"""Runtime fidelity of the real parameter-server engine (`StaleStrategy`).

For each of the six variants (K = --k for the K-variants), P learner processes with injected
Exponential(mean) straggler delays and a tiny least-squares model (compute is negligible): the
measured mean time per server update (``trainer.strategy.stats["mean_update_interval_s"]``)
divided by the theory's E[T] (`lightning_stale.method.theory.expected_iteration_time`). Target: within
5 %.

Two more columns separate the causes of a gap:

* ``replay_s``: the same delays (the engine's recorded trace) replayed on the virtual clock
  (`monte_carlo_iteration_times` with a `Trace`), i.e. the time per update the engine would
  show with zero overhead. measured / replay is the engine's own overhead on these draws,
  free of sampling noise; replay / theory is the sampling noise of this many updates.
* ``nodelay_s``: the mean time per update with no injected delay: the engine's cost per update
  (compute, flattening, the round trip to the server, Lightning's loop) on this machine.

All fits run in ONE launch: the popen launcher starts the P processes once and every later
``Trainer(...).fit`` in the script reuses them.

    python benchmarks/runtime_fidelity.py [--seconds 60] [--delay-mode total] [--out benchmarks/results]
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from pytorch_lightning import Trainer, seed_everything

from _common import (TinyRegression, add_delay_mode_argument, apply_process_settings, base_parser, is_rank_zero,
                     prepare_out, rank_print, regression_loader, table, trainer_kwargs,
                     write_results)
from lightning_stale import StaleStrategy
from lightning_stale.delays import Exponential, Trace
from lightning_stale.method.theory import expected_iteration_time, monte_carlo_iteration_times

VARIANTS = ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")


def variant_k(name: str, k: int, p: int) -> int:
    return {"sync": p, "async": 1}.get(name, k)


def fit(name: str, k: int, p: int, updates: int, delay, batch_size: int, seed: int,
        trace_path: Path | None, delay_mode: str = "after_compute",
        epoch_batches: int = 0) -> tuple[dict, float]:
    seed_everything(seed, verbose=False)
    # By default enough samples that no epoch ends during the run (an epoch is ceil(N / m)
    # pushes of all learners together; the sync variant pushes P gradients per update); with
    # ``epoch_batches`` an epoch is that many mini-batches, to check that epoch ends cost nothing.
    samples = batch_size * (epoch_batches or (p * updates + 16 * p) * 2)
    strategy = StaleStrategy(name, k, delay=delay, seed=seed, delay_mode=delay_mode,
                             record_trace=str(trace_path) if trace_path else False)
    trainer = Trainer(devices=p, max_steps=updates, strategy=strategy, **trainer_kwargs())
    loader = regression_loader(samples, batch_size=batch_size, seed=seed)
    start = time.monotonic()
    trainer.fit(TinyRegression(), train_dataloaders=loader)
    return dict(trainer.strategy.stats), time.monotonic() - start


def replay(name: str, p: int, k: int, trace_path: Path, updates: int) -> float:
    """Mean time per update (from the first update on, as the engine measures it) when the
    engine's own recorded delays are replayed on the virtual clock."""
    trace = Trace(trace_path, on_exhausted="cycle")
    times = monte_carlo_iteration_times(name, p, k, trace, updates=updates, seed=None)
    return float(times[1:].mean())


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=500, help="server updates per variant, at least")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="run each variant for about this long at theory's E[T] (more updates "
                             "for the fast variants, so every variant draws about as many delays "
                             "and the sampling noise, replay/theory, is alike); 0: --updates only")
    parser.add_argument("--nodelay-updates", type=int, default=300,
                        help="server updates per variant of the no-delay (overhead) runs; 0 skips them")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--k", type=int, default=2, help="K of the K-variants")
    parser.add_argument("--mean", type=float, default=0.05, help="mean injected delay (s)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--epoch-batches", type=int, default=0,
                        help="mini-batches per epoch (as a DDP rank's epoch of BoringModel: 64), so "
                             "that epochs end during the run; 0: none ends")
    add_delay_mode_argument(parser)
    args = parser.parse_args()
    apply_process_settings(args)
    out = prepare_out(args.out) if is_rank_zero() else Path(args.out)
    p = args.learners
    rows = []
    launch = time.monotonic()
    for name in args.variants:
        k = variant_k(name, args.k, p)
        trace_path = out / "traces" / f"runtime_fidelity_{name}.csv"
        # Seeded by the variant, not by its place in --variants: a run of one variant draws
        # the same delays as in a run of all six.
        delay = Exponential(mean=args.mean, seed=args.seed + VARIANTS.index(name))
        theory = expected_iteration_time(name, p, k, Exponential(mean=args.mean))
        updates = max(args.updates, math.ceil(args.seconds / theory))
        stats, wall = fit(name, k, p, updates, delay, args.batch_size, args.seed, trace_path,
                          args.delay_mode, args.epoch_batches)
        if not is_rank_zero():
            continue
        measured = stats["mean_update_interval_s"]
        replayed = replay(name, p, k, trace_path, stats["updates"])
        trace = Trace(trace_path)
        drawn = [trace.sample(l) for l in trace.learners for _ in range(trace.num_recorded(l))]
        row = {"variant": name, "k": k, "updates": stats["updates"], "measured_s": measured,
               "theory_s": theory, "measured/theory": measured / theory,
               "replay_s": replayed, "measured/replay": measured / replayed,
               "replay/theory": replayed / theory,
               "overhead_per_update_s": measured - replayed,
               "mean_delay_drawn_s": statistics.fmean(drawn) if drawn else math.nan,
               "epochs_ended": stats.get("epochs"), "dropped": stats.get("gradients_dropped"),
               "cancellations": stats.get("cancellations"), "fit_wall_s": wall}
        rows.append(row)
        rank_print(f"{name:14s} K={k} measured {measured * 1e3:7.2f} ms  theory {theory * 1e3:7.2f} ms  "
                   f"ratio {measured / theory:.3f}  replay ratio {measured / replayed:.3f}  ({wall:.0f} s)")
    if args.nodelay_updates > 0:
        for name in args.variants:
            k = variant_k(name, args.k, p)
            stats, wall = fit(name, k, p, args.nodelay_updates, None, args.batch_size, args.seed, None)
            if is_rank_zero():
                for row in rows:
                    if row["variant"] == name:
                        row["nodelay_s"] = stats["mean_update_interval_s"]
                rank_print(f"{name:14s} K={k} no delay: {stats['mean_update_interval_s'] * 1e3:.2f} ms/update ({wall:.0f} s)")
    if not is_rank_zero():
        return
    total = time.monotonic() - launch
    columns = ["variant", "k", "updates", "theory_s", "measured_s", "measured/theory", "replay_s",
               "replay/theory", "measured/replay", "overhead_per_update_s", "nodelay_s"]
    print()
    print(f"P = {p} learners, Exponential(mean={args.mean}) delays, at least {args.updates} updates "
          f"and about {args.seconds:g} s per variant, delay_mode={args.delay_mode}, target |measured/theory - 1| <= 5 %")
    print(table(rows, columns))
    within = [r["variant"] for r in rows if abs(r["measured/theory"] - 1) <= 0.05]
    print(f"within 5 % of theory: {len(within)}/{len(rows)} ({', '.join(within)}); "
          f"all fits in one launch: {total:.0f} s")
    paths = write_results(out, "runtime_fidelity", rows,
                          {"learners": p, "k": args.k, "delay_mean_s": args.mean,
                           "updates": args.updates, "seconds": args.seconds,
                           "delay_mode": args.delay_mode, "nodelay_updates": args.nodelay_updates,
                           "batch_size": args.batch_size, "threads": args.threads,
                           "switch_interval_s": args.switch_interval,
                           "launch_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
