"""The parameter server across processes: the core on a thread of global rank 0, talking to the
learners through a `ServerEndpoint`.

Events in (one push or goodbye at a time, decided the moment it arrives), `ServerCore` decides
and applies, answers out. It never waits for more than the rules ask. Epochs are the server's:
after one pass worth of mini-batches has been pushed (all learners together) the core ends the
epoch; the server then tells every learner, so that Lightning's epoch-end work (validation,
checkpoints, their collectives) runs with all learners in step and on the server's parameters.
"""

from __future__ import annotations

import queue
import threading
import time

from lightning_stale.engine.core import Outcome, ServerCore
from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.transport import ServerEndpoint
from lightning_stale.method.rules import Decision


class ParameterServer:
    """Runs a `ServerCore` on its own thread (see the module docstring).

    Args:
        core: the decisions, state and books; its clock is ``time.monotonic()``.
    """

    def __init__(self, core: ServerCore) -> None:
        self.core = core
        self.events: queue.Queue[Message] = queue.Queue()
        self.lock = threading.Lock()  # held while the core changes (checkpoints read it)
        self.error: str | None = None
        self.learner_reports: dict[int, Message] = {}  # BYE messages
        self.endpoint: ServerEndpoint | None = None
        self._thread: threading.Thread | None = None
        self._cause = 0.0  # arrival time of the push being decided (see `Message.age`)

    # ------------------------------------------------------------------ lifecycle
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

    def resume(self) -> None:
        """Training resumed after an epoch end (called from rank 0's learner)."""
        with self.lock:
            self.core.resume(time.monotonic())

    def pop_update_records(self) -> list:
        with self.lock:
            return self.core.pop_records()

    def state_dict(self) -> dict:
        with self.lock:
            return self.core.state_dict()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        p = self.core.rules.p
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
            outcome = self.core.push(message.learner, message.version, self._cause,
                                     gradient=message.payload, loss=message.loss,
                                     samples=message.samples)
            self._answer(outcome)

    def _answer(self, outcome: Outcome) -> None:
        if outcome.stopped:
            self._broadcast(Kind.STOP)
            return
        self._send_decision(outcome.decision)
        if outcome.epoch_ended:
            # The pause for the epoch's end (validation) is no training time.
            self.core.pause(time.monotonic())
            if outcome.flush is not None:
                self._send_decision(outcome.flush)

    def _send_decision(self, decision: Decision) -> None:
        for learner in decision.refresh:
            self._send(learner, Kind.PARAMS)
        if self.core.rules.variant.pusher_needs_answer:  # else the pusher went on without waiting
            for learner in decision.resume:
                self._send(learner, Kind.CONTINUE)

    def _stop(self) -> None:
        with self.lock:
            if self.core.stopped:
                return
            self.core.stop()
            self._broadcast(Kind.STOP)

    # ------------------------------------------------------------------ sending
    def _send(self, learner: int, kind: Kind) -> None:
        core = self.core
        payload = None if kind == Kind.CONTINUE else core.state.snapshot(core.version)
        self.endpoint.send(learner, Message(kind, learner, core.version, core.epoch, payload=payload,
                                            caused_at=self._cause))

    def _broadcast(self, kind: Kind) -> None:
        for learner in range(self.core.rules.p):
            self._send(learner, kind)
