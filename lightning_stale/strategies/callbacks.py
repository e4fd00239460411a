"""Wall-clock logging of server updates (Dutta et al. 2018 judge error against wall-clock time)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping
from time import monotonic
from typing import Any

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.trainer.states import TrainerFn

from lightning_stale.engine.records import UpdateRecord, UpdateRecordSource
from lightning_stale.strategies.lightning_api import log_dir

# Column order of `rows` and of wallclock.csv.
METRIC_NAMES = (
    "update",
    "time/train_s",
    "time/validation_s",
    "samples",
    "train/loss",
    "staleness/mean",
    "staleness/max",
    "k",
)


class WallClockLogger(Callback):
    """Logs one row per server update, so loss can be plotted against training wall time.

    Dutta et al. (AISTATS 2018) compare distributed-SGD variants by error against wall-clock
    time, not against iterations: a variant that waits for stragglers makes fewer, better
    updates per second. Each row therefore carries the time at which the update happened:

    * ``time/train_s``: training seconds since ``on_train_start``, *excluding* validation (and
      sanity checking, which runs before training starts), so that validating more or less often
      does not change the measured speed of a variant.
    * ``time/validation_s``: validation seconds spent during fit up to that row, reported
      separately so the overhead stays visible instead of being hidden inside the training clock.
    * ``update`` (server version after the update, from 1), ``samples`` (samples in all applied
      gradients so far), ``train/loss``, ``staleness/mean`` and ``staleness/max`` (j - tau(l, j)
      over the gradients of the update), ``k`` (the K in force).

    Two sources of updates:

    1. Parameter-server engines (an `UpdateRecordSource`: ``pop_update_records()`` returning
       :class:`~lightning_stale.engine.records.UpdateRecord` s, and ``virtual_clock``). The
       records are drained on global rank 0 at every training batch end, before each validation
       and at train end. Their clock is the server's training seconds, pauses at epoch ends
       excluded (virtual seconds with ``virtual_clock``), and is logged as is.
    2. Any other strategy (single device, Lightning's ``ddp``): one row per optimizer step, with
       update = ``trainer.global_step``, samples += batch size x world size for every batch (also
       the accumulated ones), the loss of rank 0's batches of that step, staleness 0 and
       k = world size. Batches that did not end in an optimizer step (gradient accumulation) add
       no row.

    Rows go to every logger in ``trainer.loggers`` with ``step=update`` (none configured: memory
    only) and are kept in ``self.rows`` (list of dicts keyed by the metric names) on global rank
    0. When a logger is configured, ``wallclock.csv`` is written into its log directory at train
    end, and also when fit ends with an exception (the rows up to the failure, the server's
    updates drained first), with the columns of ``METRIC_NAMES``, one line per row; the file is
    replaced atomically, so it is never seen half-written. ``rows`` restart at every fit.
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._train_start: float | None = None
        self._validation_start: float | None = None
        self._validation_s = 0.0
        # Stock path state.
        self._last_global_step = 0
        self._samples = 0
        self._loss_since_step = 0.0

    # ---------------------------------------------------------------- hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._train_start = None  # a fit failing before training writes no rows of an old one

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.rows = []
        self._validation_s = 0.0
        self._validation_start = None
        self._last_global_step = trainer.global_step
        self._samples = 0
        self._loss_since_step = 0.0
        self._train_start = monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        if _is_engine(trainer.strategy):
            self._drain(trainer)
        else:
            self._stock_step(trainer, pl_module, outputs, batch)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._counts_validation(trainer):
            return
        # Drain first so that records applied before validation are not left behind until the
        # next batch.
        if trainer.is_global_zero and _is_engine(trainer.strategy):
            self._drain(trainer)
        self._validation_start = monotonic()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._counts_validation(trainer) or self._validation_start is None:
            return
        self._validation_s += monotonic() - self._validation_start
        self._validation_start = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._train_start is not None and trainer.state.fn == TrainerFn.FITTING:
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero:
            return
        if _is_engine(trainer.strategy):
            self._drain(trainer)
        folder = log_dir(trainer)
        if folder is not None and self.rows:
            self._write_csv(os.path.join(folder, "wallclock.csv"))

    # ---------------------------------------------------------------- results

    def summary(self) -> dict[str, float]:
        """End-of-run figures: training and validation seconds, updates, samples, final loss."""
        last = self.rows[-1] if self.rows else None
        return {
            "train_time_s": last["time/train_s"] if last else 0.0,
            "validation_time_s": self._validation_s,
            "updates": int(last["update"]) if last else 0,
            "samples": int(last["samples"]) if last else 0,
            "final_loss": last["train/loss"] if last else math.nan,
        }

    # ---------------------------------------------------------------- internals

    def _counts_validation(self, trainer: Trainer) -> bool:
        # Sanity checking runs before on_train_start, so it is outside the training clock
        # already; it is not added to time/validation_s either (that is validation *during*
        # training). trainer.validate() outside fit is ignored.
        return (
            self._train_start is not None
            and not trainer.sanity_checking
            and trainer.state.fn == TrainerFn.FITTING
        )

    def _drain(self, trainer: Trainer) -> None:
        if self._train_start is None:
            return
        for record in trainer.strategy.pop_update_records():
            self._add_row(trainer, _record_row(record, self._validation_s))

    def _stock_step(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any) -> None:
        self._samples += _batch_size(batch) * trainer.world_size
        loss = _loss_value(outputs)
        if pl_module.automatic_optimization:
            # Lightning divides each batch's loss by accumulate_grad_batches before handing it to
            # us, so the sum over the batches of one step is their mean loss.
            self._loss_since_step += loss
        else:
            self._loss_since_step = loss
        if trainer.global_step == self._last_global_step:
            return  # gradient accumulation: no optimizer step yet
        self._last_global_step = trainer.global_step
        assert self._train_start is not None
        row = {
            "update": trainer.global_step,
            "time/train_s": monotonic() - self._train_start - self._validation_s,
            "time/validation_s": self._validation_s,
            "samples": self._samples,
            "train/loss": self._loss_since_step,
            "staleness/mean": 0.0,
            "staleness/max": 0,
            "k": trainer.world_size,
        }
        self._loss_since_step = 0.0
        self._add_row(trainer, row)

    def _add_row(self, trainer: Trainer, row: dict[str, float]) -> None:
        self.rows.append(row)
        for logger in trainer.loggers:
            logger.log_metrics(dict(row), step=int(row["update"]))

    def _write_csv(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with open(partial, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(METRIC_NAMES))
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(partial, path)


def _is_engine(strategy: Any) -> bool:
    return isinstance(strategy, UpdateRecordSource)


def _record_row(record: UpdateRecord, validation_s: float) -> dict[str, float]:
    return {
        "update": record.update,
        "time/train_s": record.clock,
        "time/validation_s": validation_s,
        "samples": record.samples,
        "train/loss": record.loss,
        "staleness/mean": record.staleness_mean,
        "staleness/max": record.staleness_max,
        "k": record.k,
    }


def _batch_size(batch: Any) -> int:
    """Length of the first tensor found in a tensor, tuple/list or dict batch (0 if none)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _loss_value(outputs: Any) -> float:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().float().mean())
    if isinstance(loss, (int, float)):
        return float(loss)
    return math.nan  # training_step returned None (skipped batch)
