"""The engine against stock ``ddp`` as the model grows: time per update and samples/s per path.

Deep MLPs (64 inputs, equal hidden layers, 10 classes, batch 32, plain SGD) of about 0.02M, 1M,
4M and 16M parameters, no injected delay. Per process count (one launch each, ``--devices``,
default 2 then 4) and size, every mode runs interleaved ``--repeats`` times:

* ``ddp``: Lightning's stock DDP (one all-reduce per step);
* the six variants on the path ``server="auto"`` picks (`registry.choose_path`: collective for the
  sync family from `registry.SCALE_MIN_NUMEL` values, or `registry.ONE_HOST_COLLECTIVE_MIN_NUMEL`
  (`registry.CROWDED_HOST_COLLECTIVE_MIN_NUMEL` where the learners outnumber the cores) on one CPU
  host whose learners all share memory with rank 0, sharded for the async family once parameters
  x (P - 1) reach `registry.SHARDED_MIN_TRAFFIC` and, on one host, P reaches
  `registry.ONE_HOST_SHARDED_MIN_P`; central otherwise), K = P for
  ``sync``/``k_sync`` and K = P/2 for the K-variants of the other families, K = 1 for Async;
* ``sync`` forced onto the central server, ``sync`` on the collective path reducing only after
  the server's decision (``collective-late``: ``overlap_allreduce=False``), and ``k_batch_async``
  onto each of the central and sharded paths, for comparison.

Measured in the steady state after ``--warmup`` updates: for ddp the mean time between optimizer
steps on rank 0 (samples/s = P x batch / that); for the server the update records' clock
(samples/s = samples in the gradients applied / seconds). ``vs_ddp`` is the median over repeats
of samples/s over ddp's in the same repeat. Targets (issue: scale the engine to real models): at
4M and 16M parameters ``sync`` and ``k_sync`` (K = P) >= 0.95 x ddp, ``k_async`` and
``k_batch_async`` >= 0.9 x ddp; at 0.02M no variant slower than before (``benchmarks/overhead_vs_ddp.py``).

    python benchmarks/scaling.py [--devices 2 4] [--sizes 0.02M 1M 4M 16M] [--repeats 2]
        [--modes ddp sync k_sync sync:collective-late ...]  (variant[:path]; default: all but
        ``sync:collective`` and ``k_batch_sync:collective``, forced onto the collective path;
        sizes 2M and 8M too)

Writes the table, ``scaling.png`` (time per update against parameters, one line per path and
ddp), and the usual json/csv into ``--out``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pytorch_lightning import Callback, Trainer, seed_everything

from _common import (MLPClassifier, StepTimer, base_parser, run_per_device_count, classification_loader,
                     is_rank_zero, median, rank_print, table, trainer_kwargs, write_results)
from lightning_stale import StaleStrategy
from overhead_vs_ddp import k_of

SIZES = {"0.02M": (256,), "1M": (350,) * 8, "2M": (500,) * 8, "4M": (700,) * 8, "8M": (1000,) * 8,
         "16M": (1400,) * 8, "64M": (3000,) * 8}
DEFAULT_SIZES = ["0.02M", "1M", "4M", "16M"]  # 2M and 8M: to place a crossover between paths
# Updates per fit. At least 100 from 2M up: a fit of a few dozen updates of a large model lasts
# a second or two, too short to leave a shared machine's spread behind (docs/benchmarks/scaling.md).
STEPS = {"0.02M": 300, "1M": 120, "2M": 100, "4M": 100, "8M": 100, "16M": 100, "64M": 100}
TARGETS = {("sync", "auto"): 0.95, ("k_sync", "auto"): 0.95, ("k_async", "auto"): 0.9,
           ("k_batch_async", "auto"): 0.9}


class RecordTimes(Callback):
    """The server's update records on rank 0: (clock, samples) of every update."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []
        self.learners: list[int] = []  # the learner of every gradient applied, in order

    def on_train_start(self, trainer, module) -> None:
        self.rows, self.learners = [], []

    def on_train_batch_end(self, trainer, *args) -> None:
        for r in trainer.strategy.pop_update_records():
            self.rows.append((r.clock, r.samples))
            self.learners += r.learners

    def on_train_end(self, trainer, *args) -> None:
        self.on_train_batch_end(trainer)

    def rate(self, warmup: int) -> tuple[float, float]:
        """(seconds per update, samples per second) after the first ``warmup`` updates."""
        (t0, n0), (t1, n1) = self.rows[warmup], self.rows[-1]
        return (t1 - t0) / (len(self.rows) - 1 - warmup), (n1 - n0) / (t1 - t0)


