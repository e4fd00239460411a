"""The event log of a `StaleStrategy` fit (docs/replay.md, "Recording the real engine"): its
options, the hooks that feed each rank's side log and rank 0's recorder, the merge at the end of
the fit and the cleanup after a failed one. The recording itself: `lightning_stale.replay.real`."""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from lightning_stale.engine.distributed.paths.registry import path_named
from lightning_stale.replay.real import EngineRecording, start_server_recording
from lightning_stale.replay.setup import check_events_options, events_path

log = logging.getLogger(__name__)


class EventRecording:
    """Mixin for `StaleStrategy` (which sets ``_resume``, ``_samplers``, ``_server``,
    ``_final_stats``, ``path`` and ``seed``), placed before `RunEnding`: its ``on_train_end``
    closes this rank's side log before the learner's goodbye and merges the log after the
    server's end. ``_recording`` is this rank's `EngineRecording` during a recorded fit."""

    record_events: bool | str | os.PathLike
    digest_every: int
    _recording: EngineRecording | None = None

    def _init_recording(self, record_events: Any, digest_every: Any) -> None:
        check_events_options(record_events, digest_every)
        self.record_events, self.digest_every = record_events, digest_every

    def _note_draws(self, sampler: Any) -> None:
        if self.record_events:  # the batches' indices, for the event log
            sampler.drawn = deque()

    def _start_recording(self, trainer: Any) -> Any:
        """With ``record_events``: this rank's side log and, on rank 0, the server core's
        observer (returned; None elsewhere). Rank 0 names the log's path for every rank."""
        self._recording = None
        if not self.record_events:
            return None
        if self._resume is not None:
            if self.global_rank == 0:
                log.warning("a resumed fit is not recorded: an event log starts with its run")
            for each in self._samplers:
                each.drawn = None
            return None
        path = events_path(self.record_events, trainer) if self.global_rank == 0 else None
        path = self.broadcast(str(path) if path is not None else None, src=0)
        self._recording = EngineRecording(Path(path), self.global_rank, self.seed,
                                          self._samplers[-1] if self._samplers else None)
        if self.global_rank != 0:
            return None
        self._recording.recorder = start_server_recording(self, self.lightning_module, Path(path), self.path,
                                                          self._pushes_per_epoch, self._limit_train_batches)
        return self._recording.recorder

    def _record_batch_start(self, batch: Any, first_micro_batch: bool, learner: Any) -> None:
        if self._recording is not None:
            self._recording.batch_start(batch, first_micro_batch, learner)

    def _record_step(self, learner: Any, carried_before: Any) -> None:
        if self._recording is not None:
            self._recording.after_step(learner, carried_before)

    def on_train_end(self) -> None:
        recording = self._recording
        if recording is not None:
            recording.close_learner_log()
        super().on_train_end()  # type: ignore[misc]  # (`RunEnding`'s: the goodbye, the server's end)
        if recording is not None and self._server is not None and self._final_stats is not None:
            optimizer = self.optimizers[0] if path_named(self.path).learners_step_optimizer else None
            events = recording.finish(self._server.core, self.world_size, self.lightning_module, optimizer)
            if events is not None:
                self._final_stats["events_path"] = events
        self._recording = None

    def _abandon_recording(self) -> None:
        """A failed fit: its parts stay, read as truncated."""
        if self._recording is not None:
            self._recording.abandon()
            self._recording = None
