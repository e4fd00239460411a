"""Record a cluster's real stragglers with stock ``ddp``: the first step of the advisor's loop.

P CPU processes train the digits MLP with Lightning's own ``ddp`` strategy. Stragglers are
injected as in ``straggler_win.py``: every rank sleeps ``ShiftedExponential(shift, mean)`` seconds
after its backward pass (`DelayCallback`, listed before the timer so the sleep counts as that
learner's computation). `MiniBatchTimer` records every rank's time per mini-batch and rank 0
writes ``minibatch_times.csv`` into ``--trace-out``; then

    lightning-stale-advise <trace-out>/minibatch_times.csv --override model.lr=0.3

fits it and recommends a variant and K (docs/how-to/advisor.md). The per-learner means go to
the results file like every benchmark's.
On a real cluster, leave out ``--shift``/``--mean`` (``--no-delay``): the trace then holds the
cluster's own straggling.

    python benchmarks/record_minibatch_times.py [--devices 4] [--steps 300]
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from pytorch_lightning import Trainer, seed_everything

from _common import (DEFAULT_OUT, DelayCallback, apply_process_settings, base_parser, digits_loader,
                     is_rank_zero, rank_print, trainer_kwargs, write_results)
from lightning_stale import MiniBatchTimer
from lightning_stale.delays import ShiftedExponential, read_trace
from lightning_stale.models import MLP, Classifier


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="ddp processes (learners)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--shift", type=float, default=0.01, help="injected delay's shift (s)")
    parser.add_argument("--mean", type=float, default=0.05,
                        help="mean of the injected delay's exponential part (s)")
    parser.add_argument("--no-delay", dest="inject", action="store_false",
                        help="record the machine's own straggling, nothing injected")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--trace-out", default=str(DEFAULT_OUT / "minibatch_times"),
                        help="folder for the recorded minibatch_times.csv")
    args = parser.parse_args()
    apply_process_settings(args)
    seed_everything(args.seed, verbose=False)
    # an epoch of the tiled set outlasts the run (the digits split is 1,437 images)
    repeat = max(1, math.ceil(1.2 * args.steps * args.batch_size * args.devices / 1437))
    callbacks = [DelayCallback(ShiftedExponential(args.shift, args.mean, seed=args.seed))] \
        if args.inject else []
    timer = MiniBatchTimer(args.trace_out)
    trainer = Trainer(devices=args.devices, strategy="ddp", max_steps=args.steps,
                      callbacks=[*callbacks, timer], **trainer_kwargs())
    started = time.monotonic()
    trainer.fit(Classifier(MLP((64,), 10, hidden_sizes=(64,)), lr=0.3),
                train_dataloaders=digits_loader(args.batch_size, repeat, args.seed))
    wall = time.monotonic() - started
    if is_rank_zero():
        rank_print(f"{args.devices} ddp processes, {args.steps} steps in {wall:.1f} s; trace: {timer.written}")
        _, delays = read_trace(timer.written)
        rows = []
        for learner in sorted(delays):
            times = delays[learner]
            rows.append({"learner": learner, "minibatches": len(times),
                         "mean_s": sum(times) / len(times), "min_s": min(times), "max_s": max(times)})
        paths = write_results(args.out, "record_minibatch_times", rows,
                              {"devices": args.devices, "steps": args.steps, "injected": args.inject,
                               "shift_s": args.shift, "mean_s": args.mean, "wall_s": wall,
                               "trace": str(timer.written)})
        rank_print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