def modes(p: int) -> list[tuple[str, int | None, str]]:
    runs = [(name, "auto") for name in ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")]
    runs += [("sync", "central"), ("sync", "collective-late"), ("k_batch_async", "central"),
             ("k_batch_async", "sharded"), ("sync", "collective"), ("k_batch_sync", "collective")]
    return [("ddp", None, "")] + [(name, k_of(name, p), path) for name, path in runs]


ON_REQUEST = {"sync:collective", "k_batch_sync:collective"}  # runs only where --modes names them


def chosen(mode: str, path: str, wanted: list[str] | None) -> bool:
    """Whether ``--modes`` (``variant`` for its "auto" path, or ``variant:path``) names this run."""
    name = mode if path in ("", "auto") else f"{mode}:{path}"
    return name in wanted if wanted is not None else name not in ON_REQUEST


def strategy_for(mode: str, k: int | None, path: str, seed: int):
    """Stock ``ddp``, or the engine on ``path`` (``collective-late``: the collective path with
    the all-reduce after the decision)."""
    if mode == "ddp":
        return "ddp"
    late = path == "collective-late"
    return StaleStrategy(mode, k, seed=seed, record_trace=False, server="collective" if late else path,
                         overlap_allreduce=not late)


def rate_of(mode: str, path: str, trainer, timer: StepTimer, records: RecordTimes, warmup: int,
            samples_per_step: int) -> tuple[float, float, str]:
    """(seconds per update, samples/s, the path that ran) of a finished fit, on rank 0."""
    if mode == "ddp":
        return timer.mean_interval_s, samples_per_step / timer.mean_interval_s, "ddp"
    interval, sps = records.rate(warmup)
    return interval, sps, trainer.strategy.stats["server_path"] + ("-late" if path == "collective-late" else "")


def add_run_arguments(parser, repeats: int) -> None:
    """The options every launch of runs side by side takes."""
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"],
                        help="gpu: one learner per GPU, Lightning's default group on NCCL")
    parser.add_argument("--steps", type=int, default=None, help="updates per fit (default: by model)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=None,
                        help="runs to keep: ddp, a variant (its 'auto' path) or variant:path")


def run_launch(args) -> None:
    p = args.child_devices
    rows = []
    for repeat in range(args.repeats):
        for size in args.sizes:
            steps = STEPS[size] if args.steps is None else args.steps
            for mode, k, path in modes(p):
                if not chosen(mode, path, args.modes):
                    continue
                seed_everything(args.seed, verbose=False)
                model = MLPClassifier(features=64, hidden=SIZES[size], classes=10, lr=0.01)
                loader = classification_loader(32 * p * (steps + 20) * 2, batch_size=32, seed=args.seed)
                row = time_fit(mode, k, path, model, loader, steps, args, batch=32, label=size)
                if row is not None:
                    rows.append(dict(row, repeat=repeat))
    if is_rank_zero():
        Path(args.child_result).write_text(json.dumps(rows))


