"""Messages between learners and the parameter server, and how they travel.

Remote learners talk to the server over point-to-point gloo operations on a dedicated process
group (PLATFORM-NOTES: separate group, CPU tensors, so a NCCL default group is untouched). A
message is a fixed int64 header, then an optional payload tensor. The learner on the server's own
rank uses in-process queues instead: gloo cannot send to oneself.

Blocking is kept off the decision loop and away from other learners: every remote learner has
its own receiving thread and its own sender thread (which drains that learner's outbox), so a
learner frozen between the header and the payload of a message blocks only its own threads.
(A single any-source receiver would wait for that payload and stall the server.) A sender that falls behind sends only the newest message: every message carries the
complete state a learner needs (parameters, version, epochs ended, stop), see `coalesce`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

UP, UP_DATA, DOWN, DOWN_DATA = 11, 12, 21, 22  # tags: learner->server and server->learner
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class Kind(IntEnum):
    PUSH = 1  # learner -> server: a gradient (payload) computed at ``version``
    BYE = 2  # learner -> server: leaving; payload = the delays it drew
    PARAMS = 3  # server -> learner: parameters of ``version`` (payload)
    CONTINUE = 4  # server -> learner: go on with the parameters you hold
    STOP = 5  # server -> learner: training is over; payload = final parameters
    FAILED = 6  # local only: the transport broke; ``error`` says how


@dataclass
class Message:
    kind: Kind
    learner: int = 0
    version: int = 0
    epoch: int = 0  # downlink: epochs the server has ended so far
    samples: int = 0  # PUSH: mini-batch size; BYE: computations cancelled on the learner
    loss: float = 0.0
    payload: Tensor | None = None
    error: str = ""


def coalesce(messages: list[Message]) -> Message:
    """The one downlink message equivalent to receiving ``messages`` in order: the newest
    header, with the newest parameters if any message carried parameters."""
    last = messages[-1]
    if last.payload is None:
        with_params = [m for m in messages if m.payload is not None]
        if with_params:
            newest = with_params[-1]
            return replace(last, kind=Kind.PARAMS, payload=newest.payload, version=newest.version)
    return last


def _encode(m: Message) -> tuple[Tensor, Tensor | None]:
    header = torch.zeros(9, dtype=torch.int64)
    header[:6] = torch.tensor([m.kind, m.learner, m.version, m.epoch, m.samples, 0])
    header[6] = torch.tensor([m.loss], dtype=torch.float64).view(torch.int64)[0]
    if m.payload is not None:
        header[7] = m.payload.numel()
        header[8] = _DTYPES.index(m.payload.dtype)
    return header, m.payload


def _decode(header: Tensor) -> tuple[Message, int, torch.dtype]:
    h = header.tolist()
    loss = header[6:7].view(torch.float64).item()
    return Message(Kind(h[0]), h[1], h[2], h[3], h[4], loss), h[7], _DTYPES[h[8]]


def send(message: Message, dst: int, group, tags: tuple[int, int]) -> None:
    header, payload = _encode(message)
    dist.send(header, dst=dst, group=group, tag=tags[0])
    if payload is not None:
        dist.send(payload.contiguous(), dst=dst, group=group, tag=tags[1])


def recv(group, tags: tuple[int, int], src: int | None = None) -> tuple[Message, int]:
    header = torch.empty(9, dtype=torch.int64)
    sender = dist.recv(header, src=src, group=group, tag=tags[0])
    message, numel, dtype = _decode(header)
    if numel:
        message.payload = torch.empty(numel, dtype=dtype)
        dist.recv(message.payload, src=sender, group=group, tag=tags[1])
    return message, sender


class ServerEndpoint:
    """The server's side: one inbox of events from every learner, one outbox per learner.

    Args:
        group: the gloo process group of server traffic (None when P = 1).
        num_learners: P; learner l is global rank l, the server runs on rank 0.
        deliver: called with every message received (from the receiving thread).
        local_inbox: the queue of the learner living on rank 0.
    """

    def __init__(self, group, num_learners: int, deliver: Callable[[Message], None],
                 local_inbox: queue.Queue) -> None:
        self.group, self.num_learners, self.deliver = group, num_learners, deliver
        self.local_inbox = local_inbox
        self._outboxes = {r: queue.Queue() for r in range(1, num_learners)}
        self._threads = []
        for r in self._outboxes:
            self._threads += [
                threading.Thread(target=self._send_loop, args=(r,), daemon=True, name=f"stale-server-send-{r}"),
                threading.Thread(target=self._receive_loop, args=(r,), daemon=True, name=f"stale-server-recv-{r}")]
        for t in self._threads:
            t.start()

    def send(self, learner: int, message: Message) -> None:
        if learner == 0:
            self.local_inbox.put(message)
        else:
            self._outboxes[learner].put(message)

    def _receive_loop(self, learner: int) -> None:
        # Runs until this learner says goodbye; a learner that dies breaks the recv.
        try:
            while True:
                message, _ = recv(self.group, (UP, UP_DATA), src=learner)
                message.learner = learner
                self.deliver(message)
                if message.kind == Kind.BYE:
                    return
        except Exception as exc:  # noqa: BLE001 - reported to the server loop, which fails the run
            self.deliver(Message(Kind.FAILED, learner=learner,
                                 error=f"receiving from learner {learner} failed: {exc}"))

    def _send_loop(self, learner: int) -> None:
        outbox = self._outboxes[learner]
        try:
            while True:
                pending = [outbox.get()]
                while not outbox.empty():
                    pending.append(outbox.get_nowait())
                message = coalesce(pending)
                send(message, learner, self.group, (DOWN, DOWN_DATA))
                if message.kind == Kind.STOP:
                    return
        except Exception as exc:  # noqa: BLE001
            self.deliver(Message(Kind.FAILED, learner=learner,
                                 error=f"sending to learner {learner} failed: {exc}"))

    def join(self, timeout: float) -> list[str]:
        """Wait for the threads; names of those still running after ``timeout`` seconds."""
        for t in self._threads:
            t.join(timeout)
        return [t.name for t in self._threads if t.is_alive()]


class LearnerEndpoint:
    """A learner's side: pushes go to the server, the server's messages land in ``inbox``."""

    def __init__(self, rank: int, group, server_inbox: Callable[[Message], None] | None) -> None:
        self.rank, self.group = rank, group
        self.inbox: queue.Queue = queue.Queue()
        self._to_local_server = server_inbox
        self._thread = None
        if rank != 0:
            self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                            name=f"stale-learner-recv-{rank}")
            self._thread.start()

    def push(self, message: Message) -> None:
        message.learner = self.rank
        if self.rank == 0:
            self._to_local_server(message)
        else:
            send(message, 0, self.group, (UP, UP_DATA))

    def _receive_loop(self) -> None:
        try:
            while True:
                message, _ = recv(self.group, (DOWN, DOWN_DATA), src=0)
                self.inbox.put(message)
                if message.kind == Kind.STOP:
                    return
        except Exception as exc:  # noqa: BLE001 - surfaces in the learner's next wait
            self.inbox.put(Message(Kind.FAILED, error=f"receiving from the server failed: {exc}"))

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
