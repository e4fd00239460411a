"""The engine on one rank: its learner, and on global rank 0 the server, for the chosen path.

Paths (``server=`` of `StaleStrategy`; the README's "Scaling" section models their traffic):

* ``"central"``: the server on rank 0 holds the parameters; every push carries a gradient to it
  and every answer parameters back. Fewest hops: the fastest for small models, and the only path
  on which no learner ever waits for another (any variant, a frozen or dead learner).
* ``"collective"`` (sync family): the server decides from headers; the gradients of an update
  meet in one all-reduce and every learner applies it (`engine.distributed.collective`).
* ``"auto"``: collective for the sync family when the model has at least
  ``COLLECTIVE_MIN_NUMEL`` values to exchange and nothing needs the central server, else central.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.collective import CollectiveExchange, CollectivePayloads
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.server import CentralPayloads, ParameterServer
from lightning_stale.engine.distributed.transport import LearnerEndpoint, ServerEndpoint
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant, kind_of

SERVER_PATHS = ("auto", "central", "collective")
# Below this many values per exchange a round trip through rank 0 costs less than an all-reduce
# (measured by benchmarks/scaling.py; see the README's "Scaling" section).
COLLECTIVE_MIN_NUMEL = 1 << 18


def check_path(path: str, variant_name: str, on_learner_failure: str,
               compensation: StalenessCompensation | None) -> None:
    """Refuse a path that cannot run these options (called at the strategy's construction)."""
    if path not in SERVER_PATHS:
        raise ValueError(f"unknown server path {path!r}; choose one of {', '.join(SERVER_PATHS)}")
    if path != "collective":
        return
    if not kind_of(variant_name).synchronous:
        raise ValueError(f"server='collective' serves the sync family (every update refreshes every "
                         f"learner), not {variant_name!r}: use server='central' or 'auto'")
    if on_learner_failure != "stop":
        raise ValueError("server='collective' needs every learner in each all-reduce, so a dead "
                         "learner ends the run: use server='central' with on_learner_failure='continue'")
    if compensation is not None and compensation.needs_parameters:
        raise ValueError("the 'norm' staleness compensation needs the server's parameters: use "
                         "server='central' (the sync family has no stale gradient to weigh anyway)")


def choose_path(path: str, variant: Variant, numel: int, on_learner_failure: str,
                compensation: StalenessCompensation | None) -> str:
    """The path to run (see the module docstring)."""
    if path != "auto":
        return path
    collective = (variant.synchronous and variant.p > 1 and numel >= COLLECTIVE_MIN_NUMEL
                  and on_learner_failure == "stop"
                  and (compensation is None or not compensation.needs_parameters))
    return "collective" if collective else "central"


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


def build_rank(rank: int, group, module: nn.Module, optimizer: Optimizer, schedulers: list,
               variant: Variant, limits: ServerLimits, options: RankOptions,
               resume: dict | None = None,
               clip: Callable[[Optimizer], None] | None = None) -> tuple[Learner, ParameterServer | None]:
    """This rank's learner and, on rank 0, the started server (its thread running)."""
    vectors = ModelVectors.of(module)
    exchange = None
    if options.path == "collective":
        # Every learner holds the parameters: start from rank 0's, as DDP does.
        state = vectors.state_vector().to(vectors.params[0].device if vectors.params else "cpu")
        dist.broadcast(state, src=0)
        vectors.load_state(state)
        schedules = Schedules(schedulers, optimizer)
        if resume is not None:
            schedules.load_states(resume.get("schedulers", []))
        device = vectors.params[0].device if vectors.params else torch.device("cpu")
        exchange = CollectiveExchange(vectors, optimizer, schedules, rank, device, clip)
    server = None
    if rank == 0:
        if options.path == "collective":
            core = ServerCore(variant, None, limits, options.adaptive, options.compensation,
                              clock=time.monotonic())
            payloads = CollectivePayloads()
        else:
            state = ServerState(module, optimizer, schedulers, clip=clip)
            core = ServerCore(variant, state, limits, options.adaptive, options.compensation,
                              clock=time.monotonic())
            payloads = CentralPayloads(vectors)
        if resume is not None:
            core.load_state_dict(resume)
        server = ParameterServer(core, payloads, options.on_learner_failure)
        server_endpoint = ServerEndpoint(group, variant.p, server.events.put, queue.Queue(),
                                         vectors.max_push_numel())
        endpoint = LearnerEndpoint(0, group, vectors.state_numel, local_server=server_endpoint)
        server.start(server_endpoint)
    else:
        endpoint = LearnerEndpoint(rank, group, vectors.state_numel)
    learner = Learner(endpoint, vectors, options.delay, exchange=exchange,
                      waits_for_answer=variant.pusher_needs_answer,
                      delay_is_total=options.delay_is_total,
                      server_error=lambda: server.error if server else None,
                      server_timeout=options.server_timeout)
    return learner, server
