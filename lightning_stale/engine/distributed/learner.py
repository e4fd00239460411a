"""A learner's side of the protocol (docs/method.md, "Setting"; docs/concepts/server.md).

`Learner.step` runs after Lightning's closure: it draws the injected delay, pushes the gradient
and waits for the answer; new parameters cancel work (sync family), a stop ends it, an epoch's
end pauses it (work in flight is carried over, a mini-batch started after the end discarded).
Failures raise `ServerFailed` (`RunInterrupted` for a signal). Where it stands is its `Phase`.
"""

from __future__ import annotations

import json
import math
import queue
import time
from collections.abc import Callable

import torch

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.clocks import POLL_S, MiniBatchClock, Silence
from lightning_stale.engine.distributed.messages import Flag, Kind, Message, payload_text, text_payload
from lightning_stale.engine.distributed.paths.base import LearnerSide
from lightning_stale.engine.distributed.phases import Carried, Events, Phase, RunInterrupted, ServerFailed, advance
from lightning_stale.engine.distributed.transport import LearnerEndpoint
from lightning_stale.engine.state import ModelVectors


class Learner:
    """One rank's learner (``exchange``: its path's side; ``roll_call``: report at every epoch's end
    and validate once the server has heard every learner alive)."""

    def __init__(self, endpoint: LearnerEndpoint, vectors: ModelVectors, delay=None, *,
                 exchange: LearnerSide, waits_for_answer: bool = True, delay_is_total: bool = False,
                 server_error: Callable[[], str | None] = lambda: None,
                 server_timeout: float = 30.0, roll_call: bool = False) -> None:
        self.endpoint, self.vectors, self.delay = endpoint, vectors, delay
        self.exchange = exchange
        self.waits_for_answer = waits_for_answer
        self.clock = MiniBatchClock(delay_is_total)
        self.rank = endpoint.rank
        self._server_error, self.server_timeout = server_error, server_timeout
        self.version = -1
        self.server_epochs = 0  # epochs the server has ended
        self.epoch_version = 0  # the server's version at its latest epoch's end
        # AdaComm: inner steps to the version held and the latest epoch's end; the next round's H (0: fixed)
        self.inner_steps = self.epoch_inner_steps = self.next_local_steps = 0
        self.epoch_metrics: dict[int, dict] = {}  # epochs ended -> rank 0's metrics handed (METRICS)
        self._epoch_heard: int | None = None  # the epoch count of the server's latest answer
        self.phase = Phase.COMPUTING  # where this learner stands (`phases.MOVES`)
        self.stop_requested = False  # this learner asked the server to stop (`request_stop`)
        self.cancelled = 0  # mini-batches computed and never pushed
        self.delays: list[float] = []
        self.draws_per_push = 1  # delays drawn per push: H with local updates (one per mini-batch)
        self.pushes = 0
        self.last_x = math.nan  # the latest pushed mini-batch's time X, as the server saw it
        self.paused_at: float | None = None  # when the server's epoch's end paused this learner
        self.carried: Carried | None = None
        self._deferred: list[Message] = []  # parameters that arrived during a pause
        self.dead_learners = 0  # learners the server has lost (on_learner_failure="continue")
        self.roll_call = roll_call
        self._reported: int | None = None  # the latest epoch whose end this learner reported
        self._roll_answered = 0  # the latest epoch whose roll call the server answered
        self.interrupted: str | None = None  # the signal that stopped the run, as the server said
        self._validation_state: torch.Tensor | None = None  # the server's, for validation
        self._own_state: torch.Tensor | None = None  # ours, while validating
        self._raised: str | None = None  # why this learner failed (it is then FAILED)
        self._told_server: str | None = None  # the ABORT this learner sent
        self._poll, self._watch = Silence(endpoint), Silence(endpoint)  # this thread's, the watchdog's

    # ------------------------------------------------------------------ waiting
    @property
    def failure(self) -> str | None:
        """Why the run failed, as far as this learner knows; safe from the watchdog's thread."""
        return self._raised or self.endpoint.failure or self._silence(self._watch)

    def _silence(self, clock: Silence) -> str | None:
        """Why the run failed where the server stayed silent too long on ``clock``, else None."""
        silent = clock.silent_for()
        if self.endpoint.local or silent <= self.server_timeout:
            return None
        return f"learner {self.rank}: no message from the server for {silent:.0f} s: its process is gone or frozen"

    def _check_health(self) -> None:
        """Raise if the server failed or went silent (while waiting for anything)."""
        error = self._server_error() or self._silence(self._poll) or self.endpoint.failure
        if error:
            raise ServerFailed(self._fail(error))

    def _wait(self, timeout: float | None) -> list[Message]:
        """The server's messages but heartbeats, blocking up to ``timeout`` s (None: until one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._poll.silent_for()
        while True:
            remaining = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if remaining <= 0:
                return []
            try:
                first = self.endpoint.inbox.get(timeout=remaining)
            except queue.Empty:
                self._check_health()
                continue
            messages = [m for m in [first, *self._drain()] if m.kind != Kind.HEARTBEAT]
            if messages:
                return messages

    def _drain(self) -> list[Message]:
        messages = []
        while True:
            try:
                messages.append(self.endpoint.inbox.get_nowait())
            except queue.Empty:
                return [m for m in messages if m.kind != Kind.HEARTBEAT]

    def _absorb(self, messages: list[Message]) -> Events:
        """What ``messages`` mean for the work in progress. An answer that ends an epoch is followed
        by the server's EPOCH, waited for here: the learner pauses at that update, before its loader
        draws again, so what it carries or discards does not depend on when the EPOCH arrives."""
        events = self._take(messages)
        while events.epoch_ending and not (events.paused or events.stopped or self.paused):
            events.merge(self._take(self._wait(None)))
        return events

    def _take(self, messages: list[Message]) -> Events:
        events = Events()
        for m in messages:
            streams.receive(m.payload, m.ready)  # from the server's stream (rank 0, on a GPU)
            if m.kind in (Kind.FAILED, Kind.ABORT):
                self._fail(m.error)
                raise (RunInterrupted if m.flags & Flag.INTERRUPTED else ServerFailed)(m.error)
            if m.kind == Kind.INTERRUPT:  # the server's STOP follows
                self.interrupted = self.interrupted or m.error
                continue
            self.dead_learners = max(self.dead_learners, m.dead)
            if m.kind == Kind.PRESENT:
                self._roll_answered = max(self._roll_answered, m.epoch)
                continue
            if m.kind == Kind.METRICS:
                self.epoch_metrics[m.epoch] = json.loads(payload_text(m.payload))
                continue
            if m.kind == Kind.EPOCH:
                if self.roll_call and self.phase not in (Phase.LEFT, Phase.DONE) and (self._reported or 0) < m.epoch:
                    self._reported = m.epoch
                    self._send(Message(Kind.PRESENT, version=self.version, epoch=m.epoch))
                self.exchange.resolve(m, self._check_health)
                # Only the epoch's own message ends it: the refreshes just before carry the new count
                # too, and one ending it would be followed by this in the next epoch, pausing for good.
                self.server_epochs = max(self.server_epochs, m.epoch)
                self.epoch_version = max(self.epoch_version, m.version)
                self.epoch_inner_steps = max(self.epoch_inner_steps, m.inner_steps)
                self.next_local_steps = m.local_steps or self.next_local_steps
                self._epoch_heard = max(m.epoch, self._epoch_heard or 0)
                self._validation_state = m.payload
                if self.paused_at is None:
                    self.paused_at = time.monotonic()
                if self.phase in (Phase.COMPUTING, Phase.PUSHED):
                    self._to(Phase.PAUSED)
                events.paused = True
                continue
            if m.kind == Kind.PARAMS and self.paused:
                # Taken when training goes on: an all-reduce must not cross validation's collectives.
                self._deferred.append(m)
                continue
            self.clock.message(m)
            self.next_local_steps = m.local_steps or self.next_local_steps
            if m.kind in (Kind.PARAMS, Kind.CONTINUE):
                events.epoch_ending |= self._epoch_heard is not None and m.epoch > self._epoch_heard
                self._epoch_heard = max(m.epoch, self._epoch_heard or 0)
            if m.kind in (Kind.PARAMS, Kind.STOP):
                self.exchange.resolve(m, self._check_health)
            if m.kind in (Kind.PARAMS, Kind.STOP) and (m.version != self.version or m.kind == Kind.STOP):
                self.exchange.take(m)
                self.version, self.inner_steps = m.version, m.inner_steps
                if m.payload is not None:
                    self._own_state = None  # what was saved for after validation is superseded
            elif m.lent is not None:
                m.lent.release()  # parameters already held: nothing to load, its slot is free
            events.refreshed |= m.kind == Kind.PARAMS
            events.answered |= m.kind == Kind.CONTINUE
            if m.kind == Kind.STOP:
                events.stopped = True
                self._to(Phase.DONE if self.phase is Phase.LEFT else Phase.STOPPED)
        return events

    def wait_for_parameters(self) -> None:  # w_0, or the resumed state
        while self.version < 0 and not self.stopped:
            self._absorb(self._wait(None))
        self.clock.restart()

    def stop_heard(self) -> bool:
        """Whether the server's STOP has come, taken or not."""
        self._set_aside(self._drain())
        return self._stop_waits()

    def _set_aside(self, messages: list[Message]) -> None:
        """During a pause: a failure raises, the roll call's answer is taken, the rest waits."""
        for m in messages:
            if m.kind in (Kind.FAILED, Kind.ABORT, Kind.PRESENT):
                self._take([m])  # (a failure raises)
            else:
                self._deferred.append(m)

    def _stop_waits(self) -> bool:
        return self.stopped or any(m.kind == Kind.STOP for m in self._deferred)

    # ------------------------------------------------------------------ one step
    @property
    def stopped(self) -> bool:  # the server's STOP was taken
        return self.phase in (Phase.STOPPED, Phase.DONE)

    def _to(self, phase: Phase) -> None:
        self.phase = advance(self.phase, phase)

    def _fail(self, reason: str) -> str:
        self._raised = reason
        self._to(Phase.FAILED)
        return reason

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def epoch_over(self, local_epoch: int) -> bool:
        return self.stopped or self.server_epochs > local_epoch

    def step(self, loss: float, samples: int, started_at: float, unusable: str | None = None) -> None:
        """After backward: delay, push and wait for the answer, unless the server says otherwise first."""
        started_by_server = True
        self.last_x = math.nan
        try:
            started_by_server = self._step(self._push_message(loss, samples, unusable), started_at)
        finally:
            self.clock.next_mini_batch(started_by_server)

    def _push_message(self, loss: float, samples: int, unusable: str | None) -> Message:
        message = Message(Kind.PUSH, version=self.version, samples=samples, local_steps=self.draws_per_push,
                          loss=loss if math.isfinite(loss) else math.nan)
        if unusable is not None:
            message.flags, message.error = Flag.UNUSABLE, unusable
        else:
            self.exchange.fill_push(message)
        return message

    def _step(self, push: Message, started_at: float) -> bool:
        """One mini-batch; True when the next one starts on a server message."""
        if self.stopped:
            self.cancelled += 1
            return True
        if self.paused_at is not None:  # (paused)
            if self.carried is None and started_at < self.paused_at:
                self._carry(Carried(push))  # in flight when the epoch ended
            else:
                self.cancelled += 1  # started after the epoch's end
            return True
        events = self._absorb(self._drain())
        if events.interrupts:
            self.cancelled += 1
            return True
        if events.paused:
            self._carry(Carried(push))
            return True
        return self._delay_and_push(Carried(push))

    def wait_for_metrics(self, epochs: int) -> dict | None:
        """Rank 0's metrics handed at the end of the ``epochs``-th epoch (None: the run stopped first)."""
        while epochs not in self.epoch_metrics and not self._stop_waits():
            self._absorb(self._wait(None))
        return self.epoch_metrics.get(epochs)

    def between_inner_steps(self) -> bool:
        """Between two inner steps of a round of local updates: take the server's messages; True
        where they cancel the round (new parameters or the stop, as they cancel a mini-batch at
        its push; counted as cancelled work). An epoch's end pauses it: the round goes on after."""
        if self.stopped:
            return True
        if self.paused_at is not None:
            return False
        events = self._absorb(self._drain())
        if events.interrupts:
            self.cancelled += 1
            return True
        return False

    def _send(self, message: Message) -> None:
        """Send to the server; a broken connection fails the run, named as the receiver names it."""
        try:
            self.endpoint.push(message)
        except Exception as exc:
            if self.endpoint.local:  # (a call into the server thread's queue: no connection)
                raise
            raise ServerFailed(self._fail(self.endpoint.connection_broke(exc))) from exc

    def _carry(self, work: Carried) -> None:
        """Keep ``work`` for after the epoch's end (Lightning zeroes the gradients before validation)."""
        if work.push is not None:
            self.exchange.carry(work.push)
        self.carried = work

    def _delay_and_push(self, work: Carried) -> bool:
        if self.delay is not None:
            if work.delay is None:  # (with local updates, a push's time is the sum of H draws)
                draws = [self.delay.sample(self.rank) for _ in range(self.draws_per_push)]
                self.delays.extend(draws)
                work.delay = sum(draws)
            remaining = self.clock.remaining(work.delay) if self.clock.total else work.delay - work.waited
            began = time.monotonic()
            events = self._absorb(self._wait(max(0.0, remaining)))  # interruptible
            work.waited += time.monotonic() - began
            if events.interrupts:
                self.cancelled += 1
                return True
            if events.paused:
                self._carry(work)
                return True
        push = work.push
        assert push is not None, "the work's push is still to leave"
        self.pushes += 1
        self.last_x = self.clock.elapsed()
        self.exchange.before_push(push)
        self.clock.pushed()
        self._send(push)
        self.exchange.after_push(push)
        if not self.waits_for_answer:
            return False
        self._to(Phase.PUSHED)
        return self._await_answer()

    def _await_answer(self) -> bool:
        while True:
            events = self._absorb(self._wait(None))
            if events.refreshed or events.answered or events.stopped:
                if self.phase is Phase.PUSHED:
                    self._to(Phase.COMPUTING)
                return True
            if events.paused:
                self.carried = Carried(None)
                return True

    # ------------------------------------------------------------------ epochs
    def confirm_epoch_end(self, timeout: float) -> None:
        """Paused at an epoch's end, wait for the roll call's answer (the dead counted) before
        Lightning's collectives, which a death noticed later would fail; a STOP ends the wait, a
        frozen learner holding it up past ``timeout`` (those collectives' bound) `TimeoutError`."""
        epoch, deadline = self._reported, time.monotonic() + timeout
        while epoch is not None and self._roll_answered < epoch and not self._stop_waits():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"learner {self.rank}: no answer from the server to the roll call at the end of epoch "
                    f"{epoch - 1} within {timeout:g} s: a learner that is neither dead nor at the epoch's end "
                    "(frozen?) holds it up, as it would Lightning's collectives (the strategy's `timeout`)")
            self._set_aside(self._wait(remaining))

    def enter_validation(self) -> None:
        """Validation at an epoch's end runs on the server's parameters and buffers."""
        if self._validation_state is not None and self._own_state is None:
            self._own_state = self.vectors.state_vector()
            self.vectors.load_state(self._validation_state)

    def resume(self) -> None:
        """After an epoch's end: own parameters back, the pause off the clock, the carried work first."""
        if self._own_state is not None:
            self.vectors.load_state(self._own_state)
            self._own_state = None
        self._validation_state = None
        if self.paused_at is not None:
            self.clock.resume(time.monotonic() - self.paused_at)
            self.paused_at = None
        if self.phase is Phase.PAUSED:
            self._to(Phase.COMPUTING)
        deferred, self._deferred = self._deferred, []
        events = self._absorb(deferred + self._drain())  # what came during the pause, in order
        work, self.carried = self.carried, None
        if work is None or self.stopped:
            return
        started_by_server = True
        try:
            if work.push is None:  # waiting for the answer to its push
                if not (events.refreshed or events.answered):
                    self._to(Phase.PUSHED)
                    started_by_server = self._await_answer()
            elif events.interrupts:
                self.cancelled += 1  # an update made it stale while it was paused
            else:
                started_by_server = self._delay_and_push(work)
        finally:
            self.clock.next_mini_batch(started_by_server)

    # ------------------------------------------------------------------ leaving
    def close(self, timeout: float) -> None:
        """Say goodbye (the delays drawn, the work never pushed), then wait for the stop."""
        if self.carried is not None and self.carried.push is not None:
            self.cancelled += 1  # carried past the last epoch: never pushed
        self.carried = None
        deferred, self._deferred = self._deferred, []
        self._absorb(deferred)  # a STOP heard at the epoch's end may wait among them
        delays = torch.tensor(self.delays, dtype=torch.float64) if self.delays else None
        self._to(Phase.DONE if self.stopped else Phase.LEFT)
        self._send(Message(Kind.BYE, version=self.version, cancelled=self.cancelled, payload=delays))
        deadline = time.monotonic() + timeout
        while not self.stopped:
            messages = self._wait(max(0.0, deadline - time.monotonic()))
            if not messages:
                raise ServerFailed(f"learner {self.rank}: no stop from the server within {timeout} s")
            self._absorb(messages)
        self.endpoint.join(timeout)

    def request_stop(self) -> None:
        """Ask the server to stop training for everyone; train on until its STOP."""
        if not (self.stop_requested or self.stopped):
            self.stop_requested = True
            self._send(Message(Kind.HALT, version=self.version))

    def interrupt(self, reason: str) -> None:
        """Ask the server to stop the run for everyone (``reason``: the signal), then leave."""
        self.endpoint.push(Message(Kind.INTERRUPT, version=self.version, error=reason,
                                   payload=text_payload(reason)))

    def abort(self, reason: str, interrupted: bool = False) -> None:
        """Tell the server, once, that this learner cannot go on; it has FAILED from then on."""
        if self._raised:
            return
        self._fail(reason)
        self._tell_server(reason, Flag.INTERRUPTED if interrupted else 0)

    def leave_after_failure(self) -> None:
        """After the run failed, tell a server known alive (it sent the ABORT) that this learner is
        gone, so its receiving thread ends before exit (one blocked in a gloo receive aborts it)."""
        if self._told_server or self.endpoint.local or not self.endpoint.server_aborted:
            return
        self._tell_server(f"learner {self.rank} left after the failure: {self.failure}")

    def _tell_server(self, reason: str, flags: int = 0) -> None:  # its one ABORT
        self._told_server = reason
        self.endpoint.push(Message(Kind.ABORT, version=self.version, error=reason, flags=flags,
                                   payload=text_payload(reason)))
