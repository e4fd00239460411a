"""Messages of the engine's three conversations and their wire header: a fixed-size header of
named fields (`HEADER`, packed with `struct`, starting with a magic number and the protocol
version) and an optional flat tensor payload. Nothing received is ever unpickled or executed."""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import KW_ONLY, dataclass, fields, replace
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # (lanes imports this module)
    from lightning_stale.engine.distributed.lanes import LentPayload

MAGIC = 0x5354414C45  # "STALE"
PROTOCOL = 6
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8)

# (field, struct format), in wire order; little-endian, no padding.
HEADER = (
    ("magic", "q"), ("protocol", "q"), ("kind", "q"), ("learner", "q"), ("version", "q"),
    ("epoch", "q"), ("samples", "q"), ("cancelled", "q"), ("pushes", "q"), ("flags", "q"),
    ("dead", "q"), ("seq", "q"), ("delivery", "q"), ("local_steps", "q"), ("inner_steps", "q"),
    ("numel", "q"), ("dtype", "q"), ("inline", "q"),
    ("loss", "d"), ("hold", "d"), ("age", "d"),
)
_STRUCT = struct.Struct("<" + "".join(fmt for _, fmt in HEADER))
# The fields a message holds as they are, packed and unpacked in one call each (the hot path).
_NAMES = tuple(name for name, _ in HEADER)
_ROUTE = _NAMES.index("numel")  # numel, dtype, inline: the payload's route, not message fields
assert _NAMES[:3] == ("magic", "protocol", "kind") and _NAMES[_ROUTE:_ROUTE + 3] == ("numel", "dtype", "inline")
_INTS, _FLOATS = _NAMES[3:_ROUTE], _NAMES[_ROUTE + 3:]
_ints_of, _floats_of = operator.attrgetter(*_INTS), operator.attrgetter(*_FLOATS)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
# Payloads up to this size travel inside the header's frame: one gloo message instead of two,
# half the latency where latency, not bandwidth, dominates (the digits MLP is 19 KB). Larger ones
# follow as a second message, not copied into a frame, or wait in shared memory.
INLINE_PAYLOAD_BYTES = 256 * 1024
# The header's ``inline``, where its payload travels (`frames.encode`): a second gloo message,
# the same frame, shared memory, a device channel
SEPARATE, INLINE, IN_LANE, ON_CHANNEL = 0, 1, 2, 3
HEADER_BYTES = _STRUCT.size


class TransportError(RuntimeError):
    """A frame that is not a message of this protocol, or a broken connection."""


class Kind(IntEnum):
    PUSH = 1  # learner -> server: a gradient (payload) computed at ``version``
    BYE = 2  # learner -> server: leaving; payload = the delays it drew
    PARAMS = 3  # server -> learner: parameters and buffers of ``version`` (payload)
    CONTINUE = 4  # server -> learner: go on with the parameters you hold
    STOP = 5  # server -> learner: training is over; payload = final parameters and buffers
    FAILED = 6  # local only: the transport broke; ``error`` says how
    EPOCH = 7  # server -> learner: an epoch ended; payload = the parameters to validate
    ABORT = 8  # either way: the run failed or was interrupted; payload = the reason (utf-8)
    HEARTBEAT = 9  # server -> learner: the server is alive (sent when it has nothing else to say)
    # The sharded path: data between learners and shard owners, and the server's orders to owners
    PIECE = 10  # learner -> owner: its part of push ``seq`` (gradients, buffers, presence)
    SLICE = 11  # owner -> learner: its part of the parameters of ``version``, for ``delivery``
    STATE = 12  # owner -> rank 0: its parameters and (flag OPTIMIZER) optimizer state, gathered
    APPLY = 13  # server -> owners: apply an update; payload = (learner, seq, weight) triples
    SEND = 14  # server -> owners: send ``learner`` your slice, for ``delivery``
    SCHEDULE = 15  # server -> owners: step the schedulers; payload = the metrics (JSON)
    GATHER = 16  # server -> owners: send rank 0 your state, for request ``delivery``
    RETIRE = 17  # server -> owners: training is over
    # A signal (SIGTERM, SIGINT) stops the run; payload = the reason. Up: this process got it;
    # down: just before STOP, so every learner leaves by the goodbye protocol, then reports it.
    INTERRUPT = 18
    HALT = 19  # learner -> server: its Trainer was asked to stop (e.g. Timer): a STOP for everyone
    # The roll call at an epoch's end (on_learner_failure="continue"). Up: paused at the EPOCH of
    # ``epoch``; down: every learner alive has (the dead removed first), ``dead`` is final.
    PRESENT = 20
    # server -> learner: training goes on after the end of epoch ``epoch``; payload = rank 0's
    # monitored metrics then (JSON), for the inner optimizer's plateau schedulers (local updates)
    METRICS = 21


