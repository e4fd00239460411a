"""The server paths by name, and the one place that decides which runs (``server=`` of
`StaleStrategy`; docs/concepts/paths.md describes each path, docs/benchmarks/scaling.md holds the
measurements behind the thresholds of ``"auto"``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.lanes import open_lanes, slot_bytes_for
from lightning_stale.engine.distributed.messages import INLINE_PAYLOAD_BYTES
from lightning_stale.engine.distributed.paths.base import ServerPath
from lightning_stale.engine.distributed.paths.central.path import CentralPath
from lightning_stale.engine.distributed.paths.collective.local import CollectiveLocalExchange
from lightning_stale.engine.distributed.paths.collective.path import CollectivePath
from lightning_stale.engine.distributed.paths.sharded.path import ShardedPath
from lightning_stale.engine.state import ModelVectors
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant

CENTRAL, COLLECTIVE, SHARDED = CentralPath(), CollectivePath(CollectiveLocalExchange), ShardedPath()
PATHS: dict[str, ServerPath] = {path.name: path for path in (CENTRAL, COLLECTIVE, SHARDED)}
SERVER_PATHS = ("auto", *PATHS)

# Below this many values a round trip through rank 0 costs less than spreading the traffic.
SCALE_MIN_NUMEL = 1 << 18
# CPU learners on one host sharing memory: the sync family stays central below this, where rank
# 0's round trips through shared memory beat P optimizer steps;
ONE_HOST_COLLECTIVE_MIN_NUMEL = 1 << 21
# below this where the learners outnumber the cores (P optimizer steps compete for them).
CROWDED_HOST_COLLECTIVE_MIN_NUMEL = 1 << 23
# The async family stays central until N x (P - 1), half of central's values at rank 0 per P
# gradients, reaches this (below it the central server kept up with the sharded one),
SHARDED_MIN_TRAFFIC = 1 << 24
ONE_HOST_SHARDED_MIN_P = 8  # and, on one host, below this many learners.
# The most processes whose NCCL channels keep their streams apart (up to 2(P - 1) per process).
MAX_CHANNEL_WORLD = next(p for p in range(64, 1, -1)
                         if streams.engine_streams_needed(2 * (p - 1)) <= streams.STREAMS_PER_POOL)


def path_named(name: str) -> ServerPath:
    """The path called ``name``; an unknown name is refused, naming the known ones."""
    if name not in PATHS:
        raise ValueError(f"unknown server path {name!r}; choose one of {', '.join(SERVER_PATHS)}")
    return PATHS[name]


def path_problem(path: str, variant_name: str, on_learner_failure: str,
                 compensation: StalenessCompensation | None, clips: bool = False) -> str | None:
    """Why ``path`` cannot run these options, or None (``"auto"`` always can)."""
    if path == "auto":
        return None
    return path_named(path).problem(variant_name, on_learner_failure, compensation, clips)


def check_path(path: str, variant_name: str, on_learner_failure: str,
               compensation: StalenessCompensation | None, clips: bool = False) -> None:
    """Refuse an unknown path, or one that cannot run these options (`path_problem`)."""
    problem = path_problem(path, variant_name, on_learner_failure, compensation, clips)
    if problem:
        raise ValueError(problem)


def channel_pairs(path: str, p: int) -> list[tuple[int, int]]:
    """The (sender, receiver) directions ``path``'s payloads take."""
    return path_named(path).channel_pairs(p)


def central_if_memory_is_shared(variant: Variant, numel: int, nodes: int, cpu_cores: int | None) -> bool:
    """Whether ``"auto"`` runs this model central where every remote learner shares memory."""
    if not variant.synchronous or nodes != 1 or cpu_cores is None or variant.p == 1:
        return False
    limit = CROWDED_HOST_COLLECTIVE_MIN_NUMEL if variant.p > cpu_cores else ONE_HOST_COLLECTIVE_MIN_NUMEL
    return SCALE_MIN_NUMEL <= numel < limit


