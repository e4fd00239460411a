"""Learners and the parameter server: point-to-point gloo on a group of their own (Lightning's
collectives never interleave with it), queues for rank 0's learner, payloads on the routes
`frames.open_routes` chose. Each remote learner has its own sending and receiving thread, so a
frozen one blocks only its own; a sender behind coalesces; a silent server sends heartbeats."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_stale.engine.distributed.channels import Channel, carried
from lightning_stale.engine.distributed.frames import FRAME_BYTES, join_threads, peer_threads, receiver_name, recv, send
from lightning_stale.engine.distributed.lanes import Lane, LaneClosed
from lightning_stale.engine.distributed.messages import (
    INLINE_PAYLOAD_BYTES,
    OWNER_KINDS,
    Kind,
    Message,
    Order,
    ShardData,
    TransportError,
    coalesce,
)

__all__ = ["INLINE_PAYLOAD_BYTES", "LearnerEndpoint", "ServerEndpoint"]

UP, UP_DATA, DOWN, DOWN_DATA = 11, 12, 21, 22  # tags: learner->server and server->learner
# The largest payloads accepted besides the model's: a goodbye's delays, an abort's reason
MAX_REPORT_VALUES = 1 << 26
MAX_REASON_BYTES = 1 << 16
_LAST = (Kind.STOP, Kind.ABORT)  # nothing follows these on a downlink


class ServerEndpoint:
    """The server's side: one inbox of events from every learner, one outbox per learner."""

    def __init__(self, group, num_learners: int, deliver: Callable[[Message], None],
                 local_inbox: queue.Queue, max_numel: int, local_owner: queue.Queue | None = None,
                 lanes: dict[int, tuple[Lane, Lane]] | None = None,
                 lend_pushes: Callable[[], bool] = lambda: False,
                 channels: dict[tuple[int, int], Channel] | None = None) -> None:
        self.group, self.num_learners, self.deliver = group, num_learners, deliver
        self._channels = channels or {}
        self._lanes, self._lend_pushes = lanes or {}, lend_pushes
        self._gone: set[int] = set()  # learners forgotten or whose connection broke
        self.broken: dict[int, str] = {}  # learner -> why its connection broke (`_broke`)
        self.local_inbox, self.local_owner = local_inbox, local_owner
        self._max_numel = max(max_numel, MAX_REPORT_VALUES)
        # learner -> (pushes received, the latest's arrival), for `Message.hold`
        self._pushes = {r: (0, 0.0) for r in range(num_learners)}
        self._last_sent = {r: time.monotonic() for r in range(num_learners)}
        # (a sender marks each message done once sent: `place_for` reads what is left to send)
        self._outboxes: dict[int, queue.Queue[Message | Order | None]] = {
            r: queue.Queue() for r in range(1, num_learners)}
        self._closed: set[int] = set()  # learners that left, died or were told to stop
        self._threads = peer_threads("server", self._outboxes, self._send_loop, self._receive_loop)
        for t in self._threads:
            t.start()

    @property
    def lane_learners(self) -> list[int]:
        return sorted(self._lanes)  # the learners whose payloads travel through shared memory

    def send(self, learner: int, message: Message | Order) -> None:
        if learner in self._closed:
            return
        self._last_sent[learner] = time.monotonic()
        if message.kind in _LAST:
            self._closed.add(learner)
        if learner == 0:
            self._stamp(0, message)
            message.received_at = time.monotonic()
            to = self.local_owner if message.kind in OWNER_KINDS else self.local_inbox
            assert to is not None, "orders go only to a rank with a shard owner"
            to.put(message)
        else:
            self._outboxes[learner].put(message)

    @property
    def payloads_on_channels(self) -> int:
        return carried(self._channels)

    def place_for(self, learner: int, numel: int, dtype: torch.dtype) -> Tensor | None:
        """Where the next payload of ``numel`` values to ``learner`` can be written now, to leave with no
        other copy: the next slot of its lane, where it travels there, nothing is queued before it and
        the learner has read the slot; else None, never a wait (a frozen learner must not hold up the server)."""
        lane = self._lanes.get(learner, (None, None))[0]
        nbytes = numel * dtype.itemsize
        if lane is None or not lane.carries(nbytes) or learner in self._closed:
            return None
        if self._outboxes[learner].unfinished_tasks:  # put, and not yet sent
            return None
        place = lane.reserve_now(nbytes)
        return None if place is None else place.view(dtype)

    def heartbeat(self, interval: float) -> None:
        """Tell every remote learner that heard nothing for ``interval`` s that the server lives."""
        now = time.monotonic()
        for learner in self._outboxes:
            if now - self._last_sent[learner] >= interval:
                self.send(learner, Message(Kind.HEARTBEAT, learner))

    def forget(self, learner: int) -> None:
        """Send nothing more to ``learner`` (it died)."""
        self._closed.add(learner)
        self._gone.add(learner)  # a sender waiting for its lane gives up
        if learner in self._outboxes:
            self._outboxes[learner].put(None)  # ends its sender

    def receive_local(self, message: Message) -> None:
        """A message from the learner on the server's own rank."""
        message.received_at = time.monotonic()
        self._received(message)

    def _received(self, message: Message) -> None:
        if message.kind == Kind.PUSH:
            self._pushes[message.learner] = (self._pushes[message.learner][0] + 1, message.received_at)
        self.deliver(message)

    def _stamp(self, learner: int, message: Message | Order) -> None:
        if not isinstance(message, Message):  # (an order to a shard owner: no latency to estimate)
            return
        pushes, last = self._pushes[learner]
        now = time.monotonic()
        message.pushes, message.hold = pushes, (now - last) if pushes else 0.0
        message.age = (now - message.caused_at) if message.caused_at else 0.0

    def _receive_loop(self, learner: int) -> None:
        # Runs until this learner says goodbye or aborts; a learner that dies breaks the recv.
        buffer = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        lane = self._lanes.get(learner, (None, None))[1]
        try:
            while True:
                lend = (Kind.PUSH,) if lane is not None and self._lend_pushes() else ()
                message = recv(self.group, (UP, UP_DATA), learner, f"learner {learner}",
                               self._max_numel, buffer, lane, lend, self._channels.get((learner, 0)))
                if not isinstance(message, Message):
                    raise TransportError(f"learner {learner} sent a {message.kind.name}, not a message to the server")
                message.learner = learner
                self._received(message)
                if message.kind in (Kind.BYE, Kind.ABORT):
                    return
        except Exception as exc:  # noqa: BLE001 - reported to the server loop, which decides
            self._gone.add(learner)
            self._broke(learner, f"receiving from learner {learner} failed: {exc}")

    def _send_loop(self, learner: int) -> None:
        outbox = self._outboxes[learner]
        lane = self._lanes.get(learner, (None, None))[0]
        channel = self._channels.get((0, learner))

        def closed() -> str | None:
            return f"learner {learner} is gone" if learner in self._gone else None

        try:
            while True:
                pending = [outbox.get()]
                while not outbox.empty():
                    pending.append(outbox.get_nowait())
                if None in pending:  # forgotten
                    return
                for message in coalesce([m for m in pending if m is not None]):
                    self._stamp(learner, message)
                    send(message, learner, self.group, (DOWN, DOWN_DATA), lane, closed, channel)
                    if message.kind in _LAST:
                        return
                for _ in pending:  # (after the sends: its lane's next slot is settled)
                    outbox.task_done()
        except LaneClosed:
            return  # its connection broke or it died: the receiving thread has reported it
        except Exception as exc:  # noqa: BLE001
            self._broke(learner, f"sending to learner {learner} failed: {exc}")

    def _broke(self, learner: int, error: str) -> None:
        """The connection to ``learner`` broke: the server loop decides what that means (FAILED);
        ``broken`` keeps it for a watchdog, which cannot wait for that loop (it may be stuck)."""
        self.broken.setdefault(learner, error)
        self.deliver(Message(Kind.FAILED, learner=learner, error=error))

    def join(self, timeout: float) -> list[str]:
        return join_threads(self._threads, timeout)


