"""Payloads straight from device to device: a point-to-point group per direction between two
ranks, on the default group's backend (NCCL on GPUs; gloo on the CPU), a large payload following
its header (over gloo) on it. Per direction, not per pair: NCCL runs one communicator's
point-to-point operations in order on one stream, so two ranks sending first would wait for each
other. The groups take the most urgent stream priority, which nothing else uses (docs/how-to/gpus.md).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from lightning_stale.engine import streams


class Channel:
    """One direction between two ranks on ``group`` (this rank holds one end)."""

    def __init__(self, group, src: int, dst: int, device: torch.device) -> None:
        self.group, self.src, self.dst, self.device = group, src, dst, device
        self.stream = streams.side_stream(device, ("channel", src, dst))
        self.carried = 0  # payloads sent or received on it (by this rank)

    def send(self, payload: Tensor, ready: torch.cuda.Event | None) -> None:
        with streams.on(self.stream):  # (the device first: a sending thread starts on GPU 0)
            if ready is not None:
                ready.synchronize()  # complete before it is posted: see the module docstring
            payload = payload.contiguous()
            dist.send(payload, dst=self.dst, group=self.group)
        # The send returns once queued; NCCL reads the payload later, on a stream this one waits
        # for. Made on another stream, its memory would return there when freed: held for this
        # stream, it is not reused before the send has read it.
        streams.hold(payload, self.stream)
        self.carried += 1

    def recv(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, torch.cuda.Event | None]:
        """The next payload, and the event after which it is there (None off CUDA)."""
        with streams.on(self.stream):
            payload = torch.empty(numel, dtype=dtype, device=self.device)
            dist.recv(payload, src=self.src, group=self.group)
            self.carried += 1
            return payload, streams.mark(payload)


def carried(channels: dict[tuple[int, int], Channel]) -> int:
    """Payloads sent or received on ``channels`` so far (by this rank)."""
    return sum(channel.carried for channel in channels.values())


def open_channels(rank: int, pairs: Iterable[tuple[int, int]], backend: str, device: torch.device,
                  timeout: datetime.timedelta, first_numel: int = 1,
                  setup_timeout: datetime.timedelta | None = None) -> dict[tuple[int, int], Channel]:
    """A `Channel` for every direction of ``pairs`` that involves ``rank``, by (sender, receiver), each
    used once (`_first_exchange`, within ``setup_timeout``); collective: every rank creates every group."""
    pairs = list(pairs)
    channels = {}
    for src, dst in pairs:
        group = dist.new_group([src, dst], backend=backend, timeout=timeout, pg_options=_options(backend, timeout))
        if rank in (src, dst):
            channels[(src, dst)] = Channel(group, src, dst, device)
    _first_exchange(rank, pairs, channels, device, first_numel, setup_timeout or default_pg_timeout)
    return channels


def _options(backend: str, timeout: datetime.timedelta):
    """A NCCL group's options: the most urgent stream priority, its timeout (else new_group warns)."""
    if backend != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    options._timeout = timeout
    return options


def close_channels(channels: dict[tuple[int, int], Channel]) -> None:
    """Destroy the groups of ``channels`` at a clean end; after a failure they are left to the
    process's exit: destroying a group under a blocked operation aborts the process."""
    for channel in channels.values():  # (their counts stay: the run's stats read them)
        if channel.group is not None:
            dist.destroy_process_group(channel.group)
            channel.group = None


def _first_exchange(rank: int, pairs: list[tuple[int, int]], channels: dict[tuple[int, int], Channel],
                    device: torch.device, numel: int, limit: datetime.timedelta) -> None:
    """``numel`` values over every channel before training: NCCL creates a communicator at its first
    operation, allocating device memory, which can wait for running kernels; in an engine thread beside
    a training collective that waits for the very peer being set up, neither could finish."""
    for src, dst in pairs:
        channel = channels.get((src, dst))
        if channel is None:
            continue
        with streams.on(channel.stream):
            value = torch.ones(numel, device=device)
            if rank == src:
                work = dist.isend(value, dst=dst, group=channel.group)
            else:
                work = dist.irecv(value, src=src, group=channel.group)
            # Bounded by the strategy's timeout (a peer dead in set-up; the groups' own is long),
            # on NCCL by waiting on the host, which an explicit timeout asks for.
            if work is None or not work.wait(limit):
                raise TimeoutError(f"rank {rank}: the device channel {src} -> {dst} was not set up "
                                   f"within {limit}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
