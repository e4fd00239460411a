"""A learner's clocks: the time X of its mini-batch as the server sees it, and how long the server
has been silent."""

from __future__ import annotations

import time
from collections import deque

from lightning_stale.engine.distributed.messages import Message
from lightning_stale.engine.distributed.transport import LearnerEndpoint

POLL_S = 0.1  # how often a waiting learner looks at the server's health


class MessageLatency:
    """Mean of a learner's last ``window`` round trips without the server's time: (answer received -
    push sent) - the server's hold, each on one clock (NTP's offset/delay method, RFC 5905 section
    8), so no clock is shared across machines."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._samples.append(max(0.0, seconds))

    @property
    def mean(self) -> float:
        return sum(self._samples) / len(self._samples) if self._samples else 0.0


class MiniBatchClock:
    """When the current mini-batch's time X began, and how much of a drawn delay is left."""

    def __init__(self, total: bool) -> None:
        self.total = total
        self.latency = MessageLatency()
        self._start = self._last_event = self._pushed_at = time.monotonic()
        self._pushes = self._timed_pushes = 0

    def restart(self) -> None:  # the first mini-batch starts now, not on a server message
        self._start = time.monotonic()

    def resume(self, paused_s: float) -> None:
        self._start += paused_s
        self._last_event += paused_s

    def pushed(self) -> None:
        self._pushes += 1
        self._pushed_at = time.monotonic()

    def message(self, message: Message) -> None:
        """A server message arrived: maybe a round trip, and the instant of its server event here."""
        if message.pushes == self._pushes > self._timed_pushes:
            self.latency.observe(message.received_at - self._pushed_at - message.hold)
            self._timed_pushes = self._pushes
        self._last_event = (message.received_at or time.monotonic()) - message.age - self.latency.mean

    def next_mini_batch(self, started_by_server: bool) -> None:
        """The next mini-batch began with the latest server message, or with our own push."""
        self._start = self._last_event if started_by_server else self._pushed_at

    def elapsed(self) -> float:
        """The mini-batch's time so far as the server will see it (its start counts the uplink)."""
        return time.monotonic() - self._start

    def remaining(self, seconds: float) -> float:
        """What is left of a drawn delay of ``seconds`` at this instant."""
        if not self.total:
            return seconds
        return max(0.0, seconds - (time.monotonic() - self._start))


class Silence:
    """How long the server has been silent, seen from one thread; time this process was frozen
    or starved does not count (its messages may wait unread)."""

    def __init__(self, endpoint: LearnerEndpoint) -> None:
        self.endpoint = endpoint
        self._last_look = self._awake_since = time.monotonic()

    def silent_for(self) -> float:
        now = time.monotonic()
        if now - self._last_look > 10 * POLL_S:
            self._awake_since = now
        self._last_look = now
        return now - max(self.endpoint.last_heard, self._awake_since)
