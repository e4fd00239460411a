"""Large payloads between the server and a learner on its host, through shared memory: a file in
``/dev/shm`` mapped by both (unlinked once mapped); the sender copies a payload into a free slot
and sends only the header over gloo, sparing loopback TCP's copies (docs/benchmarks/path_breakdown.md).
A lane has one writer, one reader and `SLOTS` slots in turn: slot n % SLOTS is free once message
n - SLOTS was read, copied out or used in place (`LentPayload`)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_stale.engine.distributed.messages import INLINE_PAYLOAD_BYTES, TransportError

log = logging.getLogger(__name__)

SLOTS = 2
_CONTROL = 64  # bytes before the slots: token, messages written, messages read (int64)
_TOKEN, _WRITTEN, _READ = 0, 1, 2
SHM_DIR = "/dev/shm"
_OFFER_BYTES = 8 + 512  # a learner's token and its file's path, for rank 0


class LaneClosed(TransportError):
    """The other side went away while a writer waited for a free slot."""


class Lane:
    """One direction between two processes: `SLOTS` slots of ``slot_bytes`` bytes each."""

    def __init__(self, storage: Tensor, slot_bytes: int) -> None:
        self.control = storage[:_CONTROL].view(torch.int64)
        self.slot_bytes = slot_bytes
        self._slots = [storage[_CONTROL + i * slot_bytes:_CONTROL + (i + 1) * slot_bytes]
                       for i in range(SLOTS)]
        # this side's counts: payloads written; taken and freed (apart while one is lent)
        self._written = self._taken = self._read = 0
        self._lent: LentPayload | None = None  # the payload `lend` gave out last

    def carries(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` travels here: too large for its frame, not for a slot."""
        return INLINE_PAYLOAD_BYTES < nbytes <= self.slot_bytes

    def reserve(self, nbytes: int, closed: Callable[[], str | None]) -> Tensor:
        """The next slot's first ``nbytes``, once the reader no longer holds it, to fill in place and
        pass to `write`, which then copies nothing (until then it stays the next slot)."""
        self._wait_free(closed)
        return self._slots[self._written % SLOTS][:nbytes]

    def reserve_now(self, nbytes: int) -> Tensor | None:
        """`reserve` without the wait: None while the reader holds the slot."""
        return self._slots[self._written % SLOTS][:nbytes] if self._next_free() else None

    def write(self, payload: Tensor, closed: Callable[[], str | None]) -> None:
        """Copy ``payload`` into the next slot (unless filled there in place), waiting while the
        reader holds it (``closed`` says why to give up: the peer is gone); then the reader may take it."""
        n = self._written
        slot = self._slots[n % SLOTS]
        if payload.data_ptr() != slot.data_ptr():
            self._wait_free(closed)
            slot[:payload.numel() * payload.element_size()].view(payload.dtype).copy_(payload)
        self._written = n + 1
        self.control[_WRITTEN] = n + 1

    def _next_free(self) -> bool:
        """Whether the reader has read what the next slot held (message written - SLOTS)."""
        return int(self.control[_READ]) >= self._written - SLOTS + 1

    def _wait_free(self, closed: Callable[[], str | None]) -> None:
        while not self._next_free():
            reason = closed()
            if reason:
                raise LaneClosed(reason)
            time.sleep(0.0002)

    def read(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The next payload written, copied out; its slot is free again."""
        held = self._take(numel, dtype)
        out = torch.empty(numel, dtype=dtype)
        out.copy_(held)
        self.give_back()
        return out

    def lend(self, message, numel: int, dtype: torch.dtype) -> None:
        """``message.payload``: the next payload in its slot; ``message.lent`` frees the slot."""
        message.payload = self._take(numel, dtype)
        message.lent = self._lent = LentPayload(self, message)

    def _take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if self._lent is not None:  # still unused: copied out, so that its slot is free
            self._lent.keep()
            self._lent = None
        n = self._taken
        if n >= int(self.control[_WRITTEN]) or numel * dtype.itemsize > self.slot_bytes:
            raise RuntimeError(f"a header announced payload {n} of {numel} values in shared memory, "
                               f"which holds {int(self.control[_WRITTEN])} payloads of at most "
                               f"{self.slot_bytes} bytes")
        self._taken = n + 1
        return self._slots[n % SLOTS][:numel * dtype.itemsize].view(dtype)

    def give_back(self) -> None:
        """The payload taken last is no longer used: its slot is free for the writer."""
        if self._read == self._taken:
            raise RuntimeError("a lane's slot was given back twice")
        self._read += 1
        self.control[_READ] = self._read


class LentPayload:
    """A message's payload borrowed in place from a lane's slot (`Lane.lend`)."""

    def __init__(self, lane: Lane, message) -> None:
        self._lane, self._message = lane, message
        self._lock = threading.Lock()
        self.settled = False  # used, or copied out: the slot was given back

    def use(self, consume: Callable[[Tensor], None]) -> None:
        """``consume(payload)``, then the slot is free (a payload kept before: its copy)."""
        with self._lock:
            consume(self._message.payload)
            self._settle()

    def keep(self) -> None:
        """Copy the payload out of the slot (unless it was used or kept already), freeing it."""
        with self._lock:
            if not self.settled:
                self._message.payload = self._message.payload.clone()
                self._settle()

    def release(self) -> None:
        """The payload will not be used (parameters held already): the slot is free, the message empty."""
        with self._lock:
            if not self.settled:
                self._message.payload = None
                self._settle()

    def _settle(self) -> None:
        if not self.settled:
            self.settled = True
            self._lane.give_back()


def lane_bytes(slot_bytes: int) -> int:
    return _CONTROL + SLOTS * slot_bytes


def slot_bytes_for(numel: int, dtype: torch.dtype) -> int:
    """A slot that holds ``numel`` values of ``dtype``, rounded up to 64 bytes."""
    return -(-numel * dtype.itemsize // 64) * 64


class LaneFile:
    """One learner's two lanes (up, down) in one file: the learner `create`s, the server `open`s."""

    def __init__(self, path: str, storage: Tensor, slot_bytes: int) -> None:
        self.path, self.storage, self.slot_bytes = path, storage, slot_bytes
        size = lane_bytes(slot_bytes)
        self.up, self.down = (Lane(storage[i * size:(i + 1) * size], slot_bytes) for i in range(2))

    @classmethod
    def create(cls, directory: str, slot_bytes: int) -> tuple[LaneFile, int]:
        """A new file in ``directory`` and its token. Raises OSError where it cannot be made."""
        token = secrets.randbits(62) + 1
        path = os.path.join(directory, f"lightning_stale-{os.getpid()}-{secrets.token_hex(6)}")
        size = 2 * lane_bytes(slot_bytes)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # space now, or OSError: never a SIGBUS later
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        lanes = cls(path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8), slot_bytes)
        lanes.up.control[_TOKEN] = lanes.down.control[_TOKEN] = token
        return lanes, token

    @classmethod
    def open(cls, path: str, token: int, slot_bytes: int) -> LaneFile | None:
        """The learner's file, if this process sees it with ``token`` (the same host), else None."""
        size = 2 * lane_bytes(slot_bytes)
        try:
            if os.path.getsize(path) != size:
                return None
            lanes = cls(path, torch.from_file(path, shared=True, size=size, dtype=torch.uint8), slot_bytes)
        except (OSError, RuntimeError):
            return None
        ok = int(lanes.up.control[_TOKEN]) == token == int(lanes.down.control[_TOKEN])
        return lanes if ok else None

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def open_lanes(group, rank: int, slot_bytes: int, enabled: bool = True,
               directory: str = SHM_DIR, all_or_none: bool = False) -> dict[int, tuple[Lane, Lane]]:
    """The lanes between rank 0 and every remote learner on its host (collective over ``group``)."""
    made, token = None, 0
    if rank != 0 and enabled:
        try:
            made, token = LaneFile.create(directory, slot_bytes)
        except OSError as exc:
            log.info("learner %d: no shared memory with the server (%s); payloads go over gloo",
                     rank, exc)
    # (tensors, not pickled objects: nothing a peer sends is unpickled)
    offer = torch.zeros(_OFFER_BYTES, dtype=torch.uint8)
    if made is not None and len(made.path.encode()) > _OFFER_BYTES - 8:
        made.unlink()  # a path this long cannot be offered (a test's directory): gloo
        made = None
    if made is not None:
        name = made.path.encode()
        offer[:8] = torch.frombuffer(bytearray(token.to_bytes(8, "little")), dtype=torch.uint8)
        offer[8:8 + len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    offers = [torch.zeros_like(offer) for _ in range(dist.get_world_size(group))]
    dist.all_gather(offers, offer, group=group)
    mapped: dict[int, LaneFile] = {}
    if rank == 0:
        for peer, data in enumerate(offers):
            raw = bytes(data.tolist())
            peer_token, path = int.from_bytes(raw[:8], "little"), raw[8:].rstrip(b"\0").decode(errors="replace")
            found = LaneFile.open(path, peer_token, slot_bytes) if peer_token else None
            if found is not None:
                mapped[peer] = found
    has = torch.tensor([peer in mapped for peer in range(len(offers))], dtype=torch.uint8)
    dist.broadcast(has, src=0, group=group)
    if made is not None:
        made.unlink()  # rank 0 has mapped it, or never will
    if all_or_none and not bool(has[1:].all()):
        return {}  # (the mappings go with their tensors)
    if rank == 0:
        return {peer: (f.down, f.up) for peer, f in mapped.items()}
    return {0: (made.up, made.down)} if made is not None and has[rank] else {}
