"""Starting a recording or a replay from a strategy: options, paths, header, and the checks that
refuse a log that is not this run's at the earliest point."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_stale.replay.events import (
    EVENTS_FILE_NAME,
    EventLog,
    EventLogError,
    EventWriter,
    check_layout,
    module_layout,
    read_events,
)
from lightning_stale.replay.recorder import EventRecorder
from lightning_stale.replay.replayer import ReplayServer

# The default of ``digest_every``: a digest hashes the whole model and optimizer state (about
# as long as an update of a 3.5M-parameter MLP on one CPU core), so one per update halves the
# throughput; one per 100 updates, and at the stop, costs about 1% (docs/benchmarks/recording_cost.md).
DIGEST_EVERY = 100
TRAINER_LIMITS = ("max_steps", "max_epochs", "limit_train_batches", "accumulate_grad_batches",
                  "num_training_batches")


def check_events_options(record_events: Any, digest_every: Any) -> None:
    if not isinstance(record_events, (bool, str, os.PathLike)):
        raise ValueError(f"record_events must be a bool or a path, got {record_events!r}")
    if isinstance(digest_every, bool) or not isinstance(digest_every, int) or digest_every < 0:
        raise ValueError(f"digest_every must be an integer >= 0, got {digest_every!r}")


def events_path(record_events: Any, trainer: Any) -> Path:
    """Where the event log goes: True means ``events.jsonl`` beside the delay trace (the first
    logger's folder, else ``trainer.default_root_dir``); a ``.jsonl`` path is the file; any
    other path is a folder for ``events.jsonl``."""
    from lightning_stale.strategies.lightning_api import log_dir

    if record_events is True:
        return Path(log_dir(trainer) or trainer.default_root_dir) / EVENTS_FILE_NAME
    path = Path(os.fspath(record_events))
    return path if path.suffix == ".jsonl" else path / EVENTS_FILE_NAME


def trainer_limits(trainer: Any) -> dict:
    return {name: _plain(getattr(trainer, name, None)) for name in TRAINER_LIMITS}


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def start_recording(strategy: Any, module: Any, path: Path) -> EventRecorder:
    """An `EventRecorder` writing ``path``, its header made from ``strategy`` (simulated)."""
    trainer = module.trainer
    header = {
        "engine": "simulated", "variant": strategy.variant.name, "k": strategy.variant.k,
        "p": strategy.variant.p, "seed": strategy.seed, "delay": repr(strategy.delay),
        "compute_time": strategy.compute_time,
        "adaptive_k": None if strategy._adaptive is None else repr(strategy._adaptive),
        "staleness_compensation": None if strategy.staleness_compensation is None
        else repr(strategy.staleness_compensation),
        "parameters": module_layout(module), "optimizer": type(strategy.optimizers[0]).__qualname__,
        "trainer": trainer_limits(trainer), "intra_op_threads": torch.get_num_threads(),
        "sampler": {"kind": "RandomSampler(replacement=True) per training loader",
                    "generator_seed": strategy.seed + strategy._loaders_made - 1,
                    "draw": "index of the push's first batch among the fit's training batches"},
    }
    return EventRecorder(EventWriter(path), header, strategy.digest_every)


def use_recorded_threads(header: dict, undo: list) -> None:
    """Compute the replay with the intra-op thread count the recorded run computed with (the
    header's ``intra_op_threads``; logs without it are replayed as they are), and append to
    ``undo`` what restores this process's count.

    A CPU matrix multiply splits its sums by thread, so another count sums float32 products in
    another order; through BatchNorm and AdamW, whose first steps divide a gradient by its own
    size, those last-bit differences grow to different parameters within a few updates."""
    recorded = header.get("intra_op_threads")  # (`read_events` checked it)
    current = torch.get_num_threads()
    if recorded is not None and recorded != current:
        torch.set_num_threads(recorded)
        undo.append(lambda: torch.set_num_threads(current))


def replay_log(path: Any, variant: Any, k: Any, num_learners: Any, adaptive_k: Any,
               record_events: Any) -> EventLog:
    """Read the log to replay and refuse what contradicts it; at construction, before any fit."""
    if record_events:
        raise ValueError("replay and record_events cannot both be given: a replay records its own "
                         "events in memory and compares them with the log's")
    if adaptive_k is not None:
        raise ValueError("a replay takes K from the log, update by update: do not pass adaptive_k")
    log = read_events(path)
    header = log.header
    if header["engine"] not in ("simulated", "stale"):
        raise EventLogError(f"{log.path} was recorded by the {header['engine']!r} engine; this "
                            "replay re-executes logs of the simulated engine and of StaleStrategy")
    asked = {"variant": (variant, header["variant"]), "num_learners": (num_learners, header["p"])}
    if k is not None:
        asked["k"] = (k, header["k"])
    for name, (given, recorded) in asked.items():
        if given is not None and given != recorded:
            raise EventLogError(f"{log.path} records a run with {name}={recorded!r}, but {name}="
                                f"{given!r} was asked: give no {name} to replay the log's")
    return log


def start_replay(log: EventLog, module: Any, optimizer: Any, state: Any, variant: Any,
                 compensation: Any, limit_train_batches: Any = None) -> ReplayServer:
    """The `ReplayServer` of ``log`` for this fit, once the module and the Trainer are known:
    refuses a log of another model (names and shapes) or of other Trainer limits
    (``limit_train_batches``: the user's, where the replay set the Trainer's aside)."""
    check_layout(log.header["parameters"], module, log.path)
    recorded, mine = log.header.get("trainer", {}), trainer_limits(module.trainer)
    if limit_train_batches is not None:
        mine["limit_train_batches"] = _plain(limit_train_batches)
    other = [f"{name}={mine[name]!r} (recorded: {recorded[name]!r})" for name in recorded
             if recorded[name] != mine.get(name)]
    if other:
        raise EventLogError(f"{log.path} was recorded with other Trainer limits, which decide when "
                            f"the replay ends: {', '.join(other)}; pass the recorded ones")
    return ReplayServer(state, variant, log, compensation)
