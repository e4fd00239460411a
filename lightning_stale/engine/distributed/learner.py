"""A learner's side of the protocol: push a gradient, wait for the answer, obey cancellations.

One `Learner` lives in every Trainer process. After Lightning's closure has run forward and
backward, `Learner.step` draws the injected straggler delay, pushes the gradient with the version
it was computed at, and blocks until the server answers (new parameters, or leave to go on). Any
message that arrives *before* the push interrupts the work: it is a cancellation (sync family),
an epoch end or the stop, and the gradient is thrown away and counted, never pushed.
"""

from __future__ import annotations

import math
import queue
import time
from collections import deque

import torch

from lightning_stale.engine.state import FlatView
from lightning_stale.engine.distributed.transport import Kind, LearnerEndpoint, Message


class ServerFailed(RuntimeError):
    """The parameter server or the transport failed; training cannot go on."""


class MessageLatency:
    """Running mean of a learner's message round trip without the server's time: for each push
    answered, (answer received - push sent) - the server's hold, both durations on one clock
    (the NTP offset/delay method, RFC 5905 section 8), so no clock is shared across machines.
    The mean of the last ``window`` samples, so it follows the machine's load."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._samples.append(max(0.0, seconds))

    @property
    def mean(self) -> float:
        return sum(self._samples) / len(self._samples) if self._samples else 0.0


class Learner:
    """Args:
        endpoint: this rank's transport.
        view: the flat view of the module's trainable parameters.
        delay: a straggler model (``sample(rank)``), or None.
        failed: callable returning an error string when the server (on this rank) failed.
        waits_for_answer: False where the variant needs no answer to a push (K-batch-sync, see
            `Variant.pusher_needs_answer`): the learner goes straight on to its next mini-batch.
        delay_is_total: the drawn delay is the mini-batch's whole time X as the server sees it
            (docs/method.md's compute time): from the server sending the parameters to it receiving
            the gradient. The real computation and the learner's measured message latency
            (`MessageLatency`) count toward it. False: the delay is added after the computation.
    """

    def __init__(self, endpoint: LearnerEndpoint, view: FlatView, delay=None,
                 failed=lambda: None, waits_for_answer: bool = True,
                 delay_is_total: bool = False) -> None:
        self.endpoint, self.view, self.delay = endpoint, view, delay
        self.waits_for_answer, self.delay_is_total = waits_for_answer, delay_is_total
        # When the current mini-batch's time X began, as the server will see it at the push's
        # arrival (see `_absorb`), or (a learner that goes on without an answer) when it pushed.
        self._cycle_start = time.monotonic()
        self._last_event_at = self._cycle_start
        self.rank = endpoint.rank
        self._failed = failed
        self.version = -1
        self.server_epochs = 0  # epochs the server has ended
        self.stopped = False
        self.cancelled = 0  # gradients computed and thrown away before their push
        self.delays: list[float] = []
        self.pushes = 0
        self._pushed_at = 0.0
        self._timed_pushes = 0  # pushes whose round trip was measured
        self.latency = MessageLatency()

    # ------------------------------------------------------------------ waiting
    def _wait(self, timeout: float | None) -> list[Message]:
        """Messages from the server, blocking up to ``timeout`` (None: until one arrives)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if remaining <= 0:
                return []
            try:
                first = self.endpoint.inbox.get(timeout=remaining)
                break
            except queue.Empty:
                error = self._failed()
                if error:
                    raise ServerFailed(error) from None
        return [first, *self._drain()]

    def _drain(self) -> list[Message]:
        messages = []
        while True:
            try:
                messages.append(self.endpoint.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _absorb(self, messages: list[Message]) -> None:
        for m in messages:
            if m.kind == Kind.FAILED:
                raise ServerFailed(m.error)
            if m.pushes == self.pushes > self._timed_pushes:  # the first answer to our latest push
                self.latency.observe(m.received_at - self._pushed_at - m.hold)
                self._timed_pushes = self.pushes
            # On this learner's clock: when the server event this message answers happened
            # (its age is the server's processing), less the round trip (the downlink behind
            # this message and the uplink ahead of the next push). A mini-batch started by this
            # message has used (now - this) of its X when its push arrives.
            self._last_event_at = (m.received_at or time.monotonic()) - m.age - self.latency.mean
            if m.payload is not None and m.version != self.version:
                self.view.load_params(m.payload)
                self.version = m.version
            self.server_epochs = max(self.server_epochs, m.epoch)
            self.stopped |= m.kind == Kind.STOP

    def wait_for_parameters(self) -> None:
        """Block until the server's first parameters arrive (w_0, or the resumed state)."""
        while self.version < 0 and not self.stopped:
            self._absorb(self._wait(None))
        self.restart_clock()

    def restart_clock(self) -> None:
        """A mini-batch starts now, not on a server message (e.g. after validation)."""
        self._cycle_start = time.monotonic()

    def _remaining_delay(self, seconds: float) -> float:
        """In total mode, what is left of X after what this mini-batch has already taken: the
        server's processing and the messages that started it, waking up, Lightning's step,
        forward and backward, and the uplink to come (see `_absorb`)."""
        if not self.delay_is_total:
            return seconds
        return max(0.0, seconds - (time.monotonic() - self._cycle_start))

    # ------------------------------------------------------------------ one step
    def epoch_over(self, local_epoch: int) -> bool:
        return self.stopped or self.server_epochs > local_epoch

    def step(self, loss: float, samples: int, local_epoch: int) -> None:
        """After backward: delay, push and wait for the answer, unless interrupted first."""
        started_by_server = True
        try:
            started_by_server = self._step(loss, samples, local_epoch)
        finally:  # the next mini-batch's X started with the last message, or with our push
            self._cycle_start = self._last_event_at if started_by_server else self._pushed_at

    def _step(self, loss: float, samples: int, local_epoch: int) -> bool:
        """One mini-batch's push; True when the next mini-batch starts on a server message."""
        if self.epoch_over(local_epoch):
            self.cancelled += 1  # computed after the epoch ended: the flush superseded it
            return True
        interrupt = self._drain()  # cancelled while computing?
        if not interrupt and self.delay is not None:
            seconds = self.delay.sample(self.rank)
            self.delays.append(seconds)
            interrupt = self._wait(self._remaining_delay(seconds))  # interruptible
        if interrupt:
            self.cancelled += 1
            self._absorb(interrupt)
            return True
        gradient = self.view.grads_vector()
        self.pushes += 1
        self._pushed_at = time.monotonic()
        self.endpoint.push(Message(Kind.PUSH, version=self.version, samples=samples,
                                   loss=loss if math.isfinite(loss) else float("nan"),
                                   payload=gradient))
        if self.waits_for_answer:
            self._absorb(self._wait(None))
            return True
        return False

    # ------------------------------------------------------------------ leaving
    def close(self, timeout: float) -> None:
        """Say goodbye (with the delays drawn), then wait for the server's stop."""
        delays = torch.tensor(self.delays, dtype=torch.float64) if self.delays else None
        self.endpoint.push(Message(Kind.BYE, version=self.version, samples=self.cancelled,
                                   payload=delays))
        deadline = time.monotonic() + timeout
        while not self.stopped:
            messages = self._wait(max(0.0, deadline - time.monotonic()))
            if not messages:
                raise ServerFailed(f"learner {self.rank}: no stop from the server within {timeout} s")
            self._absorb(messages)
        self.endpoint.join(timeout)
