"""Shared helpers of the benchmark scripts: tiny models and data, timing, tables, result files.

Every benchmark is a plain script. Multi-process ones are re-run by Lightning's popen launcher
for ranks 1..N-1 (it re-executes ``sys.argv``), so a script must make the same sequence of
``Trainer(...).fit`` calls on every rank; only global rank 0 prints and writes results.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from pytorch_lightning import Callback, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------------- processes
def global_rank() -> int:
    """This process's global rank under the popen launcher (0 in the launching process)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)  # single node: local rank = global rank


def is_rank_zero() -> bool:
    return global_rank() == 0


def quiet() -> None:
    """Keep Lightning's info lines and known harmless warnings out of the tables."""
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric",
                 "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*`training_step` returned.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    warnings.filterwarnings("ignore", category=UserWarning, module="pytorch_lightning")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning_fabric")


def rank_print(*args: Any, **kwargs: Any) -> None:
    if is_rank_zero():
        print(*args, **kwargs, flush=True)


def require_internals(script: str, needed: Iterable[tuple[Any, str]]) -> None:
    """For a benchmark that wraps the engine's internals: exit naming each (class or module,
    name) pair that no longer defines that function itself."""
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needed
               if not callable(vars(owner).get(name))]
    if missing:
        raise SystemExit(f"{script}: the engine no longer has {missing}; update the script")


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Trainer arguments that keep everything but training out of the measurement."""
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  limit_val_batches=0, max_epochs=-1)
    kwargs.update(overrides)
    return kwargs


# ---------------------------------------------------------------------------- models and data
class TinyRegression(LightningModule):
    """Least squares with a linear model of ``features`` inputs: compute is negligible."""

    def __init__(self, features: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.linear = nn.Linear(features, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.linear(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MLPClassifier(LightningModule):
    """A small MLP classifier with cross-entropy and plain SGD, without per-step logging."""

    def __init__(self, features: int = 64, hidden: Sequence[int] = (64,), classes: int = 10,
                 lr: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def regression_loader(samples: int, features: int = 8, batch_size: int = 32,
                      seed: int = 0) -> DataLoader:
    """A synthetic linear-regression training set held in memory (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(samples, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, drop_last=True)


def classification_loader(samples: int, features: int = 64, classes: int = 10,
                          batch_size: int = 32, seed: int = 0) -> DataLoader:
    """Synthetic classification data: Gaussian clusters around random class centres."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (samples,), generator=g)
    x = centres[y] + torch.randn(samples, features, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, drop_last=True)


def digits_arrays(seed: int = 0, train_fraction: float = 0.8):
    """scikit-learn's 8x8 digits (pixels / 16), split train/held-out with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train = order[: int(train_fraction * len(y))]
    return x[train], y[train]


def digits_loader(batch_size: int = 32, repeat: int = 1, seed: int = 0) -> DataLoader:
    """The digits training split, tiled ``repeat`` times so that an epoch is longer.

    Mini-batches are drawn uniformly (the parameter server draws with replacement anyway), so
    tiling changes how often an epoch ends, not what is learned."""
    x, y = digits_arrays(seed)
    if repeat > 1:
        x, y = x.repeat(repeat, 1), y.repeat(repeat)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, drop_last=True)


# ---------------------------------------------------------------------------- timing
class StepTimer(Callback):
    """Monotonic time of every optimizer step on global rank 0 (stock strategies).

    ``mean_interval_s`` is the mean time between consecutive steps after ``warmup`` steps,
    leaving out intervals that cross an epoch end (as the parameter server does)."""

    def __init__(self, warmup: int = 10) -> None:
        self.warmup = warmup
        self.times: list[tuple[int, int, float]] = []  # (global_step, epoch, time)

    def on_train_start(self, trainer, pl_module) -> None:
        self.times = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            self.times.append((trainer.global_step, trainer.current_epoch, time.monotonic()))

    @property
    def intervals(self) -> list[float]:
        rows = self.times[self.warmup:]
        return [b[2] - a[2] for a, b in zip(rows, rows[1:]) if a[1] == b[1] and b[0] > a[0]]

    @property
    def mean_interval_s(self) -> float:
        intervals = self.intervals
        return sum(intervals) / len(intervals) if intervals else math.nan