_RECEIVED_KINDS = frozenset(Kind) - {Kind.FAILED}  # (FAILED is made locally, never sent)


# What the owner on a rank takes from the server's downlink (the rest is for the learner).
OWNER_KINDS = (Kind.APPLY, Kind.SEND, Kind.SCHEDULE, Kind.GATHER, Kind.RETIRE)


class Flag(IntEnum):
    MASKED = 1  # PUSH, PIECE: a presence mask follows the gradients and buffers
    UNUSABLE = 2  # PUSH: no gradient to apply (it overflowed); ``error`` names why
    INTERRUPTED = 4  # ABORT: a signal stopped the run (not a failure)
    SLICED = 8  # PARAMS, EPOCH, STOP: the parameters come as SLICEs from the owners
    OPTIMIZER = 16  # STATE: the payload is optimizer state (torch.save bytes, weights only)
    PER_UPDATE = 32  # SCHEDULE: the metrics for schedulers stepped per update (no epoch ended)


@dataclass
class Envelope:
    """What every conversation's message has: its kind, a payload, what the receiver notes."""

    kind: Kind
    _: KW_ONLY
    payload: Tensor | None = None
    error: str = ""  # FAILED, ABORT, INTERRUPT: what broke, or the signal (travels as the payload)
    received_at: float = 0.0  # ``time.monotonic()`` when the receiving side got it
    # the payload is still in the sender's shared-memory slot: ``lent.use`` it, or ``lent.keep`` it
    lent: LentPayload | None = None
    # a CUDA payload handed to another thread: complete after this event (`engine.streams.mark`)
    ready: torch.cuda.Event | None = None


@dataclass
class Message(Envelope):
    """Learner <-> server: PUSH, BYE, HALT, PRESENT, INTERRUPT, ABORT up; PARAMS, CONTINUE, EPOCH,
    STOP, HEARTBEAT, PRESENT, METRICS, INTERRUPT, ABORT down (FAILED: made locally)."""

    learner: int = 0  # the learner it comes from (uplink) or goes to (downlink)
    version: int = 0  # PUSH: the version the gradient was computed at; downlink: the parameters'
    epoch: int = 0  # downlink: epochs the server has ended so far
    samples: int = 0  # PUSH: the mini-batch size (all its micro-batches)
    cancelled: int = 0  # BYE: computations the learner threw away before pushing them
    flags: int = 0  # a sum of `Flag` values
    dead: int = 0  # downlink: learners dead so far (``on_learner_failure="continue"``)
    seq: int = 0  # PUSH: the learner's push counter (the sharded path pairs its pieces by it)
    delivery: int = 0  # a SLICED downlink message: the delivery its SLICEs belong to
    # Local updates (AdaComm's H decided by the server). PUSH: the H of the round it ends (0: one
    # mini-batch); downlink: the H of the learner's next round (0: its own, fixed ``local_steps``).
    local_steps: int = 0
    inner_steps: int = 0  # downlink: inner steps along the server's trajectory up to ``version``
    loss: float = 0.0  # PUSH: the mini-batch's training loss (NaN when unknown)
    # downlink, for the learner's NTP-style latency estimate (`clocks.MessageLatency`): pushes
    # received from this learner, and seconds from the server receiving the latest to sending this
    pushes: int = 0
    hold: float = 0.0
    age: float = 0.0  # downlink: seconds from the arrival of the push it answers to sending it
    caused_at: float = 0.0  # server side: ``time.monotonic()`` of the arrival ``age`` counts from


@dataclass
class ShardData(Envelope):
    """Between learners and shard owners (the sharded path's mesh): PIECE (learner -> owner),
    SLICE (owner -> learner), STATE (owner -> rank 0); RETIRE ends a mesh connection."""

    learner: int = 0  # PIECE: its learner; SLICE: the learner it goes to; STATE: the owner
    version: int = 0  # SLICE, STATE: the version of the parameters
    seq: int = 0  # PIECE: the learner's push counter
    delivery: int = 0  # SLICE: the delivery it belongs to; STATE: the gather request
    flags: int = 0  # PIECE: MASKED; STATE: OPTIMIZER


@dataclass
class Order(Envelope):
    """The server's orders to the shard owners: APPLY, SEND, SCHEDULE, GATHER, RETIRE."""

    learner: int = 0  # SEND: the learner to send the slice to
    version: int = 0  # APPLY: the version the update makes
    epoch: int = 0  # SCHEDULE: the epochs ended
    delivery: int = 0  # SEND: the delivery; GATHER: the request
    flags: int = 0  # SCHEDULE: PER_UPDATE


# Each kind belongs to one conversation; a header decodes to that conversation's type.
_TYPE_OF = {**dict.fromkeys(Kind, Message), **dict.fromkeys((Kind.PIECE, Kind.SLICE, Kind.STATE), ShardData),
            **dict.fromkeys(OWNER_KINDS, Order)}
