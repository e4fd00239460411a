"""Messages between learners and the parameter server, and their wire header.

A message is a fixed-size header of named fields (`HEADER`, packed with `struct`, starting with a
magic number and the protocol version, checked by `decode_header`) and an optional flat tensor
payload. Nothing received is ever unpickled or executed.
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # (lanes imports this module)
    from lightning_stale.engine.distributed.lanes import LentPayload

MAGIC = 0x5354414C45  # "STALE"
PROTOCOL = 5
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8)

# (field, struct format), in wire order; little-endian, no padding.
HEADER = (
    ("magic", "q"), ("protocol", "q"), ("kind", "q"), ("learner", "q"), ("version", "q"),
    ("epoch", "q"), ("samples", "q"), ("cancelled", "q"), ("pushes", "q"), ("flags", "q"),
    ("dead", "q"), ("seq", "q"), ("delivery", "q"),
    ("numel", "q"), ("dtype", "q"), ("inline", "q"),
    ("loss", "d"), ("hold", "d"), ("age", "d"),
)
_STRUCT = struct.Struct("<" + "".join(fmt for _, fmt in HEADER))
# The header's fields read from and written to a message as they are (the others are computed);
# packed and unpacked in one call each: a header goes both ways on every push and answer.
_NAMES = tuple(name for name, _ in HEADER)
assert _NAMES[:3] == ("magic", "protocol", "kind") and _NAMES[13:16] == ("numel", "dtype", "inline")
_INTS, _FLOATS = _NAMES[3:13], _NAMES[16:]
_ints_of, _floats_of = operator.attrgetter(*_INTS), operator.attrgetter(*_FLOATS)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
# Payloads up to this size travel inside the header's frame: one gloo message per message
# instead of two, which halves the latency of a push or an answer for the models where latency,
# not bandwidth, dominates (the digits MLP is 19 KB). Larger payloads follow their header as a
# second message, so that they are not copied into a frame, or wait in shared memory.
INLINE_PAYLOAD_BYTES = 256 * 1024
# The header's ``inline``: where its payload travels (`transport.encode`).
# a second gloo message, the same frame, shared memory, a channel (`channels`: device to device)
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
    # The sharded path (engine.distributed.paths.sharded): data between learners and shard owners,
    # and the server's orders to the owners.
    PIECE = 10  # learner -> owner: its part of push ``seq`` (gradients, buffers, presence)
    SLICE = 11  # owner -> learner: its part of the parameters of ``version``, for ``delivery``
    STATE = 12  # owner -> rank 0: its parameters and (flag OPTIMIZER) optimizer state, gathered
    APPLY = 13  # server -> owners: apply an update; payload = (learner, seq, weight) triples
    SEND = 14  # server -> owners: send ``learner`` your slice, for ``delivery``
    SCHEDULE = 15  # server -> owners: step the schedulers; payload = the metrics (JSON)
    GATHER = 16  # server -> owners: send rank 0 your state, for request ``delivery``
    RETIRE = 17  # server -> owners: training is over
    # either way: a signal (SIGTERM, SIGINT) asks to stop the run; payload = the reason (utf-8).
    # Learner -> server: this process got it; server -> learner: sent just before STOP, so that
    # every learner leaves through the goodbye protocol and then reports the interruption.
    INTERRUPT = 18
    # learner -> server: its Trainer was asked to stop mid-epoch (a callback such as Timer for
    # max_time): training stops for everyone, each learner on the server's STOP.
    HALT = 19
    # Under on_learner_failure="continue", the roll call at an epoch's end. Learner -> server: it
    # heard the EPOCH of ``epoch`` and paused; server -> learner: every learner still alive has
    # (one that died before it is removed first), ``dead`` is final for the epoch's collectives.
    PRESENT = 20


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
class Message:
    """One message. Wire fields are those of `HEADER` (plus the payload); the rest is local.

    Attributes:
        kind: what the message is (`Kind`).
        learner: the learner it comes from (uplink) or goes to (downlink).
        version: PUSH: the version the gradient was computed at; downlink: the parameters'.
        epoch: downlink: epochs the server has ended so far.
        samples: PUSH: the mini-batch size (all its micro-batches).
        cancelled: BYE: computations the learner threw away before pushing them.
        flags: a sum of `Flag` values.
        dead: downlink: how many learners have died so far (``on_learner_failure="continue"``).
        seq: PUSH, PIECE: the learner's push counter (the sharded path pairs them by it).
        delivery: a sliced downlink message and its SLICEs, paired by this number; GATHER and
            STATE likewise.
        loss: PUSH: the mini-batch's training loss (NaN when unknown).
        pushes, hold: downlink, for the learner's estimate of its message latency (NTP-style,
            one clock per side): pushes received from this learner so far, and the seconds from
            the server receiving the latest of them to sending this message.
        age: downlink: seconds from the arrival of the push this message answers (the paper's
            instant of the update or cancellation) to sending it: the server's own time.
        payload: a flat tensor, or None.
        error: FAILED, ABORT, INTERRUPT: what broke or which signal stopped the run (travels
            as the payload); PUSH with UNUSABLE: the drop reason.
        caused_at: server side: ``time.monotonic()`` of the arrival ``age`` counts from.
        received_at: ``time.monotonic()`` when the receiving side got it.
        lent: the payload is still in the sender's shared-memory slot (`lanes.LentPayload`):
            read it through ``lent.use``, or ``lent.keep`` it first; None: the payload is owned.
        ready: a CUDA payload handed to another thread of this process: the event after which
            it is complete (`engine.streams.mark`; the receiver calls `engine.streams.receive`).
    """

    kind: Kind
    learner: int = 0
    version: int = 0
    epoch: int = 0
    samples: int = 0
    cancelled: int = 0
    flags: int = 0
    dead: int = 0
    seq: int = 0
    delivery: int = 0
    loss: float = 0.0
    pushes: int = 0
    hold: float = 0.0
    age: float = 0.0
    payload: Tensor | None = None
    error: str = ""
    caused_at: float = 0.0
    received_at: float = 0.0
    lent: LentPayload | None = None
    ready: torch.cuda.Event | None = None


def encode_header(message: Message, payload: Tensor | None, inline: int) -> bytes:
    """``inline``: where the payload travels (`SEPARATE`, `INLINE`, `IN_LANE` or `ON_CHANNEL`)."""
    numel, dtype = (0, 0) if payload is None else (payload.numel(), _DTYPE_CODES.get(payload.dtype))
    if dtype is None:
        raise ValueError(f"a payload of dtype {payload.dtype if payload is not None else None} cannot "
                         f"travel; the header carries {', '.join(map(str, DTYPES))}")
    return _STRUCT.pack(MAGIC, PROTOCOL, int(message.kind), *_ints_of(message), numel, dtype, int(inline),
                        *_floats_of(message))


def decode_header(data, sender: str, max_numel: int) -> tuple[Message, int, torch.dtype, int]:
    """The message of a header at the start of ``data`` (bytes, or any buffer: a receive buffer is read in place), its
    payload's size and dtype, and where the payload travels (`SEPARATE`, `INLINE`, `IN_LANE` or `ON_CHANNEL`)."""
    if len(data) < HEADER_BYTES:
        raise TransportError(f"{sender} sent a frame of {len(data)} bytes, shorter than a header "
                             f"({HEADER_BYTES} bytes)")
    values = _STRUCT.unpack_from(data)
    fields = dict(zip(_NAMES, values))
    if fields["magic"] != MAGIC:
        raise TransportError(f"{sender} sent a frame that is not a lightning_stale message "
                             f"(magic {fields['magic']:#x})")
    if fields["protocol"] != PROTOCOL:
        raise TransportError(f"{sender} speaks protocol version {fields['protocol']}, this process "
                             f"{PROTOCOL}: run the same lightning_stale version on every node")
    if fields["kind"] not in _RECEIVED_KINDS:
        raise TransportError(f"{sender} sent a message of unknown kind {fields['kind']}")
    if not 0 <= fields["dtype"] < len(DTYPES):
        raise TransportError(f"{sender} sent a payload of unknown dtype code {fields['dtype']}")
    if not 0 <= fields["numel"] <= max_numel:
        raise TransportError(f"{sender} announced a payload of {fields['numel']} values; at most "
                             f"{max_numel} are expected")
    if fields["inline"] not in (SEPARATE, INLINE, IN_LANE, ON_CHANNEL) or math.isinf(fields["hold"]) \
            or math.isinf(fields["age"]):
        raise TransportError(f"{sender} sent a malformed header {fields}")
    message = Message(Kind(fields["kind"]), **dict(zip(_INTS, values[3:13])), **dict(zip(_FLOATS, values[16:])))
    return message, fields["numel"], DTYPES[fields["dtype"]], fields["inline"]


