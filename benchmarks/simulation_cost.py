"""Cost of the simulated engine (`SimulatedStaleStrategy`) against plain Lightning training.

One process. Every Lightning training step of the simulated engine computes one simulated
learner's gradient (one push); the plain run (``devices=1``, Lightning's stock single-device
strategy) computes one gradient and steps the optimizer. Same model (the digits MLP,
`lightning_stale.models.MLP` 64-64-10 in a `Classifier`), same batch size, same number of
Lightning steps. Reported: gradient computations per second of the simulated engine (pushes
computed / wall seconds, in the steady state: mean time between training steps after a warm-up)
divided by plain training steps per second. Target: at least 0.8.

Runs are interleaved (plain, then each variant, ``--repeats`` times) and the table shows medians,
with the ratio taken against the plain run of the same repeat.

    python benchmarks/simulation_cost.py [--steps 2000] [--repeats 3]
"""

from __future__ import annotations

import math
import time

from pytorch_lightning import Trainer, seed_everything

from _common import (StepTimer, apply_process_settings, base_parser, digits_loader, median,
                     prepare_out, table, trainer_kwargs, write_results)
from lightning_stale import SimulatedStaleStrategy
from lightning_stale.delays import Exponential
from lightning_stale.models import MLP, Classifier

VARIANTS = ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="Lightning training steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the timing")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--k", type=int, default=2, help="K of the K-variants")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    apply_process_settings(args)
    out = prepare_out(args.out)
    p = args.learners
    repeat_tiles = max(1, math.ceil(1.2 * args.steps * args.batch_size / 1437))  # one epoch per run
    runs = [("plain", None)] + [(v, {"sync": p, "async": 1}.get(v, args.k)) for v in args.variants]
    rows = []
    start_all = time.monotonic()
    for repeat in range(args.repeats):
        for name, k in runs:
            seed_everything(args.seed, verbose=False)
            timer = StepTimer(warmup=args.warmup)
            # One epoch of --steps training steps (with the simulated engine max_steps would count
            # server updates, not gradient computations).
            kwargs = trainer_kwargs(devices=1, callbacks=[timer], max_epochs=1,
                                    limit_train_batches=args.steps)
            if name == "plain":
                trainer = Trainer(**kwargs)
            else:
                strategy = SimulatedStaleStrategy(name, k, num_learners=p, seed=args.seed,
                                                  delay=Exponential(0.05, seed=args.seed))
                trainer = Trainer(strategy=strategy, **kwargs)
            start = time.monotonic()
            trainer.fit(Classifier(MLP((64,), 10, hidden_sizes=(64,)), lr=0.1),
                        train_dataloaders=digits_loader(args.batch_size, repeat_tiles, args.seed))
            wall = time.monotonic() - start
            steps = len(timer.times)
            row = {"run": name, "k": k, "repeat": repeat, "steps": steps,
                   "steps_per_s": 1.0 / timer.mean_interval_s, "fit_wall_s": wall}
            if name != "plain":
                stats = trainer.strategy.stats
                row["pushes"] = stats["gradients_received"]
                row["updates"] = stats["updates"]
            rows.append(row)
            print(f"repeat {repeat} {name:14s} K={k}: {row['steps_per_s']:8.1f} gradient computations/s "
                  f"({wall:.1f} s)", flush=True)
    total = time.monotonic() - start_all
    summary = []
    for name, k in runs:
        mine = [r for r in rows if r["run"] == name]
        ratios = []
        for r in mine:
            plain = next(x for x in rows if x["run"] == "plain" and x["repeat"] == r["repeat"])
            ratios.append(r["steps_per_s"] / plain["steps_per_s"])
        summary.append({"run": name, "k": k, "steps_per_s": median([r["steps_per_s"] for r in mine]),
                        "vs_plain": median(ratios), "vs_plain_per_repeat": " ".join(f"{x:.3f}" for x in ratios),
                        "pushes_per_update": (mine[0]["pushes"] / mine[0]["updates"]
                                              if mine[0].get("updates") else "")})
    print()
    print(f"P = {p} simulated learners, digits MLP 64-64-10, batch {args.batch_size}, {args.steps} steps per run, "
          f"median of {args.repeats} interleaved repeats; target >= 0.8 x plain")
    print(table(summary, ["run", "k", "steps_per_s", "vs_plain", "vs_plain_per_repeat", "pushes_per_update"]))
    print(f"total {total:.0f} s")
    paths = write_results(out, "simulation_cost", summary,
                          {"runs": rows, "learners": p, "k": args.k, "steps": args.steps,
                           "repeats": args.repeats, "batch_size": args.batch_size,
                           "threads": args.threads, "switch_interval_s": args.switch_interval,
                           "total_wall_s": total})
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