_WIRE: dict[type, frozenset[str]] = {cls: frozenset(f.name for f in fields(cls)) for cls in (ShardData, Order)}


def encode_header(message: Envelope, payload: Tensor | None, inline: int) -> bytes:
    """``inline``: where the payload travels (`SEPARATE` ... `ON_CHANNEL`)."""
    numel, dtype = (0, 0) if payload is None else (payload.numel(), _DTYPE_CODES.get(payload.dtype))
    if dtype is None:
        raise ValueError(f"a payload of dtype {payload.dtype if payload is not None else None} cannot "
                         f"travel; the header carries {', '.join(map(str, DTYPES))}")
    if type(message) is Message:  # (the hot path: a push or an answer)
        ints, floats = _ints_of(message), _floats_of(message)
    else:  # the header's fields this conversation lacks are zero
        ints, floats = (tuple(getattr(message, n, 0) for n in names) for names in (_INTS, _FLOATS))
    return _STRUCT.pack(MAGIC, PROTOCOL, int(message.kind), *ints, numel, dtype, int(inline), *floats)


def decode_header(data, sender: str, max_numel: int) -> tuple[Envelope, int, torch.dtype, int]:
    """The message of a header at the start of ``data``, its payload's numel, dtype and route."""
    if len(data) < HEADER_BYTES:
        raise TransportError(f"{sender} sent a frame of {len(data)} bytes, shorter than a header "
                             f"({HEADER_BYTES} bytes)")
    values = _STRUCT.unpack_from(data)
    header = dict(zip(_NAMES, values))
    if header["magic"] != MAGIC:
        raise TransportError(f"{sender} sent a frame that is not a lightning_stale message "
                             f"(magic {header['magic']:#x})")
    if header["protocol"] != PROTOCOL:
        raise TransportError(f"{sender} speaks protocol version {header['protocol']}, this process "
                             f"{PROTOCOL}: run the same lightning_stale version on every node")
    if header["kind"] not in _RECEIVED_KINDS:
        raise TransportError(f"{sender} sent a message of unknown kind {header['kind']}")
    if not 0 <= header["dtype"] < len(DTYPES):
        raise TransportError(f"{sender} sent a payload of unknown dtype code {header['dtype']}")
    if not 0 <= header["numel"] <= max_numel:
        raise TransportError(f"{sender} announced a payload of {header['numel']} values; at most "
                             f"{max_numel} are expected")
    if header["inline"] not in (SEPARATE, INLINE, IN_LANE, ON_CHANNEL) or math.isinf(header["hold"]) \
            or math.isinf(header["age"]):
        raise TransportError(f"{sender} sent a malformed header {header}")
    kind = Kind(header["kind"])
    cls = _TYPE_OF[kind]
    message: Envelope
    if cls is Message:
        message = Message(kind, **dict(zip(_INTS, values[3:_ROUTE])), **dict(zip(_FLOATS, values[_ROUTE + 3:])))
    else:
        message = cls(kind, **{n: v for n, v in zip(_INTS, values[3:_ROUTE]) if n in _WIRE[cls]})
    return message, header["numel"], DTYPES[header["dtype"]], header["inline"]


def text_payload(text: str) -> Tensor:
    """A reason as the payload of an ABORT or an INTERRUPT."""
    return torch.frombuffer(bytearray(text.encode("utf-8", "replace")), dtype=torch.uint8)


def payload_text(payload: Tensor | None) -> str:
    return "" if payload is None else bytes(payload.to(torch.uint8).tolist()).decode("utf-8", "replace")


# Messages that answer a push or refresh a learner: only the newest of a run of them matters.
_TRAINING = (Kind.PARAMS, Kind.CONTINUE)


def coalesce(messages: list[Message | Order]) -> list[Message | Order]:
    """What a sender that fell behind sends instead of ``messages``, to the same effect: a run of
    training messages becomes its newest header with the newest parameters among them;
    heartbeats go when anything else is sent; epoch ends, stops and aborts stay, in order."""
    out: list[Message | Order] = []
    run: list[Message] = []  # (orders are never training messages)

    def close_run() -> None:
        if not run:
            return
        last = run[-1]
        refreshes = [m for m in run if m.kind == Kind.PARAMS]
        if last.kind != Kind.PARAMS and refreshes:  # keep the newest parameters (or their slices)
            newest = refreshes[-1]
            last = replace(last, kind=Kind.PARAMS, payload=newest.payload, version=newest.version,
                           inner_steps=newest.inner_steps, delivery=newest.delivery, flags=newest.flags,
                           ready=newest.ready)
        out.append(last)
        run.clear()

    for m in messages:
        if isinstance(m, Message) and m.kind in _TRAINING:
            run.append(m)
        elif m.kind != Kind.HEARTBEAT:
            close_run()
            out.append(m)
    close_run()
    return out or messages[-1:]