def text_payload(text: str) -> Tensor:
    """A reason as the payload of an ABORT or an INTERRUPT."""
    return torch.frombuffer(bytearray(text.encode("utf-8", "replace")), dtype=torch.uint8)


def payload_text(payload: Tensor | None) -> str:
    return "" if payload is None else bytes(payload.to(torch.uint8).tolist()).decode("utf-8", "replace")


# Messages that answer a push or refresh a learner: only the newest of a run of them matters.
_TRAINING = (Kind.PARAMS, Kind.CONTINUE)


def coalesce(messages: list[Message]) -> list[Message]:
    """What a sender that fell behind sends instead of ``messages``, with the same effect on the learner: a run of
    training messages becomes its newest header, with the newest parameters if any of them carried parameters;
    heartbeats go when anything else is sent; epoch ends, stops and aborts are kept, in order."""
    out: list[Message] = []
    run: list[Message] = []

    def close_run() -> None:
        if not run:
            return
        last = run[-1]
        refreshes = [m for m in run if m.kind == Kind.PARAMS]
        if last.kind != Kind.PARAMS and refreshes:  # keep the newest parameters (or their slices)
            newest = refreshes[-1]
            last = replace(last, kind=Kind.PARAMS, payload=newest.payload, version=newest.version,
                           delivery=newest.delivery, flags=newest.flags, ready=newest.ready)
        out.append(last)
        run.clear()

    for m in messages:
        if m.kind in _TRAINING:
            run.append(m)
        elif m.kind != Kind.HEARTBEAT:
            close_run()
            out.append(m)
    close_run()
    return out or messages[-1:]
