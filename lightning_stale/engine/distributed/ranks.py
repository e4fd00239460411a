"""The engine on one rank: routes, the path's part (`ServerPath.build`), the learner and, on
rank 0, the server."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.frames import open_routes
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.paths.base import RankContext, RankOptions
from lightning_stale.engine.distributed.paths.registry import path_named
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.distributed.transport import LearnerEndpoint, ServerEndpoint
from lightning_stale.engine.state import ModelVectors
from lightning_stale.method.variants import Variant

__all__ = ["RankOptions", "build_rank"]


def build_rank(rank: int, group, module: nn.Module, optimizer: Optimizer, schedulers: list,
               variant: Variant, limits: ServerLimits, options: RankOptions,
               resume: dict | None = None,
               clip: Callable[[Optimizer], None] | None = None,
               lanes: dict | None = None) -> tuple[Learner, ParameterServer | None, dict]:
    """This rank's learner, on rank 0 the started server, and its device channels (to close after
    a clean end); ``lanes``: the central path's, where `settle_path` opened them."""
    path = path_named(options.path)
    vectors = ModelVectors.of(module)
    routes = open_routes(rank, group, path.channel_pairs(variant.p), options.channels, vectors,
                         through_endpoints=path.payloads_through_server, shared_memory=options.shared_memory,
                         lanes=lanes, setup_timeout=options.timeout)
    if path.broadcasts_start:  # every learner starts from rank 0's parameters, as DDP does
        state = vectors.state_vector(device=vectors.device)
        dist.broadcast(state, src=0)
        vectors.load_state(state)
    server: ParameterServer | None = None
    parts = path.build(RankContext(rank, group, module, optimizer, schedulers, variant, vectors, options,
                                   resume, clip, routes.channels, server=lambda: server))
    if rank == 0:
        assert parts.server_side is not None, f"the {path.name} path builds rank 0's server side"
        core = ServerCore(variant, parts.state, limits, options.adaptive, options.compensation,
                          clock=time.monotonic(), observer=options.observer, adaptive_h=options.adaptive_h)
        if resume is not None:
            core.load_state_dict(resume)
        server = ParameterServer(core, parts.server_side, options.on_learner_failure)
        # (K = 1: every push is decided on arrival, so the server reads it in its slot)
        server_endpoint = ServerEndpoint(group, variant.p, server.events.put, queue.Queue(),
                                         vectors.max_push_numel(), parts.orders, routes.lanes,
                                         lend_pushes=lambda: core.rules.k == 1, channels=routes.endpoint_channels)
        parts.server_side.attach(server_endpoint)
        endpoint = LearnerEndpoint(0, group, vectors.state_numel, local_server=server_endpoint)
        server.start(server_endpoint)
    else:
        endpoint = LearnerEndpoint(rank, group, vectors.state_numel, owner=parts.orders,
                                   lanes=routes.lanes.get(0), channels=routes.endpoint_channels)
    if parts.start is not None:
        parts.start(endpoint, server)
    learner = Learner(endpoint, vectors, options.delay, exchange=parts.learner_side(endpoint),
                      waits_for_answer=variant.pusher_needs_answer,
                      delay_is_total=options.delay_is_total,
                      server_error=lambda: server.error if server else None,
                      server_timeout=options.server_timeout,
                      roll_call=options.on_learner_failure == "continue" and variant.p > 1)
    return learner, server, routes.channels
