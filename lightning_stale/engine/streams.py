"""CUDA streams of the engine's own threads, and their hand-offs with the training thread. On the
default stream an engine thread's copy would queue behind a collective the training thread
entered, while the other ranks wait for that copy: a deadlock across ranks. So engine threads use
streams of their own, from a priority level no NCCL group uses, and hand tensors over with events
(PyTorch docs, "CUDA semantics", "CUDA streams"; c10/cuda/CUDAStream.cpp). The CPU is untouched."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

import torch
from torch import Tensor

STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp, kStreamsPerPool
# NCCL's groups use the default level (0) or the most urgent (-(levels - 1)); PyTorch keeps up
# to 4 (c10's max_compile_time_stream_priorities), devices since Turing offer 6 (0 to -5).
ENGINE_PRIORITY = -1
# The engine's roles of one stream per process (each device channel is one too).
SERVER, OWNER, COPIES, READERS = "server", "owner", "copies", "readers"
_FIXED_ROLES = (SERVER, OWNER, COPIES, READERS)
_engine_streams: dict[tuple[torch.device, Hashable], torch.cuda.Stream] = {}
_engine_lock = threading.Lock()


def engine_stream(device: torch.device, role: Hashable) -> torch.cuda.Stream | None:
    """The engine's stream for ``role`` on ``device``, the same one every time, or None off CUDA."""
    if device.type != "cuda":
        return None
    with _engine_lock:
        stream = _engine_streams.get((device, role))
        if stream is None:
            stream = _engine_streams[(device, role)] = torch.cuda.Stream(device, priority=ENGINE_PRIORITY)
    return stream


def side_stream(device: torch.device, role: Hashable) -> torch.cuda.Stream | None:
    """`engine_stream` for ``role``, after the work queued so far on the current stream."""
    stream = engine_stream(device, role)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def engine_streams_needed(channels: int) -> int:
    """The most streams one process holds at the engine's level: the fixed roles', one per channel."""
    return len(_FIXED_ROLES) + channels


def separate_levels(device: torch.device) -> bool:
    """Whether ``device`` offers three stream priority levels, keeping the engine's streams apart
    from both kinds of NCCL group (ROCm offers two)."""
    if device.type != "cuda":
        return True
    with torch.cuda.device(device):
        least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a static method the stubs declare as one of the instance
    return least - greatest + 1 >= 3


@contextlib.contextmanager
def on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Queue the calling thread's work on ``stream`` for a while (nothing off CUDA)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):  # (a new thread is on GPU 0)
        yield


@contextlib.contextmanager
def running_on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """`on`, then wait on the host for the work queued there: complete for any later reader."""
    try:
        with on(stream):
            yield
    finally:
        if stream is not None:
            stream.synchronize()


def mark(tensor: Tensor | None) -> torch.cuda.Event | None:
    """An event after the current stream's work, for a CUDA tensor another thread uses next."""
    if tensor is None or not tensor.is_cuda:
        return None
    with torch.cuda.device(tensor.device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
    return event


def receive(tensor: Tensor | None, ready: torch.cuda.Event | None) -> None:
    """Make ``tensor``, handed over with ``ready`` (`mark`), safe on the current stream: it waits
    for it, and the allocator keeps its memory from the other stream until this one is done."""
    if ready is None or tensor is None or not tensor.is_cuda:
        return
    with torch.cuda.device(tensor.device):
        stream = torch.cuda.current_stream(tensor.device)
        stream.wait_event(ready)
        tensor.record_stream(stream)


def hold(tensor: Tensor, stream: torch.cuda.Stream | None) -> None:
    """Keep the memory of ``tensor`` (made on another stream, last used on ``stream``) from the
    allocator until ``stream``'s work so far is done: freed earlier, it could be reused while read."""
    if stream is not None and tensor.is_cuda:
        with torch.cuda.device(tensor.device):
            tensor.record_stream(stream)


def to_host(tensor: Tensor, ready: torch.cuda.Event | None) -> Tensor:
    """``tensor`` in host memory, copied after ``ready`` on a stream of its own, behind nothing."""
    if not tensor.is_cuda:
        return tensor
    with on(engine_stream(tensor.device, COPIES)):
        if ready is not None:
            ready.synchronize()
        return tensor.cpu()


@contextlib.contextmanager
def reading(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Read state an engine thread on ``stream`` changes, from a thread holding it still: on a
    stream of their own after ``stream``'s work (not the caller's, which may wait for a
    collective), complete when this ends."""
    reader = engine_stream(stream.device, READERS) if stream is not None else None
    with running_on(reader):
        if reader is not None and stream is not None:
            reader.wait_stream(stream)
        yield
