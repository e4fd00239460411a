"""Every use of Lightning beyond its public API, in one place, so an upgrade touches one file.

Each function says which private name it relies on; the strategies call these, never the
private names themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _update_dataloader

from lightning_stale.delays.traces import TRACE_FILE_NAME


def run_closure(precision_plugin: Any, model: Any, optimizer: Any, closure: Any) -> Any:
    """Forward, backward, ``on_before_optimizer_step`` and clipping, exactly once, as the
    precision plugin's ``optimizer_step`` would run them (``Precision._wrap_closure``)."""
    return precision_plugin._wrap_closure(model, optimizer, closure)


def with_sampler(dataloader: Any, sampler: Any) -> Any:
    """A copy of a training DataLoader drawing with ``sampler`` (``_update_dataloader``)."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def replace_sigterm_broadcast(epoch_loop: Any, check: Any) -> Any:
    """Replace the per-batch broadcast of rank 0's SIGTERM flag (``_broadcast_sigterm_tensor``, a
    collective that would put learners in lock-step) by ``check()``; returns the undo."""
    epoch_loop._broadcast_sigterm_tensor = check
    return lambda: epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def hand_over_stops_inside_batches(epoch_loop: Any, hand_over: Any) -> Any:
    """Before Lightning acts on a ``trainer.should_stop`` set during a training batch (by a
    callback, the LightningModule's own hooks or anything else), in the training epoch loop's
    ``on_advance_end`` (which validates when stopping; the loop's ``done`` reads the flag next),
    call ``hand_over()``: True clears the flag, the stop being left to someone else. Returns the
    undo."""
    original = epoch_loop.on_advance_end

    def on_advance_end(*args: Any, **kwargs: Any) -> Any:
        trainer = epoch_loop.trainer
        if trainer.should_stop and hand_over():
            trainer.should_stop = False
        return original(*args, **kwargs)

    epoch_loop.on_advance_end = on_advance_end
    return lambda: epoch_loop.__dict__.pop("on_advance_end", None)


def switch_off_scheduler_stepping(epoch_loop: Any) -> Any:
    """Make Lightning's stepping of the LR schedulers (``_update_learning_rates`` of the training
    epoch loop, called per batch and per epoch) do nothing; returns the undo."""
    epoch_loop._update_learning_rates = lambda *args, **kwargs: None
    return lambda: epoch_loop.__dict__.pop("_update_learning_rates", None)


def sync_batchnorm_requested(strategy: Any) -> bool:
    """Whether ``Trainer(sync_batchnorm=True)`` gave the strategy a layer sync (``_layer_sync``)."""
    return getattr(strategy, "_layer_sync", None) is not None


def process_group_backend(strategy: Any) -> str | None:
    """The backend a DDP-style strategy was asked for (``_process_group_backend``), or None."""
    return getattr(strategy, "_process_group_backend", None)


def set_root_device(strategy: Any, device: Any) -> None:
    """Point a single-device strategy at ``device`` (``_root_device``)."""
    strategy._root_device = device


def set_global_step(trainer: Any, value: int) -> None:
    """Make ``trainer.global_step`` read ``value`` once Lightning has counted the optimizer step
    in progress (``optim_progress.optimizer.step.total``: incremented after the step returns)."""
    total = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    total.ready, total.completed = value, value - 1


def log_dir(trainer: Any) -> str | None:
    """The first logger's folder, as ``trainer.log_dir`` gives it but without its broadcast: this
    runs on rank 0 only, and engine ranks need not be in step with Lightning's collectives."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]  # CSV and TensorBoard loggers of either namespace have log_dir
    return getattr(logger, "log_dir", None) or logger.save_dir


def trace_path(record_trace: Any, trainer: Any) -> Path:
    """Where an engine writes the delays it drew: ``record_trace`` True means ``delays.csv`` in
    the log folder (the first logger's, else ``trainer.default_root_dir``); a path ending in
    ``.csv`` is the file; any other path is a folder for ``delays.csv``."""
    if record_trace is True:
        return Path(log_dir(trainer) or trainer.default_root_dir) / TRACE_FILE_NAME
    path = Path(os.fspath(record_trace))
    return path if path.suffix == ".csv" else path / TRACE_FILE_NAME


GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def hooks_after_backward(module: Any, callbacks: list) -> list[str]:
    """User code Lightning runs between backward and the optimizer step, which may change the
    gradients there (``"Class.hook"`` for each ``GRADIENT_HOOKS`` overridden outside Lightning
    and this package, whose own only read them), in the module and the callbacks."""
    found = []
    for obj in [module, *callbacks]:
        for name in GRADIENT_HOOKS:
            owner = next((c for c in type(obj).__mro__ if name in c.__dict__), None)
            if owner is not None and not owner.__module__.startswith(
                    ("lightning.", "pytorch_lightning.", "lightning_stale.")):
                found.append(f"{owner.__qualname__}.{name}")
    return found
