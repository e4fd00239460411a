"""The parameter server loop: events in, the rules decide, `ServerState` updates, answers out.

It runs as a thread on global rank 0 beside that rank's learner. It never waits for more than
the rules ask: each event is one push (or goodbye), decided the moment it arrives. Epochs are
the server's: after one pass worth of mini-batches has been pushed (ceil(N / m) of them, all
learners together) it flushes, which drops what is pending, sends every learner the current
parameters and tells them the epoch is over, so that Lightning's epoch-end work (validation,
checkpoints, their collectives) runs with all learners in step and on the server's parameters.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.engine.records import UpdateRecord
from lightning_stale.method.rules import Decision, ServerRules
from lightning_stale.engine.state import PushedGradient, ServerState
from lightning_stale.engine.distributed.transport import Kind, Message, ServerEndpoint


@dataclass
class ServerLimits:
    max_updates: int = -1  # Trainer(max_steps): server updates, -1 for no limit
    max_epochs: int = -1  # server epochs, -1 for no limit
    pushes_per_epoch: int = 0  # mini-batches pushed per epoch; 0 never ends an epoch


class ParameterServer:
    """Applies `ServerRules` decisions to a `ServerState`, talking through a `ServerEndpoint`.

    Args:
        rules: the decision object of the variant.
        state: the authoritative parameters and optimizer.
        limits: when epochs end and when training stops.
        compensation: a `StalenessCompensation` weighting stale gradients, or None.
        adaptive: an `AdaptiveK` schedule (already limited to P), or None.
    """

    def __init__(self, rules: ServerRules, state: ServerState, limits: ServerLimits,
                 compensation: StalenessCompensation | None = None, adaptive: AdaptiveK | None = None) -> None:
        self.rules, self.state, self.limits = rules, state, limits
        self.compensation, self.adaptive = compensation, adaptive
        # version -> parameters sent, kept while a learner holds it or a pending gradient was
        # computed at it: the "norm" compensation measures ||w_j - w_tau||.
        self._snapshots: dict[int, torch.Tensor] = {}
        self.events: queue.Queue[Message] = queue.Queue()
        self.lock = threading.Lock()  # held while the state changes (checkpoints read it)
        self.epoch = 0
        self.error: str | None = None
        self.learner_reports: dict[int, Message] = {}  # BYE messages
        self._gradients: dict[int, PushedGradient] = {}  # push id -> pending
        self._pushes_this_epoch = 0
        self._records: list[UpdateRecord] = []
        # Sum and count of the intervals between consecutive updates within an epoch.
        self._interval_sum, self._interval_count = 0.0, 0
        self._last_update_time: float | None = None
        self._thread: threading.Thread | None = None
        self._cause = 0.0  # arrival time of the push being decided (see `Message.age`)
        self.endpoint: ServerEndpoint | None = None
        self.start_time = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def start(self, endpoint: ServerEndpoint) -> None:
        self.endpoint = endpoint
        self.start_time = self._cause = time.monotonic()
        self._broadcast(Kind.PARAMS)  # everyone starts from w_0
        self._thread = threading.Thread(target=self._run, daemon=True, name="stale-server")
        self._thread.start()

    def join(self, timeout: float) -> bool:
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def pop_update_records(self) -> list[UpdateRecord]:
        with self.lock:
            records, self._records = self._records, []
        return records

    @property
    def mean_update_interval_s(self) -> float:
        return self._interval_sum / self._interval_count if self._interval_count else float("nan")

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue the run (parameters and optimizer are saved by
        Lightning through the strategy)."""
        with self.lock:
            return {"state": self.state.state_dict(), "version": self.rules.version,
                    "updates": self.rules.counts.updates, "epoch": self.epoch}

    def load_state_dict(self, saved: dict) -> None:
        self.state.load_state_dict(saved["state"])
        self.rules.resume_at(saved["version"], saved["updates"])
        self.epoch = saved["epoch"]

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        p = self.rules.p
        while len(self.learner_reports) < p and self.error is None:
            message = self.events.get()
            if message.kind == Kind.PUSH:
                self._on_push(message)
            elif message.kind == Kind.BYE:
                self.learner_reports[message.learner] = message
                self._stop()  # one learner leaving ends training for all (e.g. early stopping)
            elif message.kind == Kind.FAILED:
                self.error = message.error
                self._stop()

    def _on_push(self, message: Message) -> None:
        self._cause = message.received_at or time.monotonic()  # answers count their age from here
        with self.lock:
            decision = self.rules.on_push(message.learner, message.version)
            if decision.accepted:
                self._gradients[decision.push.id] = PushedGradient(message.payload, message.loss, message.samples)
            if decision.update is not None:
                self._apply(decision)
            self._answer(decision)
            if self.rules.stopped:
                return
            self._pushes_this_epoch += 1
            if self.limits.pushes_per_epoch and self._pushes_this_epoch >= self.limits.pushes_per_epoch:
                self._end_epoch()
            elif 0 <= self.limits.max_updates <= self.rules.counts.updates:
                self._stop()

    def _apply(self, decision: Decision) -> None:
        update = decision.update
        pushed = [self._gradients.pop(g.id) for g in update.gradients]
        now = time.monotonic()
        record = self.state.apply_update(update, pushed, now, self.rules.k, self.compensation, self._snapshots)
        self._records.append(record)
        if self._snapshots:
            in_use = self.rules.versions_in_use()
            self._snapshots = {v: t for v, t in self._snapshots.items() if v in in_use}
        if self._last_update_time is not None:
            self._interval_sum += now - self._last_update_time
            self._interval_count += 1
        self._last_update_time = now
        if self.adaptive is not None:
            k = self.adaptive.observe(now - self.start_time, record.loss)
            if k is not None and k != self.rules.k:
                self.rules.set_k(k)

    def _answer(self, decision: Decision) -> None:
        for learner in decision.refresh:
            self._send(learner, Kind.PARAMS)
        if self.rules.variant.pusher_needs_answer:  # else the pusher went on without waiting
            for learner in decision.resume:
                self._send(learner, Kind.CONTINUE)

    def _end_epoch(self) -> None:
        self.epoch += 1
        self._pushes_this_epoch = 0
        self._last_update_time = None  # the pause for validation is no update interval
        self.state.end_epoch(self.epoch - 1)
        decision = self.rules.flush("epoch_end")
        self._gradients.clear()
        self.state.new_version(decision.version)
        if 0 <= self.limits.max_epochs <= self.epoch or 0 <= self.limits.max_updates <= self.rules.counts.updates:
            self._stop()
        else:
            self._answer(decision)

    def _stop(self) -> None:
        if self.rules.stopped:
            return
        self.rules.stop()
        self._gradients.clear()
        self._broadcast(Kind.STOP)

    # ------------------------------------------------------------------ sending
    def _send(self, learner: int, kind: Kind) -> None:
        payload = None if kind == Kind.CONTINUE else self.state.snapshot()
        if payload is not None and self.compensation is not None and self.compensation.needs_parameters:
            self._snapshots[self.state.version] = payload
        self.endpoint.send(learner, Message(kind, learner, self.state.version, self.epoch, payload=payload,
                                            caused_at=self._cause))

    def _broadcast(self, kind: Kind) -> None:
        for learner in range(self.rules.p):
            self._send(learner, kind)
