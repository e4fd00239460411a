"""A message's frame on the wire: the header with a small payload inside, else the header alone,
the payload following as a second gloo message, in shared memory (`lanes`) or on a device channel
(`channels`). `open_routes` chooses a rank's routes (`PayloadRoutes`) once; `send`, `recv` take them."""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.channels import Channel, open_channels
from lightning_stale.engine.distributed.lanes import Lane, open_lanes, slot_bytes_for
from lightning_stale.engine.distributed.messages import (
    HEADER_BYTES,
    IN_LANE,
    INLINE,
    INLINE_PAYLOAD_BYTES,
    ON_CHANNEL,
    SEPARATE,
    Envelope,
    Kind,
    TransportError,
    decode_header,
    encode_header,
    payload_text,
)
from lightning_stale.engine.state import ModelVectors

FRAME_BYTES = HEADER_BYTES + INLINE_PAYLOAD_BYTES
# The first exchange on a channel (`channels._first_exchange`): large enough for the protocol of
# large payloads (NCCL sends up to 16 KiB in its low-latency one), small enough to cost nothing.
FIRST_CHANNEL_NUMEL = 1 << 18
# A timeout of a channel's group ends the process (NCCL's watchdog): a learner frozen for hours
# with a payload on its way is a straggler, not a reason to end the run.
CHANNEL_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class PayloadRoutes:
    """The routes this rank's large payloads take besides a header's frame and gloo."""

    channels: dict[tuple[int, int], Channel] = field(default_factory=dict)  # by (sender, receiver)
    lanes: dict = field(default_factory=dict)  # peer -> (lane to send on, lane to receive on)
    # payloads travel between the endpoints (else channels serve a path's own connections)
    through_endpoints: bool = True

    @property
    def endpoint_channels(self) -> dict[tuple[int, int], Channel]:
        return self.channels if self.through_endpoints else {}


def open_routes(rank: int, group, pairs: list[tuple[int, int]], backend: str | None, vectors: ModelVectors, *,
                through_endpoints: bool, shared_memory: bool, lanes: dict | None = None,
                setup_timeout: datetime.timedelta | None = None) -> PayloadRoutes:
    """This rank's routes (collective over ``group``: every rank calls it)."""
    channels = {}
    if backend and group is not None:
        channels = open_channels(rank, pairs, backend, vectors.device, CHANNEL_TIMEOUT,
                                 min(vectors.max_push_numel(), FIRST_CHANNEL_NUMEL), setup_timeout)
    slot_bytes = slot_bytes_for(vectors.max_push_numel(), vectors.dtype)
    if not through_endpoints or channels:  # (device channels: the payloads stay on the device)
        lanes = {}
    elif lanes is None and group is not None and slot_bytes > INLINE_PAYLOAD_BYTES:
        # (smaller payloads travel inside their header's frame.) Collective: every rank takes
        # part, whether or not it can share memory with rank 0.
        lanes = open_lanes(group, rank, slot_bytes, enabled=shared_memory)
    return PayloadRoutes(channels, lanes or {}, through_endpoints)


def _carrier(payload: Tensor | None, channel: Channel | None) -> Channel | None:
    """``channel`` where it carries ``payload``'s kind of device (host payloads go over gloo)."""
    if payload is None or channel is None or payload.device.type != channel.device.type:
        return None
    return channel


def encode(message: Envelope, lane: Lane | None = None,
           closed: Callable[[], str | None] = lambda: None,
           channel: Channel | None = None) -> tuple[Tensor, Tensor | None]:
    """The frame to send first (with a small payload inside) and the payload to send after it, or None."""
    payload = None if message.payload is None else message.payload.reshape(-1)
    nbytes = 0 if payload is None else payload.numel() * payload.element_size()
    channel = _carrier(payload, channel)
    if payload is not None and payload.is_cuda and (channel is None or nbytes <= INLINE_PAYLOAD_BYTES):
        payload = streams.to_host(payload, message.ready)
    where = (SEPARATE if payload is None else INLINE if nbytes <= INLINE_PAYLOAD_BYTES else
             ON_CHANNEL if channel is not None else
             IN_LANE if lane is not None and lane.carries(nbytes) else SEPARATE)
    frame = torch.empty(HEADER_BYTES + (nbytes if where == INLINE else 0), dtype=torch.uint8)
    frame[:HEADER_BYTES] = torch.frombuffer(bytearray(encode_header(message, payload, where)),
                                            dtype=torch.uint8)
    if where == INLINE and payload is not None:
        frame[HEADER_BYTES:].view(payload.dtype).copy_(payload)
        return frame, None
    if where == IN_LANE and lane is not None and payload is not None:
        lane.write(payload, closed)
        return frame, None
    return frame, payload


