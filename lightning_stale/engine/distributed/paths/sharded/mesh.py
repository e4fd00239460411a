"""Data between every pair of ranks, for the sharded path: gradient pieces, parameter slices and
gathered state (`sharded.owner`), one receiving and one sending thread per peer on the server's
gloo group, so that a slow transfer never holds another; `close` ends them."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import torch

from lightning_stale.engine.distributed.channels import Channel, carried
from lightning_stale.engine.distributed.frames import FRAME_BYTES, join_threads, peer_threads, recv, send
from lightning_stale.engine.distributed.messages import Kind, ShardData, TransportError

DATA, DATA_PAYLOAD = 31, 32  # tags: data between ranks (not the server's control traffic)


class DataMesh:
    """This rank's connections to the other ``p - 1`` on ``group`` (the server's gloo group):
    ``deliver(sender, message)`` gets every message (a message to oneself at once),
    ``broken(peer, error)`` every failure, a payload on a CUDA device goes on the device
    ``channels`` where there are any. Nothing moves before `start` (a peer's sends wait for this
    rank's receives)."""

    def __init__(self, group, rank: int, p: int, deliver: Callable[[int, ShardData], None],
                 max_numel: int, broken: Callable[[int, str], None],
                 channels: dict[tuple[int, int], Channel] | None = None) -> None:
        self.group, self.rank, self.p, self.deliver = group, rank, p, deliver
        self.channels = channels or {}
        self._max_numel, self._broken = max_numel, broken
        self._outboxes: dict[int, queue.Queue[ShardData]] = {peer: queue.Queue() for peer in range(p) if peer != rank}
        self._threads = peer_threads("mesh", self._outboxes, self._send_loop, self._receive_loop)

    def payload_device(self, device: torch.device) -> torch.device | None:
        """Where a payload for the peers is made: the device where channels carry it, else host."""
        return device if self.channels else None

    @property
    def payloads_on_channels(self) -> int:
        """Payloads this rank's mesh sent or received on device channels so far."""
        return carried(self.channels)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def send(self, peer: int, message: ShardData) -> None:
        if peer == self.rank:
            message.received_at = time.monotonic()
            self.deliver(self.rank, message)
        else:
            self._outboxes[peer].put(message)

    def close(self) -> None:
        """End every peer's receiving thread and this rank's sending threads."""
        for outbox in self._outboxes.values():
            outbox.put(ShardData(Kind.RETIRE))

    def join(self, timeout: float) -> list[str]:
        return join_threads(self._threads, timeout)

    def _send_loop(self, peer: int) -> None:
        outbox = self._outboxes[peer]
        try:
            while True:
                message = outbox.get()
                send(message, peer, self.group, (DATA, DATA_PAYLOAD), channel=self.channels.get((self.rank, peer)))
                if message.kind == Kind.RETIRE:
                    return
        except Exception as exc:  # noqa: BLE001 - reported, and the run ends
            self._broken(peer, f"sending data to rank {peer} failed: {exc}")

    def _receive_loop(self, peer: int) -> None:
        buffer = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        try:
            while True:
                message = recv(self.group, (DATA, DATA_PAYLOAD), peer, f"rank {peer}", self._max_numel, buffer,
                               channel=self.channels.get((peer, self.rank)))
                if message.kind == Kind.RETIRE:
                    return
                if not isinstance(message, ShardData):
                    raise TransportError(f"rank {peer} sent a {message.kind.name} on the data mesh")
                self.deliver(peer, message)
        except Exception as exc:  # noqa: BLE001
            self._broken(peer, f"receiving data from rank {peer} failed: {exc}")
