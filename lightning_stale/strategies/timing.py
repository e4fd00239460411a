"""Every learner's real time per mini-batch, recorded with any strategy: `MiniBatchTimer`.

docs/method.md ("Setting") models the time X a learner takes for one mini-batch gradient as a
random variable; the runtime analysis (E[T], "Expected time per iteration") and the choice of a
variant and K follow from its distribution. `MiniBatchTimer` measures it on a real cluster, with
stock ``ddp`` as well as `StaleStrategy` and `SimulatedStaleStrategy`, and writes a trace that
`lightning_stale.delays.fit` fits and `lightning_stale.analysis.advise` turns into advice.

File (``minibatch_times.csv`` in the log folder): the `Trace` format with two extra columns,

    learner,index,delay_s,compute_s,total_s

* ``learner``: the global rank (one learner per process; rank 0 under the simulated engine,
  whose real computation all happens in one process); ``index`` counts its mini-batches.
* ``compute_s``: the learner's own computation, from ``on_train_batch_start`` (the batch is
  loaded) to ``on_before_optimizer_step`` (after backward; under the parameter-server engines
  this hook runs inside the learner's step, before its push). Under ``ddp`` the gradient
  all-reduce runs inside backward and waits for the slowest rank: that wait, measured from the
  moment the last local gradient was accumulated (``Tensor.register_post_accumulate_grad_hook``)
  to ``on_after_backward``, is subtracted. Work done by callbacks listed *before* the timer in
  ``on_before_optimizer_step`` (e.g. an injected sleep) counts; work after it does not.
* ``total_s``: the whole time X the server sees for that mini-batch (sending the parameters to
  receiving the gradient), where the strategy reports it (protocol below); empty otherwise.
* ``delay_s``: ``total_s`` where known, else ``compute_s``: what `Trace` replays by default.

Optional strategy protocol ``minibatch_times``: a strategy may have an attribute
``minibatch_times``, a list to which it appends, on each rank, the whole time X in seconds of each
of this rank's mini-batches as the server saw it, one number per training batch, in order (NaN
when not known, e.g. for cancelled work). The timer pairs the one value appended during a
training batch with that batch's row. `StaleStrategy` fills it (X from the event that started
the mini-batch to its push's arrival, as ``delay_mode="total"`` measures it), and so does
`SimulatedStaleStrategy` (the virtual X).

Ranks run at their own pace under the parameter-server engines, so nothing is exchanged during
training: each rank keeps its rows, and at ``on_fit_end`` (after the strategy's teardown, every
rank in step again) they are gathered with one ``torch.distributed.all_gather_object`` on the
default group and global rank 0 writes the file.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from time import perf_counter
from typing import Any

import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer

from lightning_stale.delays.traces import TRACE_HEADER
from lightning_stale.strategies.lightning_api import log_dir

MINIBATCH_TIMES_FILE = "minibatch_times.csv"
MINIBATCH_COLUMNS = TRACE_HEADER + ("compute_s", "total_s")


class MiniBatchTimer(Callback):
    """Records each learner's computation time (and X, where the strategy reports it) per
    mini-batch, and writes them as one trace at the end of fit (module docstring).

    Args:
        path: where rank 0 writes the trace: None for ``minibatch_times.csv`` in the first
            logger's folder (``trainer.default_root_dir`` without a logger), a ``.csv`` path
            for that file, any other path for ``minibatch_times.csv`` in that folder.

    After fit: ``rows`` holds this rank's rows ``(index, compute_s, total_s or None)`` and, on
    global rank 0, ``written`` the path of the trace.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"MiniBatchTimer path must be None or a path, got {path!r}")
        self.path = path
        self.rows: list[tuple[int, float, float | None]] = []
        self.written: Path | None = None
        self._hooks: list[Any] = []
        self._start: float | None = None
        self._last_gradient: float | None = None
        self._waited = 0.0
        self._reported = 0  # len(strategy.minibatch_times) at the batch start
        self._row_in_batch = False

    # ---------------------------------------------------------------- hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.rows, self.written = [], None
        self._remove_hooks()
        for parameter in pl_module.parameters():
            if parameter.requires_grad:
                self._hooks.append(parameter.register_post_accumulate_grad_hook(self._accumulated))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._start is None:  # with gradient accumulation, the first batch of the step
            self._start, self._waited = perf_counter(), 0.0
        self._last_gradient = None
        self._row_in_batch = False
        reported = getattr(trainer.strategy, "minibatch_times", None)
        self._reported = len(reported) if isinstance(reported, list) else 0

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_gradient is not None:  # the wait inside backward for other ranks (ddp)
            self._waited += max(0.0, perf_counter() - self._last_gradient)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        if self._start is None:
            return
        compute = perf_counter() - self._start - self._waited
        self.rows.append((len(self.rows), max(compute, 0.0), None))
        self._start = None
        self._row_in_batch = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        reported = getattr(trainer.strategy, "minibatch_times", None)
        if not (self._row_in_batch and isinstance(reported, list)):
            return
        new = reported[self._reported:]
        if len(new) == 1 and math.isfinite(float(new[0])) and float(new[0]) >= 0:
            index, compute, _ = self.rows[-1]
            self.rows[-1] = (index, compute, float(new[0]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        self._start = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows = [(trainer.global_rank, *row) for row in self.rows]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows)
            rows = [row for part in gathered for row in part]
        if trainer.is_global_zero:
            self.written = write_minibatch_times(self.destination(trainer), rows)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()  # fit ended by an exception

    # ---------------------------------------------------------------- internals
    def destination(self, trainer: Trainer) -> Path:
        """The file rank 0 writes (see ``path``)."""
        if self.path is None:
            return Path(log_dir(trainer) or trainer.default_root_dir) / MINIBATCH_TIMES_FILE
        path = Path(os.fspath(self.path))
        return path if path.suffix == ".csv" else path / MINIBATCH_TIMES_FILE

    def _accumulated(self, parameter: Any) -> None:
        self._last_gradient = perf_counter()

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()


def write_minibatch_times(path: str | os.PathLike,
                          rows: list[tuple[int, int, float, float | None]]) -> Path:
    """Write ``(learner, index, compute_s, total_s or None)`` rows in the timer's format, sorted
    by learner and index, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(MINIBATCH_COLUMNS)
        for learner, index, compute, total in sorted(rows, key=lambda row: row[:2]):
            delay = compute if total is None else total
            writer.writerow((learner, index, repr(delay), repr(compute),
                             "" if total is None else repr(total)))
    return path
