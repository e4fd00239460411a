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
from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.transport import LearnerEndpoint


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


class MiniBatchClock:
    """When the current mini-batch's time X began, and how much of a drawn delay is left.

    With ``total`` (``delay_mode="total"``), a drawn delay is the mini-batch's whole time X as
    the server sees it, from the server event that started the mini-batch to the arrival of its
    gradient (docs/method.md, "Setting"). The server's processing (a message's ``age``), the
    downlink, waking up, Lightning's step, forward, backward and the uplink to come all count
    toward it: the start is the server event, moved back by the message's age and the measured
    round trip (`MessageLatency`). A learner that goes on right after its own push (K-batch-sync)
    starts at that push. Without ``total``, the whole draw is added after the computation.
    """

    def __init__(self, total: bool) -> None:
        self.total = total
        self.latency = MessageLatency()
        self._start = self._last_event = self._pushed_at = time.monotonic()
        self._pushes = self._timed_pushes = 0

    def restart(self) -> None:
        """A mini-batch starts now, not on a server message (e.g. after validation)."""
        self._start = time.monotonic()

    def pushed(self) -> None:
        self._pushes += 1
        self._pushed_at = time.monotonic()

    def message(self, message: Message) -> None:
        """A server message arrived: a round-trip sample if it is the first answer to our latest
        push, and the instant of its server event on this clock."""
        if message.pushes == self._pushes > self._timed_pushes:
            self.latency.observe(message.received_at - self._pushed_at - message.hold)
            self._timed_pushes = self._pushes
        self._last_event = (message.received_at or time.monotonic()) - message.age - self.latency.mean

    def next_mini_batch(self, started_by_server: bool) -> None:
        """The next mini-batch began with the latest server message, or with our own push."""
        self._start = self._last_event if started_by_server else self._pushed_at

    def remaining(self, seconds: float) -> float:
        """What is left of a drawn delay of ``seconds`` at this instant."""
        if not self.total:
            return seconds
        return max(0.0, seconds - (time.monotonic() - self._start))


class Learner:
    """Args:
        endpoint: this rank's transport.
        view: the flat view of the module's trainable parameters.
        delay: a straggler model (``sample(rank)``), or None.
        failed: callable returning an error string when the server (on this rank) failed.
        waits_for_answer: False where the variant needs no answer to a push (K-batch-sync, see
            `Variant.pusher_needs_answer`): the learner goes straight on to its next mini-batch.
        delay_is_total: the drawn delay is the mini-batch's whole time X (see `MiniBatchClock`);
            False: the delay is added after the computation.
    """

    def __init__(self, endpoint: LearnerEndpoint, view: FlatView, delay=None,
                 failed=lambda: None, waits_for_answer: bool = True,
                 delay_is_total: bool = False) -> None:
        self.endpoint, self.view, self.delay = endpoint, view, delay
        self.waits_for_answer = waits_for_answer
        self.clock = MiniBatchClock(delay_is_total)
        self.rank = endpoint.rank
        self._failed = failed
        self.version = -1
        self.server_epochs = 0  # epochs the server has ended
        self.stopped = False
        self.cancelled = 0  # gradients computed and thrown away before their push
        self.delays: list[float] = []
        self.pushes = 0

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
            self.clock.message(m)
            if m.payload is not None and m.version != self.version:
                self.view.load_params(m.payload)
                self.version = m.version
            self.server_epochs = max(self.server_epochs, m.epoch)
            self.stopped |= m.kind == Kind.STOP

    def wait_for_parameters(self) -> None:
        """Block until the server's first parameters arrive (w_0, or the resumed state)."""
        while self.version < 0 and not self.stopped:
            self._absorb(self._wait(None))
        self.clock.restart()

    # ------------------------------------------------------------------ one step
    def epoch_over(self, local_epoch: int) -> bool:
        return self.stopped or self.server_epochs > local_epoch

    def step(self, loss: float, samples: int, local_epoch: int) -> None:
        """After backward: delay, push and wait for the answer, unless interrupted first."""
        started_by_server = True
        try:
            started_by_server = self._step(loss, samples, local_epoch)
        finally:
            self.clock.next_mini_batch(started_by_server)

    def _step(self, loss: float, samples: int, local_epoch: int) -> bool:
        """One mini-batch's push; True when the next mini-batch starts on a server message."""
        if self.epoch_over(local_epoch):
            self.cancelled += 1  # computed after the epoch ended: the flush superseded it
            return True
        interrupt = self._drain()  # cancelled while computing?
        if not interrupt and self.delay is not None:
            seconds = self.delay.sample(self.rank)
            self.delays.append(seconds)
            interrupt = self._wait(self.clock.remaining(seconds))  # interruptible
        if interrupt:
            self.cancelled += 1
            self._absorb(interrupt)
            return True
        gradient = self.view.grads_vector()
        self.pushes += 1
        self.clock.pushed()
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
        self.endpoint.push(Message(Kind.BYE, version=self.version, cancelled=self.cancelled,
                                   payload=delays))
        deadline = time.monotonic() + timeout
        while not self.stopped:
            messages = self._wait(max(0.0, deadline - time.monotonic()))
            if not messages:
                raise ServerFailed(f"learner {self.rank}: no stop from the server within {timeout} s")
            self._absorb(messages)
        self.endpoint.join(timeout)