def choose_path(path: str, variant: Variant, numel: int, on_learner_failure: str,
                compensation: StalenessCompensation | None, clips: bool = False, nodes: int = 1,
                cpu_cores: int | None = None, memory_shared: bool = False) -> str:
    """The path to run (``"auto"``: collective for the sync family, sharded for the async one,
    where the thresholds above say, else central; ``nodes``: the learners' hosts); a refusal names
    what to use instead."""
    if path != "auto":
        check_path(path, variant.name, on_learner_failure, compensation, clips)
        return path
    if variant.p == 1 or numel < SCALE_MIN_NUMEL:
        return CENTRAL.name
    if memory_shared and central_if_memory_is_shared(variant, numel, nodes, cpu_cores):
        return CENTRAL.name
    if not variant.synchronous and CENTRAL.traffic(numel, variant.p, variant.p) < 2 * SHARDED_MIN_TRAFFIC:
        return CENTRAL.name
    if not variant.synchronous and nodes == 1 and variant.p < ONE_HOST_SHARDED_MIN_P:
        return CENTRAL.name
    scaled = COLLECTIVE if variant.synchronous else SHARDED
    ok = scaled.problem(variant.name, on_learner_failure, compensation, clips) is None
    return scaled.name if ok else CENTRAL.name


def settle_path(path: str, variant: Variant, module: nn.Module, group, rank: int, on_learner_failure: str,
                compensation: StalenessCompensation | None, clips: bool = False, nodes: int = 1,
                shared_memory: bool = True, cpu: bool = True) -> tuple[str, dict | None]:
    """`choose_path`, the same on every rank, and the lanes opened to decide it (collective)."""
    vectors = ModelVectors.of(module)
    cores = (os.cpu_count() or 1) if cpu else None  # the host's: the same on every rank of it
    lanes = None
    if path == "auto" and shared_memory and central_if_memory_is_shared(variant, vectors.numel, nodes, cores):
        lanes = open_lanes(group, rank, slot_bytes_for(vectors.max_push_numel(), vectors.dtype), all_or_none=True)
    chosen = choose_path(path, variant, vectors.numel, on_learner_failure, compensation, clips, nodes, cores,
                         memory_shared=bool(lanes))
    return chosen, (lanes or None) if PATHS[chosen].payloads_through_server else None


def channel_backend(wanted: bool, path: str, world: int, default_backend: str | None,
                    device: torch.device, on_learner_failure: str, push_bytes: int,
                    separate_levels: bool = True) -> str | None:
    """The backend of the device channels (`channels`) for `StaleStrategy`'s ``payload_channels``, or None for none."""
    if not wanted or world < 2 or not channel_pairs(path, world) or push_bytes <= INLINE_PAYLOAD_BYTES:
        return None
    if default_backend == "nccl":
        problem = (f"{world} processes hold up to {2 * (world - 1)} channels each, more streams than a "
                   f"pool of {streams.STREAMS_PER_POOL} keeps apart (at most {MAX_CHANNEL_WORLD} processes)"
                   if world > MAX_CHANNEL_WORLD else
                   None if separate_levels else "a device offers fewer than three stream priority levels")
        if problem is not None:
            raise ValueError(f"payload_channels=True: {problem}; pass payload_channels=False (the "
                             "default), and payloads go through host memory")
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"payload_channels=True needs NCCL for payloads on {device.type} devices, but "
                     f"the default process group runs on {default_backend!r}: use "
                     "process_group_backend='nccl', or pass payload_channels=False (the default)")


def settle_channels(wanted: bool, path: str, world: int, default_backend: str | None, device: torch.device,
                    on_learner_failure: str, push_bytes: int, group) -> str | None:
    """`channel_backend`, where NCCL channels would open with every rank's `streams.separate_levels`
    (collective over ``group``): the ranks decide alike, as every rank creates the channels' groups."""
    backend = channel_backend(wanted, path, world, default_backend, device, on_learner_failure, push_bytes)
    if backend == "nccl":
        flag = torch.tensor([int(streams.separate_levels(device))])
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        backend = channel_backend(wanted, path, world, default_backend, device, on_learner_failure, push_bytes,
                                  separate_levels=bool(flag.item()))
    return backend


def overlap_wanted(setting: bool | None, default_backend: str | None) -> bool:
    """``overlap_allreduce``: None overlaps on gloo, not on NCCL, where the overlap's own communicator
    beside the default one has not run on several GPUs yet (what never ran is no default)."""
    return default_backend != "nccl" if setting is None else setting


def overlap_allreduce(setting: bool | None, default_backend: str | None, path: str, variant: Variant,
                      adaptive: AdaptiveK | None, plain_steps: bool) -> bool:
    """Whether the learners reduce during backward: wanted, on a path that can, with ``plain_steps``
    (one backward per push, no scaler, automatic optimization: a round's gradient is the one pushed)."""
    return (overlap_wanted(setting, default_backend) and plain_steps
            and path_named(path).overlaps(variant, adaptive))