class LearnerEndpoint:
    """A learner's side: pushes go to the server, the server's messages land in ``inbox``."""

    def __init__(self, rank: int, group, max_numel: int, local_server: ServerEndpoint | None = None,
                 owner: queue.Queue | None = None, lanes: tuple[Lane, Lane] | None = None,
                 channels: dict[tuple[int, int], Channel] | None = None) -> None:
        self.rank, self.group, self.owner = rank, group, owner
        channels = channels or {}
        self._up, self._down = channels.get((rank, 0)), channels.get((0, rank))
        self._lanes = lanes or (None, None)
        self._max_numel = max(max_numel, MAX_REASON_BYTES)
        self._local_server = local_server
        self._send_lock = threading.Lock()
        self.last_heard = time.monotonic()
        self.failure: str | None = None
        self.interrupted: str | None = None
        self.server_aborted = False  # the server said the run failed: its process is alive
        self.inbox: queue.Queue = local_server.local_inbox if local_server is not None else queue.Queue()
        self._thread = None
        if local_server is None:
            self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                            name=receiver_name("learner", rank))
            self._thread.start()

    @property
    def local(self) -> bool:
        return self._local_server is not None

    def push_buffer(self, numel: int, dtype: torch.dtype) -> Tensor | None:
        """Where to pack the next push's ``numel`` values to leave without a copy: the next slot
        of this learner's lane to the server, or None (no lane, or a payload it does not carry)."""
        lane, nbytes = self._lanes[0], numel * dtype.itemsize
        if lane is None or not lane.carries(nbytes):
            return None
        return lane.reserve(nbytes, self._failed).view(dtype)  # LaneClosed: a TransportError

    def push(self, message: Message) -> None:
        message.learner = self.rank
        if self._local_server is not None:
            self._local_server.receive_local(message)
            return
        with self._send_lock:
            send(message, 0, self.group, (UP, UP_DATA), self._lanes[0], self._failed, self._up)

    def _failed(self) -> str | None:
        return self.failure  # (read by a writer waiting for a slot of its lane)

    def _receive_loop(self) -> None:
        buffer = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        try:
            while True:
                # Parameters and the stop are loaded straight out of their slot (`LentPayload`);
                # an epoch's parameters are kept for validation, so they are copied out.
                message = recv(self.group, (DOWN, DOWN_DATA), 0, "the server", self._max_numel, buffer,
                               self._lanes[1], lend=(Kind.PARAMS, Kind.STOP), channel=self._down)
                if isinstance(message, ShardData):
                    raise TransportError(f"the server sent a {message.kind.name}, which only shard owners send")
                self.last_heard = message.received_at
                if message.kind == Kind.ABORT:
                    self.failure, self.server_aborted = message.error, True
                elif message.kind == Kind.INTERRUPT:
                    self.interrupted = message.error
                to = self.owner if message.kind in OWNER_KINDS else self.inbox
                assert to is not None, "orders come only to a rank with a shard owner"
                to.put(message)
                if message.kind in _LAST:
                    return
        except Exception as exc:  # noqa: BLE001 - surfaces in the learner's next wait
            self.inbox.put(Message(Kind.FAILED, error=self.connection_broke(exc)))

    def connection_broke(self, exc: BaseException) -> str:
        """The connection to the server failed with ``exc``: this learner's failure from now on."""
        if self.failure is None:
            self.failure = (f"learner {self.rank}: the connection to the server (rank 0) broke, its "
                            f"process is gone or unreachable: {exc}")
        return self.failure

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
