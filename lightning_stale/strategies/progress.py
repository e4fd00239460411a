"""The server's progress in Lightning's progress bar: updates, K and mean staleness.

Under a parameter server, the batches a learner process runs are not optimizer steps: global
rank 0's learner computes about 1/P of the pushes, and an update takes K of them. Both
strategies therefore show the server's figures during fit (`show_server_progress`), on the
rank that hosts the server (progress bars draw on global rank 0 only):

* ``updates`` (server updates so far), ``K`` (the K in force) and ``staleness`` (mean staleness
  of the gradients applied so far) join the metrics of any progress bar that asks
  ``get_metrics`` for them (Lightning's TQDM and Rich bars and their subclasses do): computed
  only when the bar redraws, and never logged (`WallClockLogger` logs them per update);
* in Lightning's TQDM bar, the counter and its total count the epoch's server updates (the total
  is the updates an epoch makes, pushes / K, cut by ``max_steps``), not this learner's batches
  (`ServerProgress`, a callback placed right after the bar).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pytorch_lightning import Callback


def show_server_progress(strategy: Any, trainer: Any, undo: list[Callable[[], Any]]) -> None:
    """Make ``trainer``'s progress bar show ``strategy.progress()`` until the callables that
    this appends to ``undo`` run."""
    bar = trainer.progress_bar_callback
    if bar is None:
        return
    own_metrics = bar.get_metrics
    saved = vars(bar).get("get_metrics")  # an instance's own override, if it has one

    def get_metrics(trainer: Any, pl_module: Any) -> dict:
        return {**own_metrics(trainer, pl_module), **(strategy.progress() or {})}

    bar.get_metrics = get_metrics
    if saved is None:
        undo.append(lambda: vars(bar).pop("get_metrics", None))
    else:
        undo.append(lambda: setattr(bar, "get_metrics", saved))
    callback = ServerProgress()
    trainer.callbacks.insert(trainer.callbacks.index(bar) + 1, callback)
    undo.append(lambda: trainer.callbacks.remove(callback))


class ServerProgress(Callback):
    """Makes the counter of Lightning's TQDM bar count the epoch's server updates (see the
    module docstring); ``strategy.progress()`` gives the figures (None where no server is
    hosted), ``strategy.updates_per_epoch`` the total."""

    def __init__(self) -> None:
        self._epoch_start = 0

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        progress = trainer.strategy.progress()
        self._epoch_start = progress["updates"] if progress is not None else 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bar = trainer.progress_bar_callback
        if not _is_tqdm_bar(bar) or bar.is_disabled:
            return
        tqdm_bar = bar.train_progress_bar
        if tqdm_bar is None or tqdm_bar.disable or tqdm_bar.n != batch_idx + 1:
            return  # the bar did not redraw for this batch (its refresh_rate): neither do we
        progress = trainer.strategy.progress()
        if progress is None:
            return
        total = trainer.strategy.updates_per_epoch
        if trainer.max_steps != -1:
            total = min(total, max(0, trainer.max_steps - self._epoch_start))
        tqdm_bar.total = total if total and math.isfinite(total) else None
        tqdm_bar.n = progress["updates"] - self._epoch_start
        tqdm_bar.refresh()


def _is_tqdm_bar(bar: Any) -> bool:
    """Lightning's TQDM bar (or a subclass) of either namespace."""
    return any(cls.__name__ == "TQDMProgressBar"
               and cls.__module__.endswith("progress.tqdm_progress") for cls in type(bar).__mro__)
