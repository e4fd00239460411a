"""K-batch-async with one persistently slow learner, on the real engine (`StaleStrategy`).

P learners with Exponential(mean) delays, learner ``--slow`` ``--factor`` times slower
(`SlowLearners`). K-batch-async never waits for a particular learner, so the server should
update at the rate the learners produce gradients together: the ideal is

    updates/s = (1/K) * sum_l 1 / mean_of(l)

Reported: measured updates/s (1 / ``stats["mean_update_interval_s"]``) divided by that ideal,
for each K in ``--ks``. Target: at least 0.9. ``replay_updates_per_s`` replays the engine's
recorded delays on the virtual clock (zero overhead, same draws): measured / replay is the
engine's own loss, replay / ideal the sampling noise of this many updates. A tiny least-squares model keeps compute
negligible; the training set is large enough that no epoch ends during the run. All fits run in
one launch (the popen launcher reuses the P processes).

    python benchmarks/slow_learner.py [--updates 600] [--ks 1 2 3 4] [--delay-mode total]
"""

from __future__ import annotations

import time
from pathlib import Path

from pytorch_lightning import Trainer, seed_everything

from _common import (TinyRegression, add_delay_mode_argument, apply_process_settings, base_parser, is_rank_zero,
                     prepare_out, rank_print, regression_loader, table, trainer_kwargs,
                     write_results)
from lightning_stale import StaleStrategy
from lightning_stale.delays import Exponential, SlowLearners, Trace
from lightning_stale.method.theory import monte_carlo_iteration_times


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=600, help="server updates per K")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--mean", type=float, default=0.05, help="mean delay of a normal learner (s)")
    parser.add_argument("--slow", type=int, nargs="+", default=[3], help="the slow learners")
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=32)
    add_delay_mode_argument(parser)
    args = parser.parse_args()
    apply_process_settings(args)
    out = prepare_out(args.out) if is_rank_zero() else Path(args.out)
    p = args.learners
    rows = []
    launch = time.monotonic()
    for i, k in enumerate(args.ks):
        delay = SlowLearners(Exponential(mean=args.mean, seed=args.seed + i), learners=args.slow,
                             factor=args.factor)
        seed_everything(args.seed, verbose=False)
        trace_path = out / "traces" / f"slow_learner_k{k}.csv"
        strategy = StaleStrategy("k_batch_async", k, delay=delay, seed=args.seed,
                                 delay_mode=args.delay_mode, record_trace=str(trace_path))
        trainer = Trainer(devices=p, max_steps=args.updates, strategy=strategy, **trainer_kwargs())
        # At most K pushes per update: an epoch of ceil(N / m) pushes outlasts the run.
        samples = args.batch_size * (k * args.updates + 16 * p) * 2
        start = time.monotonic()
        trainer.fit(TinyRegression(), train_dataloaders=regression_loader(samples, batch_size=args.batch_size,
                                                                          seed=args.seed))
        wall = time.monotonic() - start
        if not is_rank_zero():
            continue
        stats = trainer.strategy.stats
        ideal = sum(1.0 / delay.mean_of(l) for l in range(p)) / k
        measured = 1.0 / stats["mean_update_interval_s"]
        pushes = stats["pushes_per_learner"]
        duration = stats["updates"] * stats["mean_update_interval_s"]
        times = monte_carlo_iteration_times("k_batch_async", p, k, Trace(trace_path, on_exhausted="cycle"),
                                            updates=stats["updates"], seed=None)
        replayed = 1.0 / float(times[1:].mean())
        row = {"k": k, "updates": stats["updates"], "ideal_updates_per_s": ideal,
               "measured_updates_per_s": measured, "ratio": measured / ideal,
               "replay_updates_per_s": replayed, "measured/replay": measured / replayed,
               "replay/ideal": replayed / ideal,
               "pushes_per_learner": " ".join(map(str, pushes)),
               "slow_learner_share": sum(pushes[l] for l in args.slow) / max(1, sum(pushes)),
               "ideal_slow_share": sum(1.0 / delay.mean_of(l) for l in args.slow)
               / sum(1.0 / delay.mean_of(l) for l in range(p)),
               "run_s_approx": duration, "epochs_ended": stats.get("epochs"), "fit_wall_s": wall}
        rows.append(row)
        rank_print(f"K={k}: {measured:.2f} updates/s, ideal {ideal:.2f}, ratio {measured / ideal:.3f} ({wall:.0f} s)")
    if not is_rank_zero():
        return
    total = time.monotonic() - launch
    print()
    print(f"k_batch_async, P = {p}, Exponential(mean={args.mean}) with learners {args.slow} x{args.factor}, "
          f"{args.updates} updates per K, delay_mode={args.delay_mode}; target ratio >= 0.9")
    print(table(rows, ["k", "updates", "ideal_updates_per_s", "measured_updates_per_s", "ratio",
                       "replay/ideal", "measured/replay", "pushes_per_learner", "slow_learner_share", "ideal_slow_share"]))
    print(f"all fits in one launch: {total:.0f} s")
    paths = write_results(out, "slow_learner", rows,
                          {"variant": "k_batch_async", "learners": p, "delay_mean_s": args.mean,
                           "slow": args.slow, "factor": args.factor, "updates": args.updates,
                           "delay_mode": args.delay_mode,
                           "batch_size": args.batch_size, "threads": args.threads,
                           "switch_interval_s": args.switch_interval, "launch_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
