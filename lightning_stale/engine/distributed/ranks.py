"""The engine on one rank: its learner, and on global rank 0 the server, for the chosen path.

Paths (``server=`` of `StaleStrategy`; the README's "Scaling" section models their traffic):

* ``"central"``: the server on rank 0 holds the parameters; every push carries a gradient to it
  and every answer parameters back. Fewest hops: the fastest for small models, and the only path
  on which no learner ever waits for another (any variant, a frozen or dead learner).
* ``"collective"`` (sync family): the server decides from headers; the gradients of an update
  meet in one all-reduce and every learner applies it (`engine.distributed.collective`); where
  every update takes one gradient from every learner, the all-reduce runs during backward
  (`engine.distributed.overlap`).
* ``"sharded"``: the server decides from headers; every rank owns a slice of the parameters and
  of the optimizer state, and applies its part of every update (`engine.distributed.sharded`).
* ``"auto"``: collective for the sync family on a model of at least ``SCALE_MIN_NUMEL`` values
  (where CPU learners on one host all share memory with rank 0: ``ONE_HOST_COLLECTIVE_MIN_NUMEL``,
  or ``CROWDED_HOST_COLLECTIVE_MIN_NUMEL`` where they outnumber the host's cores);
  sharded for the async family once N x (P - 1) reaches ``SHARDED_MIN_TRAFFIC`` (central's rank
  0 moves about 2N(P - 1) values per P gradients, P times a ring all-reduce's share) and, when
  every learner runs on one host, P reaches ``ONE_HOST_SHARDED_MIN_P`` (there the "links" are
  memory, and rank 0 carrying the traffic cost less than owner threads contending with the
  learners for the same cores); where the options allow; central otherwise.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_stale.engine import streams
from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.central import CentralExchange, CentralPayloads
from lightning_stale.engine.distributed.channels import channel_pairs, open_channels
from lightning_stale.engine.distributed.collective import CollectiveExchange, CollectivePayloads
from lightning_stale.engine.distributed.lanes import open_lanes, slot_bytes_for
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.mesh import DataMesh
from lightning_stale.engine.distributed.messages import INLINE_PAYLOAD_BYTES, Kind, Message
from lightning_stale.engine.distributed.overlap import OverlappedAllReduce
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.distributed.sharded import ShardedExchange, ShardedPayloads, ShardLayout, ShardOwner
from lightning_stale.engine.distributed.transport import LearnerEndpoint, ServerEndpoint
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant, kind_of

log = logging.getLogger(__name__)

SERVER_PATHS = ("auto", "central", "collective", "sharded")
# The most processes whose NCCL channels keep their CUDA streams apart: a process holds up to
# 2(P - 1) channels, each on an engine stream beside the engine's others (`streams.engine_streams_needed`).
MAX_CHANNEL_WORLD = next(p for p in range(64, 1, -1)
                         if streams.engine_streams_needed(2 * (p - 1)) <= streams.STREAMS_PER_POOL)
# The first exchange on a channel (`channels._first_exchange`): large enough for the protocol of
# large payloads (NCCL sends up to 16 KiB in its low-latency one), small enough to cost nothing.
FIRST_CHANNEL_NUMEL = 1 << 18
# Below this many values per exchange a round trip through rank 0 costs less than spreading the
# traffic (measured by benchmarks/scaling.py; see the README's "Scaling" section).
SCALE_MIN_NUMEL = 1 << 18
# CPU learners on one host with shared memory: the sync family stays central below this. There
# `sync` through rank 0 ran at 1.11 to 1.18 x ddp's samples/s at 0.89M parameters on 2 and 4
# processes where the collective path ran at 0.87 to 0.94 (two launches; at 3.5M the two were
# within noise of each other, at 13.8M the collective path led). Where /dev/shm turns out full,
# the payloads go over gloo, as before shared memory existed: then the central path ran at 0.90
# at 0.89M, against the collective path's 1.00 and 0.92 on 2 and 4 processes (README, "Scaling").
ONE_HOST_COLLECTIVE_MIN_NUMEL = 1 << 21
# The same where the learners outnumber the host's cores: there the collective path's P optimizer
# steps (one per learner) compete for the cores, where rank 0 steps once for everyone. On 4
# processes on 2 cores `sync` through rank 0 ran at 1.08, 0.99 and 1.04 x ddp at 1.8M, 3.5M and
# 7.1M parameters against the collective path's 0.89, 0.95 and 0.98 (one launch, three repeats;
# two earlier launches at 3.5M: 1.03 and 0.97 against 0.915 and 0.93), and behind it at 13.8M
# (0.99 against 1.03); on 2 processes the collective path led from 7.1M (README, "Scaling").
CROWDED_HOST_COLLECTIVE_MIN_NUMEL = 1 << 23
# The async family on the central path until N x (P - 1) reaches this: below it the central
# server kept up with the sharded one (2 and 4 processes, 1M to 16M parameters, same benchmark).
SHARDED_MIN_TRAFFIC = 1 << 24
# On one host the async family stays central below this many learners: there the central path
# beat the sharded one at 3.5M and 13.8M parameters on 4 processes (0.96 and 0.99 x ddp's
# samples/s against 0.80 and 0.74), and on 8 it drew level or fell behind (README, "Scaling").
ONE_HOST_SHARDED_MIN_P = 8
# A timeout of a channel's group ends the process (NCCL's watchdog): a learner frozen for hours
# with a payload on its way is a straggler, not a reason to end the run.
CHANNEL_TIMEOUT = datetime.timedelta(days=7)


def path_problem(path: str, variant_name: str, on_learner_failure: str,
                 compensation: StalenessCompensation | None, clips: bool = False) -> str | None:
    """Why ``path`` cannot run these options, or None."""
    if path == "collective" and not kind_of(variant_name).synchronous:
        return (f"server='collective' serves the sync family (every update refreshes every learner), "
                f"not {variant_name!r}: use server='sharded', 'central' or 'auto'")
    if path in ("collective", "sharded") and on_learner_failure != "stop":
        return (f"server={path!r} needs every learner's process (in each all-reduce, or holding a "
                "slice), so a dead learner ends the run: use server='central' with "
                "on_learner_failure='continue'")
    if path in ("collective", "sharded") and compensation is not None and compensation.needs_parameters:
        return "the 'norm' staleness compensation needs the server's parameters in one place: use server='central'"
    if path == "sharded" and clips:
        return ("gradient clipping needs the norm of the whole averaged gradient, which the sharded "
                "path holds in slices: use server='central' or 'collective'")
    return None


def check_path(path: str, variant_name: str, on_learner_failure: str,
               compensation: StalenessCompensation | None) -> None:
    """Refuse a path that cannot run these options (called at the strategy's construction)."""
    if path not in SERVER_PATHS:
        raise ValueError(f"unknown server path {path!r}; choose one of {', '.join(SERVER_PATHS)}")
    problem = path_problem(path, variant_name, on_learner_failure, compensation)
    if problem:
        raise ValueError(problem)


def central_if_memory_is_shared(variant: Variant, numel: int, nodes: int, cpu_cores: int | None) -> bool:
    """Whether ``"auto"`` runs this model central provided that every remote learner shares memory
    with rank 0 (`lanes`): the sync family, CPU learners (``cpu_cores``: the host's cores, None on
    GPUs) on one host, from ``SCALE_MIN_NUMEL`` values to ``ONE_HOST_COLLECTIVE_MIN_NUMEL``, or to
    ``CROWDED_HOST_COLLECTIVE_MIN_NUMEL`` where the learners outnumber the cores. Over gloo the
    central path fell behind the collective one there (README, "Scaling"), so the strategy opens
    the lanes first (`settle_path`) and asks `choose_path` with the answer."""
    if not variant.synchronous or nodes != 1 or cpu_cores is None or variant.p == 1:
        return False
    limit = CROWDED_HOST_COLLECTIVE_MIN_NUMEL if variant.p > cpu_cores else ONE_HOST_COLLECTIVE_MIN_NUMEL
    return SCALE_MIN_NUMEL <= numel < limit


def choose_path(path: str, variant: Variant, numel: int, on_learner_failure: str,
                compensation: StalenessCompensation | None, clips: bool = False, nodes: int = 1,
                cpu_cores: int | None = None, memory_shared: bool = False) -> str:
    """The path to run (see the module docstring; ``nodes``: the hosts the learners run on;
    ``cpu_cores``: the host's cores where the learners run on CPU, else None; ``memory_shared``:
    every remote learner shares memory with rank 0); a refusal names what to use instead."""
    if path != "auto":
        problem = path_problem(path, variant.name, on_learner_failure, compensation, clips)
        if problem:
            raise ValueError(problem)
        return path
    if variant.p == 1 or numel < SCALE_MIN_NUMEL:
        return "central"
    if memory_shared and central_if_memory_is_shared(variant, numel, nodes, cpu_cores):
        return "central"
    if not variant.synchronous and numel * (variant.p - 1) < SHARDED_MIN_TRAFFIC:
        return "central"
    if not variant.synchronous and nodes == 1 and variant.p < ONE_HOST_SHARDED_MIN_P:
        return "central"
    scaled = "collective" if variant.synchronous else "sharded"
    ok = path_problem(scaled, variant.name, on_learner_failure, compensation, clips) is None
    return scaled if ok else "central"


def channel_backend(wanted: bool, path: str, world: int, default_backend: str | None,
                    device: torch.device, on_learner_failure: str, push_bytes: int,
                    separate_levels: bool = True) -> str | None:
    """The backend of the device channels (`channels`) for `StaleStrategy`'s
    ``payload_channels``, or None for none. Channels open only where asked for (they have never
    run on several GPUs, so they are no default): NCCL where the default group runs on it, gloo
    on CPU; none where a whole push (``push_bytes``) fits a header's frame, as every payload
    then does.

    NCCL channels need CUDA streams that no other user shares (`engine.streams`): a stream
    priority level of the engine's own on every rank (``separate_levels``, `levels_agree`), and
    no more streams at that level, nor NCCL groups at the channels' level, than a pool holds
    (``streams.STREAMS_PER_POOL``): up to ``MAX_CHANNEL_WORLD`` processes. Where they cannot
    have them, asking for channels is refused, saying why."""
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


def overlap_wanted(setting: bool | None, default_backend: str | None) -> bool:
    """`StaleStrategy`'s ``overlap_allreduce``: None (the default) overlaps where the default group
    runs on gloo, not on NCCL, where the overlap's own communicator beside the default one has
    not run on several GPUs yet (what has never run is no default); True or False as given."""
    return default_backend != "nccl" if setting is None else setting


def levels_agree(group, device: torch.device) -> bool:
    """`streams.separate_levels` on every rank of ``group`` (collective): the ranks decide
    alike whether to open the channels, whose groups every rank creates."""
    flag = torch.tensor([int(streams.separate_levels(device))])
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def overlaps(variant: Variant, adaptive: AdaptiveK | None) -> bool:
    """Whether every update takes one gradient from every learner, so that learners can reduce
    their gradients during backward (`engine.distributed.overlap`): Fully sync, and K-sync with
    K = P and no AdaSync changing K."""
    return (variant.name in ("sync", "k_sync") and variant.k == variant.p > 1 and adaptive is None)


@dataclass
class RankOptions:
    """What every rank needs to know besides the model (the strategy's options)."""

    path: str
    delay: Any = None
    delay_is_total: bool = False
    on_learner_failure: str = "stop"
    server_timeout: float = 30.0
    compensation: StalenessCompensation | None = None
    adaptive: AdaptiveK | None = None
    shared_memory: bool = True
    overlap: bool = False  # collective path: the all-reduce during backward (the strategy decides)
    shutdown_timeout: float = 60.0
    # central and sharded paths: the backend of the device channels (`channels`), None for none
    channels: str | None = None
    # the strategy's ``timeout`` (None: torch's default), for the overlap's group as for the
    # default one: on NCCL, the time after which torch's watchdog ends a collective left waiting
    timeout: datetime.timedelta | None = None


def settle_path(path: str, variant: Variant, module: nn.Module, group, rank: int, on_learner_failure: str,
                compensation: StalenessCompensation | None, clips: bool = False, nodes: int = 1,
                shared_memory: bool = True, cpu: bool = True) -> tuple[str, dict | None]:
    """The path to run, the same on every rank (`choose_path`), and the central path's lanes
    where they were opened to decide it, for `build_rank` (collective over ``group`` then)."""
    vectors = ModelVectors.of(module)
    cores = (os.cpu_count() or 1) if cpu else None  # the host's: the same on every rank of it
    lanes = None
    if path == "auto" and shared_memory and central_if_memory_is_shared(variant, vectors.numel, nodes, cores):
        lanes = open_lanes(group, rank, slot_bytes_for(vectors.max_push_numel(), vectors.dtype), all_or_none=True)
    chosen = choose_path(path, variant, vectors.numel, on_learner_failure, compensation, clips, nodes, cores,
                         memory_shared=bool(lanes))
    return chosen, (lanes or None) if chosen == "central" else None


def build_rank(rank: int, group, module: nn.Module, optimizer: Optimizer, schedulers: list,
               variant: Variant, limits: ServerLimits, options: RankOptions,
               resume: dict | None = None,
               clip: Callable[[Optimizer], None] | None = None,
               lanes: dict | None = None) -> tuple[Learner, ParameterServer | None, dict]:
    """This rank's learner, on rank 0 the started server (its thread running), and this rank's
    device channels (`channels`: `close_channels` after a clean end); ``lanes``: the central
    path's, where `settle_path` opened them."""
    vectors = ModelVectors.of(module)
    exchange = owner = payloads = server = None
    channels = {}
    if options.channels and group is not None:  # every rank creates every group, in this order
        channels = open_channels(rank, channel_pairs(options.path, variant.p), options.channels,
                                 vectors.device, CHANNEL_TIMEOUT, min(vectors.max_push_numel(), FIRST_CHANNEL_NUMEL),
                                 options.timeout)
    # Each direction's channel has one sending and one receiving thread, which post payloads in
    # the order of their headers (`channels`): the central path's endpoints, or the sharded
    # path's mesh (its endpoints carry headers and small orders, over gloo).
    endpoint_channels = channels if options.path == "central" else {}
    if options.path in ("collective", "sharded"):
        # Every learner starts from rank 0's parameters, as DDP does (each rank's owner too).
        state = vectors.state_vector(device=vectors.device)
        dist.broadcast(state, src=0)
        vectors.load_state(state)
    if options.path == "sharded":
        exchange, owner, payloads = _sharded_rank(rank, group, module, optimizer, schedulers, variant.p,
                                                  vectors, lambda: server, channels)
    elif options.path == "collective":
        schedules = Schedules(schedulers, optimizer)
        if resume is not None:
            schedules.load_states(resume.get("schedulers", []))
        device = vectors.device
        overlap = None
        if options.overlap:  # every rank creates both groups, in this order (they are collective)
            overlap = OverlappedAllReduce(vectors, variant.p, dist.new_group(timeout=options.timeout),
                                          dist.new_group(backend="gloo", timeout=datetime.timedelta(
                                              seconds=options.shutdown_timeout)), device)
        exchange = CollectiveExchange(vectors, optimizer, schedules, rank, device, clip, overlap=overlap)
    slot_bytes = slot_bytes_for(vectors.max_push_numel(), vectors.dtype)
    if options.path != "central" or channels:  # (device channels: the payloads stay on the device)
        lanes = {}
    elif lanes is None and group is not None and slot_bytes > INLINE_PAYLOAD_BYTES:
        # (smaller payloads travel inside their header's frame.) Collective: every rank takes
        # part, whether or not it can share memory with rank 0.
        lanes = open_lanes(group, rank, slot_bytes, enabled=options.shared_memory)
    lanes = lanes or {}
    if rank == 0:
        if options.path in ("collective", "sharded"):
            core = ServerCore(variant, None, limits, options.adaptive, options.compensation,
                              clock=time.monotonic())
            payloads = payloads or CollectivePayloads(overlap=options.overlap)
        else:
            state = ServerState(module, optimizer, schedulers, clip=clip)
            core = ServerCore(variant, state, limits, options.adaptive, options.compensation,
                              clock=time.monotonic())
            payloads = CentralPayloads(vectors, on_device=frozenset({0, *(dst for src, dst in channels if src == 0)}))
        if resume is not None:
            core.load_state_dict(resume)
        server = ParameterServer(core, payloads, options.on_learner_failure)
        # (K = 1: every push is decided on arrival, so the server reads it in its slot)
        server_endpoint = ServerEndpoint(group, variant.p, server.events.put, queue.Queue(),
                                         vectors.max_push_numel(), owner.commands if owner else None, lanes,
                                         lend_pushes=lambda: core.rules.k == 1, channels=endpoint_channels)
        if isinstance(payloads, ShardedPayloads):
            payloads.send = server_endpoint.send
        elif isinstance(payloads, CentralPayloads) and lanes:
            payloads.place_for = server_endpoint.place_for
        endpoint = LearnerEndpoint(0, group, vectors.state_numel, local_server=server_endpoint)
        server.start(server_endpoint)
    else:
        endpoint = LearnerEndpoint(rank, group, vectors.state_numel, owner=owner.commands if owner else None,
                                   lanes=lanes.get(0), channels=endpoint_channels)
    if owner is not None:
        owner.start(endpoint, server)
    if exchange is None and (rank == 0 or channels):
        # central: the pushes stay on the device, beside the server or on their channel
        exchange = CentralExchange(vectors, device=vectors.device)
    learner = Learner(endpoint, vectors, options.delay, exchange=exchange,
                      waits_for_answer=variant.pusher_needs_answer,
                      delay_is_total=options.delay_is_total,
                      server_error=lambda: server.error if server else None,
                      server_timeout=options.server_timeout,
                      roll_call=options.on_learner_failure == "continue" and variant.p > 1)
    return learner, server, channels


def _sharded_rank(rank: int, group, module: nn.Module, optimizer: Optimizer, schedulers: list, p: int,
                  vectors: ModelVectors, server_of: Callable[[], ParameterServer | None],
                  channels: dict):
    """This rank's exchange, shard owner and (rank 0) the server's payloads, joined by a mesh."""
    layout = ShardLayout([t.numel() for t in vectors.params], vectors.buffer_numel, p)
    state = ServerState(module, optimizer, schedulers, buffers=rank == 0, tensors=layout.tensors[rank])
    payloads = ShardedPayloads(p, send=None) if rank == 0 else None
    parts: dict[str, Any] = {}

    def deliver(peer: int, message) -> None:
        if message.kind == Kind.PIECE:
            parts["owner"].put_piece(message)
        elif message.kind == Kind.SLICE:
            parts["exchange"].put_slice(peer, message)
        elif message.kind == Kind.STATE and payloads is not None:
            payloads.put_state(peer, message)

    def broken(peer: int, error: str) -> None:
        server = server_of()
        if server is not None:
            server.events.put(Message(Kind.FAILED, learner=peer, error=error))
        else:
            parts["owner"].broken(error)

    # A state message holds an optimizer's state: far more than the model's values, at most.
    mesh = DataMesh(group, rank, p, deliver, 32 * vectors.max_push_numel() + (1 << 20), broken, channels)
    parts["owner"] = owner = ShardOwner(rank, state, mesh)
    parts["exchange"] = exchange = ShardedExchange(vectors, layout, rank, mesh, owner)
    mesh.start()
    return exchange, owner, payloads
