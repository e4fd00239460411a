"""``lightning-stale-advise``: the advisor (`lightning_stale.analysis.advise`) on the command
line, writing its tables and its figure (`lightning_stale.analysis.advise_plot`)."""

from __future__ import annotations

import argparse
import csv
import os
from collections.abc import Sequence
from pathlib import Path

from lightning_stale.analysis.advise import REPLAYS, Advice, advise
from lightning_stale.analysis.advise_plot import plot_advice
from lightning_stale.method.variants import VARIANT_NAMES


def write_outputs(advice: Advice, out: str | os.PathLike) -> list[Path]:
    """advice.md, fitted_delay.yaml, iteration_times.csv, sweep.csv and advice.png in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "advice.md", out / "fitted_delay.yaml"]
    written[0].write_text(advice.report() + "\n")
    written[1].write_text(advice.fitted.yaml())
    for name, rows in (("iteration_times", advice.iteration_times), ("sweep", advice.rows())):
        if rows:
            path = out / f"{name}.csv"
            with path.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
            written.append(path)
    if advice.runs:
        written.append(out / "advice.png")
        plot_advice(advice).savefig(written[-1])
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-stale-advise",
        description="Fit straggler models to a recorded trace, tabulate E[T] for every variant "
                    "and K, run short simulated sweeps with the recorded times replayed, and "
                    "recommend a variant and K (Dutta et al., AISTATS 2018).")
    parser.add_argument("trace", help="a trace CSV, e.g. minibatch_times.csv of MiniBatchTimer")
    parser.add_argument("--learners", "-p", type=int, default=None,
                        help="P to advise for (default: the learners in the trace)")
    parser.add_argument("--column", default=None,
                        help="trace column: delay_s (default), compute_s, total_s")
    parser.add_argument("--ks", type=int, nargs="+", default=None,
                        help="K tried for the K-variants (default: 1..P)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_NAMES),
                        choices=VARIANT_NAMES, metavar="VARIANT",
                        help=f"variants tried (default: all; {', '.join(VARIANT_NAMES)})")
    parser.add_argument("--target", type=float, default=None,
                        help="training loss to reach (default: the runs' median final loss)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="virtual seconds per run (default: PUSHES x E[X] / P)")
    parser.add_argument("--pushes", type=int, default=1200,
                        help="mini-batches the P learners compute in the default budget "
                             "(default: 1200)")
    parser.add_argument("--window", type=int, default=None,
                        help="gradients in the smoothed loss (default: 8 P)")
    parser.add_argument("--replay", choices=REPLAYS, default="empirical",
                        help="law of X in the sweeps (default: empirical, the recorded times "
                             "resampled)")
    parser.add_argument("--config-name", default="train",
                        help="app config or recipe whose model and data are trained "
                             "(default: train, the digits MLP)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="Hydra override of that config, e.g. model.lr=0.3 (repeatable)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false",
                        help="only the fit and the E[T] table")
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                        help="skip the AdaSync check")
    parser.add_argument("--discard-first", type=int, default=0,
                        help="values dropped at the start of each learner's record (default: 0)")
    parser.add_argument("--et-updates", type=int, default=5000,
                        help="server updates of each Monte Carlo E[T] (default: 5000)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the fitted and resampled laws and of the Monte Carlo E[T] "
                             "(default: 0; the training seed is the config's: --override seed=1)")
    parser.add_argument("--out", default="advice",
                        help="folder for the tables and the figure (default: advice)")
    args = parser.parse_args(argv)
    try:
        advice = advise(args.trace, args.learners, column=args.column,
                        config_name=args.config_name, overrides=args.override, ks=args.ks,
                        variants=args.variants, target=args.target, budget_s=args.budget_s,
                        pushes=args.pushes, window=args.window, replay=args.replay,
                        sweep=args.sweep, adaptive=args.adaptive, et_updates=args.et_updates,
                        discard_first=args.discard_first, seed=args.seed,
                        progress=lambda line: print(line, flush=True))
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    print(advice.report())
    print("written:", *map(str, write_outputs(advice, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
