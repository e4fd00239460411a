"""CUDA streams of the engine's own threads, and the hand-offs between them and the training thread.

Why: on a GPU every thread of a process uses the device's default stream unless it picks
another, and a collective of the default group (NCCL) makes that stream wait, on the GPU, until
every rank has joined it. The server thread and the shard owners run beside the training thread.
Were they to copy parameters to the host on the default stream, such a copy would queue behind a
collective the training thread has just entered (``self.log(..., sync_dist=True)``, validation's
reductions, the epoch's stop vote), and the other ranks, waiting for the very parameters that
copy carries, would never join it: a deadlock across ranks. On a stream of their own the
engine's threads depend on the training thread only through events recorded when a tensor
changes hands (the CUDA semantics of streams and events, and of ``Tensor.record_stream`` for the
caching allocator, are PyTorch's, docs "CUDA semantics", section "CUDA streams").

On the CPU every function here does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new stream on ``device`` that starts after the work queued so far on the current one
    (the state the engine copied from the module there), or None off CUDA."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


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
    """`on`, and when it ends, wait (on the host) for the work queued there, so that whatever the
    thread leaves behind is complete for any thread that reads it later."""
    try:
        with on(stream):
            yield
    finally:
        if stream is not None:
            stream.synchronize()


def mark(tensor: Tensor | None) -> torch.cuda.Event | None:
    """An event after the work queued so far on the current stream of ``tensor``'s device, for a
    CUDA tensor that another thread will use next (its ``Message.ready``)."""
    if tensor is None or not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def receive(tensor: Tensor | None, ready: torch.cuda.Event | None) -> None:
    """Make ``tensor``, handed over by another thread with ``ready`` (`mark`), safe to use on the
    current stream: the stream waits for it, and the caching allocator will not give its memory
    to the other stream's next tensor before this stream is done with it."""
    if ready is None or tensor is None or not tensor.is_cuda:
        return
    stream = torch.cuda.current_stream(tensor.device)
    stream.wait_event(ready)
    tensor.record_stream(stream)


def hold(tensor: Tensor, stream: torch.cuda.Stream | None) -> None:
    """Keep ``tensor``'s memory from the caching allocator until the work queued so far on
    ``stream`` is done, for a tensor made on another stream and last used on ``stream`` (or by
    work ``stream`` waits for): freed earlier, it could go to its own stream's next tensor while
    still being read."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def to_host(tensor: Tensor, ready: torch.cuda.Event | None) -> Tensor:
    """``tensor`` (on the device, complete after ``ready``) in host memory: the copy waits on
    the host for ``ready`` and runs on a stream of its own, never behind another stream's work."""
    if not tensor.is_cuda:
        return tensor
    if ready is not None:
        ready.synchronize()
    stream = _copy_streams.get(tensor.device) or _copy_streams.setdefault(tensor.device,
                                                                          torch.cuda.Stream(tensor.device))
    with on(stream):
        return tensor.cpu()


@contextlib.contextmanager
def reading(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Read state that an engine thread working on ``stream`` changes, from another thread that
    holds that thread still (its lock): the reads run on a stream of their own that starts after
    ``stream``'s work so far (not on the caller's, which may wait for a collective), and are
    complete when this ends, before the engine thread changes the state again."""
    reader = None
    if stream is not None:
        reader = torch.cuda.Stream(stream.device)
        reader.wait_stream(stream)
    with running_on(reader):
        yield
