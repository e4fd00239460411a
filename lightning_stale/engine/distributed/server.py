"""The parameter server across processes: the core on a thread of rank 0, deciding events one at
a time as they arrive through a `ServerEndpoint`. Any failure ends the run, every learner told why
by an ABORT; with ``on_learner_failure="continue"`` a broken learner is removed instead, and a roll
call at every epoch's end makes its death known before Lightning's collectives. An INTERRUPT (a
signal) stops every learner through the goodbye protocol."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import traceback
from collections.abc import Mapping

import torch

from lightning_stale.delays.traces import TraceRecorder
from lightning_stale.engine import streams
from lightning_stale.engine.core import Outcome, ServerCore
from lightning_stale.engine.distributed.messages import Flag, Kind, Message, text_payload
from lightning_stale.engine.distributed.transport import ServerEndpoint
from lightning_stale.method.rules import Decision

log = logging.getLogger(__name__)

LEARNER_FAILURE_MODES = ("stop", "continue")
# local events, from rank 0's learner thread
_RESUME, _METRICS, _GATHER = "resume", "metrics", "gather"


class ParameterServer:
    """Runs a `ServerCore` on its own thread (see the module docstring)."""

    def __init__(self, core: ServerCore, payloads, on_learner_failure: str = "stop",
                 heartbeat_s: float = 1.0) -> None:
        self.core, self.payloads = core, payloads
        self.on_learner_failure, self.heartbeat_s = on_learner_failure, heartbeat_s
        self.events: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # held while the core changes (checkpoints read it)
        self.error: str | None = None  # why the run ended early
        self.interrupted = False  # a signal ended it (not a failure)
        self.interruption: str | None = None  # the signal that stopped training (an INTERRUPT)
        self.learner_reports: dict[int, Message] = {}  # BYE messages
        self.endpoint: ServerEndpoint | None = None
        self._thread: threading.Thread | None = None
        self._cause = 0.0  # arrival time of the push being decided (see `Message.age`)
        self._paused = False  # an epoch ended; training resumes with rank 0's RESUME
        self._held: list[Message] = []  # pushes that arrived during the pause
        self._present: dict[int, set[int]] = {}  # epoch -> learners paused at its end (roll call)
        self._lost: set[int] = set()  # learners whose connection broke, removed or not
        # On a GPU, a stream of its own: on the default one its copies would queue behind the
        # training thread's collectives (`engine.streams`).
        device = core.state.vectors.device if core.state is not None else torch.device("cpu")
        self.stream = streams.side_stream(device, streams.SERVER)

    # ------------------------------------------------------------------ lifecycle
    @property
    def _out(self) -> ServerEndpoint:
        assert self.endpoint is not None, "the server sends once started"
        return self.endpoint

    def start(self, endpoint: ServerEndpoint) -> None:
        self.endpoint = endpoint
        self._cause = time.monotonic()
        self._broadcast(Kind.PARAMS)  # everyone starts from w_0 (or the resumed parameters)
        self._thread = threading.Thread(target=self._run, daemon=True, name="stale-server")
        self._thread.start()

    def join(self, timeout: float) -> bool:
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def resume(self, metrics: Mapping[str, float], handed: Mapping[str, float] | None = None) -> None:
        """Training goes on after an epoch's end (rank 0's logged metrics, for its schedulers);
        ``handed``: those every learner is sent (METRICS), for its own plateau schedulers."""
        self.events.put((_RESUME, dict(metrics), None if handed is None else dict(handed)))

    def report_metrics(self, metrics: Mapping[str, float]) -> None:
        """Rank 0's latest logged metrics, for plateau schedulers stepped per update."""
        self.events.put((_METRICS, dict(metrics), None))

    def pop_update_records(self) -> list:
        with self.lock:
            return self.core.pop_records()

    def state_dict(self) -> dict:
        with self.reading():
            return self.core.state_dict()

    @contextlib.contextmanager
    def reading(self):
        """Hold the core still for a reader on another thread (a checkpoint copies inside)."""
        with self.lock, streams.reading(self.stream):
            yield

    def final_report(self, unannounced: tuple[int, list[float], int] | None = None
                     ) -> tuple[dict, TraceRecorder]:
        """The final counters and the trace of the delays the learners drew (``unannounced``: rank,
        delays and cancelled work of a learner that said no goodbye: rank 0's, after a failure)."""
        reports = {r: ([] if m.payload is None else m.payload.tolist(), m.cancelled)
                   for r, m in self.learner_reports.items()}
        if unannounced is not None and unannounced[0] not in reports:
            rank, delays, cancelled = unannounced
            reports[rank] = ([float(d) for d in delays], cancelled)
        stats = self.core.stats()
        stats["computations_cancelled"] = sum(cancelled for _, cancelled in reports.values())
        recorder = TraceRecorder()
        for learner in sorted(reports):
            for value in reports[learner][0]:
                recorder.record(learner, value)
        return stats, recorder

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        with streams.running_on(self.stream):
            self._loop()

    def _loop(self) -> None:
        try:
            while self.error is None and len(self.learner_reports) < len(self.core.rules.alive):
                try:
                    event = self.events.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    event = None
                self._out.heartbeat(self.heartbeat_s)
                if event is not None:
                    self._handle(event)
        except BaseException as exc:  # noqa: BLE001 - every learner must hear why
            detail = "".join(traceback.format_exception(exc)).rstrip()
            self._abort(f"the parameter server failed: {type(exc).__name__}: {exc}\n{detail}")

    def _handle(self, event) -> None:
        if isinstance(event, tuple):
            kind, metrics, handed = event  # (handed: the metrics resume hands the learners)
            with self.lock:
                if kind == _GATHER:
                    self.payloads.gather(metrics)
                elif kind == _RESUME:
                    self.core.begin_epoch(time.monotonic(), metrics)
                    self.payloads.on_schedule(self.core.epoch, metrics, per_update=False)
                    if handed is not None:  # (before any update of the new epoch, as the learners wait)
                        for learner in self.core.rules.alive:
                            self._out.send(learner, Message(Kind.METRICS, learner, self.core.version, self.core.epoch,
                                                            payload=text_payload(json.dumps(handed))))
                else:
                    self.core.report_metrics(metrics)
                    self.payloads.on_schedule(self.core.epoch, metrics, per_update=True)
            if kind == _RESUME:
                self._release_held()
        elif event.kind == Kind.PUSH and self._paused:
            # Nothing changes while paused (validation and checkpoints see the epoch's end; its
            # schedulers step before the next epoch's first update, as under DDP).
            if event.lent is not None:
                event.lent.keep()  # out of its slot: the learner's next push must not wait for it
            self._held.append(event)
        elif event.kind == Kind.PUSH and event.lent is not None:
            # Read in place in its shared-memory slot, the learner's again once decided.
            event.lent.use(lambda payload: self._on_push(event))
        elif event.kind == Kind.PUSH:
            self._on_push(event)
        elif event.kind == Kind.BYE:
            self.learner_reports[event.learner] = event
            self._stop()  # one learner leaving ends training for all (e.g. early stopping)
        elif event.kind == Kind.HALT:
            log.info("learner %d asks to stop: training stops for every learner", event.learner)
            self._stop()
        elif event.kind == Kind.ABORT:
            self._abort(event.error, interrupted=bool(event.flags & Flag.INTERRUPTED))
        elif event.kind == Kind.INTERRUPT:
            self._interrupt(event.error)
        elif event.kind == Kind.FAILED:
            self._on_broken(event)
        elif event.kind == Kind.PRESENT:
            self._present.setdefault(event.epoch, set()).add(event.learner)
            self._answer_roll_call()

    def _on_push(self, message: Message) -> None:
        # Answers count their age from the push's arrival, kept monotone: two receiving threads can
        # queue pushes out of stamp order (the error is that gap, microseconds).
        self._cause = max(self._cause, message.received_at or time.monotonic())
        unusable = message.error if message.flags & Flag.UNUSABLE else None
        contribution = None if unusable is not None else self.payloads.contribution(message)
        with self.lock:
            outcome = self.core.push(message.learner, message.version, self._cause,
                                     contribution=contribution, loss=message.loss,
                                     samples=message.samples, unusable=unusable, local_steps=message.local_steps)
            if contribution is not None and message.lent is not None and not message.lent.settled \
                    and self.core.holds(contribution):
                contribution.own()  # (K > 1) it waits for other gradients: out of the slot
            self._answer(outcome)

    def _release_held(self) -> None:
        """Training goes on: the pushes held in the pause are decided as if they arrived now."""
        self._paused = False
        held, self._held = self._held, []
        for message in held:
            message.received_at = time.monotonic()
            self._on_push(message)

    def unheard_death(self) -> str | None:
        """A learner's connection broke mid-run where that ends the run, as the endpoint saw it: for
        the watchdog, which must not depend on this server's loop (it may be stuck on a GPU behind
        a payload that will never arrive); the same facts as `_on_broken` reads."""
        if self.endpoint is None:
            return None
        for learner, error in list(self.endpoint.broken.items()):
            if not self._leaving(learner) and self._death_ends_run():
                return f"learner {learner} died: {error}"
        return None

    def _leaving(self, learner: int) -> bool:
        """Whether ``learner`` left or is leaving (its connection closing is no fault)."""
        return learner in self.learner_reports or self.core.stopped

    def _death_ends_run(self) -> bool:
        """Whether a learner's death ends the run: unless asked to go on, and it can (K < P)."""
        return self.on_learner_failure != "continue" or self.core.rules.k == self.core.rules.p

    def _on_broken(self, event: Message) -> None:
        learner = event.learner
        self._lost.add(learner)
        if self._leaving(learner):
            self._answer_roll_call()  # (after the stop nothing more is removed: it is not waited for)
            return
        if self._death_ends_run():
            p = self.core.rules.p
            why = "" if self.on_learner_failure != "continue" else (
                f" (on_learner_failure='continue' needs K < P; K = P = {p}: every update waits "
                "for every learner)")
            self._abort(f"learner {learner} died: {event.error}{why}")
            return
        log.warning("learner %d died (%s); training goes on without it", learner, event.error)
        self._out.forget(learner)
        with self.lock:
            outcome = self.core.remove_learner(learner, time.monotonic())
            self._answer(outcome)
        self._answer_roll_call()

    def _answer_roll_call(self) -> None:
        """The learners validate once every learner alive reported at the epoch's end (PRESENT); a
        dead one is removed and counted in the answer, known before Lightning's collectives."""
        alive = set(self.core.rules.alive) - self._lost - set(self.learner_reports)
        for epoch in sorted(self._present):
            if not alive <= self._present[epoch]:
                continue
            del self._present[epoch]
            dead = len(self.core.rules.counts.dead_learners)
            for learner in sorted(alive):
                self._out.send(learner, Message(Kind.PRESENT, learner, self.core.version, epoch, dead=dead))

    def _answer(self, outcome: Outcome) -> None:
        if outcome.update is not None:
            self.payloads.on_update(outcome.update, outcome.contributions, outcome.weights)
        if outcome.stopped:  # (the update that stopped training, if one did, goes with the stop)
            self._broadcast_stop(outcome.decision)
            return
        self._send_decision(outcome.decision)
        if outcome.epoch_ended:
            # Everyone validates the server's parameters; the pause is no training time.
            self.core.pause(time.monotonic())
            self._paused = True
            self._broadcast(Kind.EPOCH)

    def _send_decision(self, decision: Decision) -> None:
        for learner in decision.refresh:
            self._send(learner, Kind.PARAMS, decision)
        if self.core.rules.variant.pusher_needs_answer:  # else the pusher went on without waiting
            for learner in decision.resume:
                self._send(learner, Kind.CONTINUE)

    def _stop(self) -> None:
        with self.lock:
            if not self.core.stopped:
                self.core.stop()
                self._broadcast_stop()
        self._release_held()  # counted as in flight at the stop

    def _interrupt(self, reason: str) -> None:
        """A signal on some process: training stops for everyone, each learner told why first."""
        with self.lock:
            if self.core.stopped:
                log.warning("%s after training had stopped: ignored", reason)
                return
        self.interruption = reason
        self._tell_all(Kind.INTERRUPT, reason)
        self._stop()

    def _abort(self, reason: str, interrupted: bool = False) -> None:
        """The run ends early: every learner is told why."""
        if self.error is not None:
            return
        self.error, self.interrupted = reason, interrupted
        with self.lock:
            self.core.stop()
        self._tell_all(Kind.ABORT, reason, Flag.INTERRUPTED if interrupted else 0)

    def _tell_all(self, kind: Kind, reason: str, flags: int = 0) -> None:
        for learner in self.core.rules.alive:
            self._out.send(learner, Message(kind, learner, flags=flags, error=reason, payload=text_payload(reason)))

    # ------------------------------------------------------------------ sending
    def _send(self, learner: int, kind: Kind, decision: Decision | None = None) -> None:
        self._out.send(learner, self._message(learner, kind, decision))

    def _message(self, learner: int, kind: Kind, decision: Decision | None = None) -> Message:
        core = self.core
        message = Message(kind, learner, core.version, core.epoch, dead=len(core.rules.counts.dead_learners),
                          local_steps=core.local_steps, inner_steps=core.inner_steps, caused_at=self._cause)
        self.payloads.fill(message, core, decision)
        return message

    def _broadcast(self, kind: Kind) -> None:
        for learner in self.core.rules.alive:
            self._send(learner, kind)

    def _broadcast_stop(self, decision: Decision | None = None) -> None:
        """The final parameters for everyone (``decision``: the one that stopped training); what the
        payloads do at the stop goes before the stops, which close the connections."""
        stops = [self._message(learner, Kind.STOP, decision) for learner in self.core.rules.alive]
        self.payloads.on_stop()
        for message in stops:
            self._out.send(message.learner, message)

    def gather(self, request: int) -> None:
        """Have the payloads collect the model's state where it is spread."""
        self.events.put((_GATHER, request, None))