def decode(frame: Tensor, sender: str, max_numel: int) -> tuple[Envelope, int, torch.dtype, int]:
    """`decode_header` of a received frame, an `INLINE` payload copied onto the message."""
    message, numel, dtype, where = decode_header(frame.numpy(), sender, max_numel)  # (read in place)
    if numel and where == INLINE:
        nbytes = numel * dtype.itemsize
        if HEADER_BYTES + nbytes > frame.numel():
            raise TransportError(f"{sender} announced an inline payload of {nbytes} bytes, larger "
                                 "than a frame")
        message.payload = frame[HEADER_BYTES:HEADER_BYTES + nbytes].view(dtype).clone()
    return message, numel, dtype, where


def send(message: Envelope, dst: int, group, tags: tuple[int, int], lane: Lane | None = None,
         closed: Callable[[], str | None] = lambda: None, channel: Channel | None = None) -> None:
    frame, payload = encode(message, lane, closed, channel)
    dist.send(frame, dst=dst, group=group, tag=tags[0])
    channel = _carrier(payload, channel)
    if payload is not None and channel is not None:  # (a payload left by encode goes on it)
        channel.send(payload, message.ready)
    elif payload is not None:
        dist.send(payload.contiguous(), dst=dst, group=group, tag=tags[1])


def receiver_name(side: str, peer: int) -> str:
    """A thread in `recv` from ``peer``: `strategies.faults` looks for them at a failed exit."""
    return f"stale-{side}-recv-{peer}"


RECEIVER = re.compile(r"stale-\w+-recv-\d+$")  # what `receiver_name` names


def peer_threads(side: str, peers, send_loop: Callable[[int], None],
                 receive_loop: Callable[[int], None]) -> list[threading.Thread]:
    """A sending and a receiving thread per peer (not started): a slow peer holds up only its own."""
    return [threading.Thread(target=loop, args=(peer,), daemon=True, name=name)
            for peer in peers for loop, name in ((send_loop, f"stale-{side}-send-{peer}"),
                                                 (receive_loop, receiver_name(side, peer)))]


def join_threads(threads: list[threading.Thread], timeout: float) -> list[str]:
    """Wait for ``threads``, all within ``timeout`` seconds; the names of those still running."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def recv(group, tags: tuple[int, int], src: int, sender: str, max_numel: int,
         buffer: Tensor | None = None, lane: Lane | None = None, lend: tuple[Kind, ...] = (),
         channel: Channel | None = None) -> Envelope:
    """One message from ``src`` into ``buffer`` (reused by a receiving loop); a payload in the
    sender's ``lane`` stays there for the kinds in ``lend`` (`Lane.lend`); one on ``channel``
    comes with ``Envelope.ready``."""
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8) if buffer is None else buffer
    dist.recv(frame, src=src, group=group, tag=tags[0])  # a shorter frame fits
    message, numel, dtype, where = decode(frame, sender, max_numel)
    if numel and where == IN_LANE:
        if lane is None:
            raise TransportError(f"{sender} sent a payload through shared memory, which this "
                                 "process does not share with it")
        if message.kind in lend:
            lane.lend(message, numel, dtype)
        else:
            message.payload = lane.read(numel, dtype)
    elif numel and where == ON_CHANNEL:
        if channel is None:
            raise TransportError(f"{sender} sent a payload on a device channel, which this process "
                                 "has not opened with it")
        message.payload, message.ready = channel.recv(numel, dtype)
    elif numel and where == SEPARATE:
        message.payload = torch.empty(numel, dtype=dtype)
        dist.recv(message.payload, src=src, group=group, tag=tags[1])
    if message.kind in (Kind.ABORT, Kind.INTERRUPT):  # the reason travels as the payload
        message.error = payload_text(message.payload)
    message.received_at = time.monotonic()
    return message