class DelayCallback(Callback):
    """Injects a straggler delay into a stock strategy: every rank sleeps
    ``delay.sample(rank)`` after its backward pass, so with DDP each step waits for the slowest
    rank at the next all-reduce, as fully synchronous SGD does."""

    def __init__(self, delay) -> None:
        self.delay = delay

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        time.sleep(self.delay.sample(trainer.global_rank))


# ---------------------------------------------------------------------------- results
def write_results(out: str | os.PathLike, name: str, rows: list[dict[str, Any]],
                  meta: dict[str, Any] | None = None, kind: str = "cpu") -> tuple[Path, Path]:
    """One run's results file under ``<out>/runs/`` and its copy as the latest of ``name`` on
    ``kind`` machines under ``<out>/latest/`` (see `results.write_run`)."""
    from results import write_run

    return write_run(out, name, rows, meta, kind)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``columns`` (missing cells empty)."""
    rows = list(rows)
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def ratios_per_repeat(mine: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]],
                      key: str = "samples_per_s") -> list[float]:
    """Each row of ``mine``: its ``key`` over the ``baseline`` row's of the same ``repeat``, the
    two run side by side in one launch, so that the machine's load hits both alike."""
    base = {row["repeat"]: row[key] for row in baseline}
    return [row[key] / base[row["repeat"]] for row in mine if row["repeat"] in base]


def prepare_out(out: str | os.PathLike) -> Path:
    """Create the results folder (git ignores everything in the default one but ``latest/``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def base_parser(description: str):
    import argparse

    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results folder: runs/ gets every run's file, latest/ the latest of each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per process (the machine has few cores)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="diagnostic: sys.setswitchinterval(seconds) in every process "
                             "(Python's default is 0.005); not set by default")
    return parser


def add_delay_mode_argument(parser) -> None:
    from lightning_stale.strategies.stale import DELAY_MODES

    parser.add_argument("--delay-mode", default="after_compute", choices=list(DELAY_MODES),
                        help="StaleStrategy's delay_mode: the delay added after backward, or the "
                             "mini-batch's whole time X with the computation and the measured "
                             "message latency counted toward it")


def apply_process_settings(args) -> None:
    """Quiet logs, torch threads, the optional GIL switch interval and the allocator, in every
    process."""
    quiet()
    torch.set_num_threads(args.threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    # Every mode, stock ddp included, under the allocator setting StaleStrategy makes at its
    # first fit (freed memory kept for reuse), so that a launch compares like with like.
    try:
        from lightning_stale.engine.distributed.allocator import hold_freed_memory
    except ImportError:  # an earlier commit's engine (against_commit.py): as it was then
        return
    hold_freed_memory()


# ---------------------------------------------------------------------------- one launch per P
def add_launch_arguments(parser) -> None:
    """The hidden arguments of `launch_per_device_count`'s children."""
    import argparse

    parser.add_argument("--child-devices", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-result", default=None, help=argparse.SUPPRESS)


def launch_per_device_count(script: str, name: str, devices: Sequence[int], out: Path) -> list[dict]:
    """Run ``script`` once per process count, each a fresh Python process tree (Lightning
    launches P processes once per script run), with this run's arguments plus
    ``--child-devices P --child-result FILE``; the child writes its rows (rank 0) as JSON there."""
    rows: list[dict] = []
    for p in devices:
        result = out / f"{name}_P{p}.partial.json"
        subprocess.run([sys.executable, str(Path(script).resolve()), *sys.argv[1:],
                        "--child-devices", str(p), "--child-result", str(result)], check=True)
        rows += json.loads(result.read_text())
        result.unlink()
    return rows


def run_per_device_count(parser, script: str, name: str, run_launch):
    """The shared main of a benchmark launched once per process count (``--devices``): parse
    the arguments and apply the process settings; in a child, run its launch with
    ``run_launch(args)`` and return None; in the parent, launch once per P and return
    ``(args, out, rows, total_wall_s)``."""
    add_launch_arguments(parser)
    args = parser.parse_args()
    apply_process_settings(args)
    if args.child_devices is not None:
        run_launch(args)
        return None
    out = prepare_out(args.out)
    start = time.monotonic()
    rows = launch_per_device_count(script, name, args.devices, out)
    return args, out, rows, time.monotonic() - start

