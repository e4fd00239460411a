"""`SimulatedStaleStrategy`'s event log (docs/replay.md): recording a run (``record_events``,
``digest_every``) and re-executing a recorded one (``replay``), push by push."""

from __future__ import annotations

from typing import Any

from lightning_stale.engine.simulated import SimulatedServer
from lightning_stale.method.virtual_clock import Finish
from lightning_stale.replay.events import batch_digest, combined_digest, seed_for, seed_generators
from lightning_stale.replay.recorder import EventRecorder
from lightning_stale.replay.replayer import ReplayServer
from lightning_stale.replay.setup import (
    check_events_options,
    events_path,
    start_recording,
    start_replay,
)


class EventLogMixin:
    """Records the simulated run's events, or replays a log's (``self._replay_log``, read at
    construction). ``self._recorder`` is this fit's recorder (a replay's records in memory), None
    when neither. While recording, torch's generators are seeded before each push with a seed
    derived from the strategy's seed, the learner and its push index, so that a replay draws the
    push's dropout again."""

    server: SimulatedServer | None  # the strategy's: the simulation (a replay's, when replaying)

    def _init_event_log(self, record_events: Any, digest_every: Any) -> None:
        check_events_options(record_events, digest_every)
        self.record_events, self.digest_every = record_events, digest_every
        self.replay_report: dict | None = None
        self._recorder: EventRecorder | None = None
        self._draws = 0  # training batches handed to this fit so far
        self._push_draw: dict = {}  # what the push in progress drew

    def _start_replay(self, module: Any, state: Any, restored: dict | None) -> bool:
        """Make the server this fit's replay of the log, if one is replayed: True then."""
        self._recorder, self._draws = None, 0
        if self._replay_log is None:
            return False
        if restored is not None:
            raise ValueError("a replay starts from the recorded run's start: fit it without ckpt_path")
        replaying = start_replay(self._replay_log, module, self.optimizers[0], state,
                                 self.variant, self.staleness_compensation, self._limit_train_batches)
        self.server, self._recorder = replaying, replaying.recorder
        return True

    @property
    def _replays_engine_log(self) -> bool:
        """Replaying a log of the real engine: its learners' recorded mini-batches are the data."""
        return self._replay_log is not None and self._replay_log.header["engine"] == "stale"

    def _start_recording(self, module: Any) -> None:
        """Record the new simulation's events, with ``record_events``."""
        if self.record_events:
            self._recorder = start_recording(self, module, events_path(self.record_events, module.trainer))
            self._running.core.observer = self._recorder

    def _note_batch(self, batch: Any, starting: Finish | None) -> None:
        """Note a training batch; ``starting``: the learner whose push begins with it (its seed is
        set now), None for a further micro-batch of the push in progress."""
        if self._recorder is not None:
            if starting is not None:
                self._push_draw = {"draw": self._draws, "batches": 0, "batch": [],
                                   "rng": self._push_seed(starting)}
                seed_generators(self._push_draw["rng"])  # dropout drawn again in a replay
            self._push_draw["batches"] += 1
            self._push_draw["batch"].append(batch_digest(batch))
        self._draws += 1

    def _push_seed(self, finish: Finish) -> int:
        server = self._running
        if isinstance(server, ReplayServer):
            return server.current_push()["rng"]
        return seed_for(self.seed, finish.learner, server.rules.counts.pushes_per_learner[finish.learner])

    def _record_push(self) -> None:
        """Record the push about to be made (before the server takes it)."""
        if self._recorder is not None:
            self._recorder.next_push(**{**self._push_draw, "batch": combined_digest(self._push_draw["batch"])})

    def _finish_event_log(self) -> None:
        """At train end: the stop line, and the replay's report or the log's path in the stats."""
        if self._recorder is not None:
            self._recorder.finish(self._running.core)
            if self._replay_log is not None:
                self.replay_report = self._running.finish()
            else:
                self._final_stats["events_path"] = self._recorder.path

    def _close_event_log(self) -> None:
        """At teardown: close the log (a fit interrupted before train end leaves it without a stop
        line: it reads as truncated)."""
        if self._recorder is not None:
            self._recorder.close()
            stats = self._final_stats
            if self._replay_log is None and stats is not None and "events_path" not in stats:
                stats["events_path"] = self._recorder.path