def time_fit(mode: str, k: int | None, path: str, module, loader, steps: int, args, batch: int,
             label: str) -> dict | None:
    """Fit ``module`` (``label``: its size or name) for ``steps`` updates under ``mode`` on
    ``path`` and, on rank 0, its row (the run printed); None on the other ranks."""
    p = args.child_devices
    timer, records = StepTimer(warmup=args.warmup), RecordTimes()
    trainer = Trainer(devices=p, strategy=strategy_for(mode, k, path, args.seed), max_steps=steps,
                      callbacks=[timer if mode == "ddp" else records],
                      **trainer_kwargs(accelerator=args.accelerator))
    trainer.fit(module, train_dataloaders=loader)
    if not is_rank_zero():
        return None
    interval, sps, ran = rate_of(mode, path, trainer, timer, records, args.warmup, p * batch)
    rank_print(f"P={p} {label:>11} {mode:14s} {path:16s} ({ran:15s}): {1e3 * interval:8.2f} "
               f"ms/update {sps:9.0f} samples/s")
    return {"devices": p, "size": label, "parameters": sum(t.numel() for t in module.parameters()),
            "mode": mode, "k": k, "requested": path, "path": ran, "ms_per_update": 1e3 * interval, "samples_per_s": sps}


def summarise(rows: list[dict]) -> list[dict]:
    summary = []
    keys = dict.fromkeys((r["devices"], r["size"], r["mode"], r["requested"]) for r in rows)
    for p, size, mode, requested in keys:
        mine = [r for r in rows if (r["devices"], r["size"], r["mode"], r["requested"]) == (p, size, mode, requested)]
        ratios = []
        for r in mine:
            base = [d["samples_per_s"] for d in rows if (d["devices"], d["size"], d["mode"], d["repeat"])
                    == (p, size, "ddp", r["repeat"])]
            ratios.append(r["samples_per_s"] / base[0] if base else math.nan)
        summary.append({"devices": p, "size": size, "parameters": mine[0]["parameters"], "mode": mode,
                        "k": mine[0]["k"], "requested": requested, "path": mine[0]["path"],
                        "ms_per_update": median([r["ms_per_update"] for r in mine]),
                        "samples_per_s": median([r["samples_per_s"] for r in mine]),
                        "vs_ddp": median(ratios), "per_repeat": " ".join(f"{x:.2f}" for x in ratios),
                        "target": TARGETS.get((mode, requested), "") if size in ("4M", "16M") else ""})
    return summary


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["devices"] for r in summary})
    figure, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    # (one line per run as asked for: the path "auto" picks changes with the size)
    lines = [("ddp", "", "stock ddp"), ("sync", "auto", "sync, the path 'auto' picks"),
             ("sync", "collective-late", "sync, collective, all-reduce after the decision"),
             ("sync", "central", "sync, central"), ("sync", "collective", "sync, collective"),
             ("k_batch_async", "sharded", "K-batch-async, sharded"),
             ("k_batch_async", "central", "K-batch-async, central")]
    for ax, p in zip(axes[0], counts):
        for mode, requested, label in lines:
            points = sorted((r["parameters"], r["ms_per_update"]) for r in summary
                            if r["devices"] == p and r["mode"] == mode and r["requested"] == requested)
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="time per update (ms)",
               title=f"P = {p} learners, no injected delay")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, choices=list(SIZES))
    add_run_arguments(parser, repeats=2)
    launched = run_per_device_count(parser, __file__, "scaling", run_launch)
    if launched is None:
        return
    args, out, rows, total = launched
    summary = summarise(rows)
    print(table(summary, ["devices", "size", "parameters", "mode", "k", "path", "ms_per_update",
                          "samples_per_s", "vs_ddp", "per_repeat", "target"]))
    print(f"total {total:.0f} s")
    plot(summary, out / "scaling.png")
    paths = write_results(out, "scaling", summary, {"runs": rows, "repeats": args.repeats,
                                                    "threads": args.threads, "total_wall_s": total},
                          kind="gpu" if args.accelerator == "gpu" else "cpu")
    print("results:", *map(str, paths), out / "scaling.png")


if __name__ == "__main__":
    main()
