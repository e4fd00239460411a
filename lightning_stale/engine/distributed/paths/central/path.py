"""The central path as a plug-in (`paths.base.ServerPath`): rank 0's server holds the model.
`CentralExchange` is a learner's side (a push carries the gradient, an answer the parameters),
`CentralPayloads` what the server's messages carry."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from lightning_stale.engine import streams
from lightning_stale.engine.core import ServerCore
from lightning_stale.engine.distributed.messages import Flag, Kind, Message
from lightning_stale.engine.distributed.paths.base import (
    CheckpointPart,
    CheckpointView,
    LearnerSide,
    RankContext,
    RankParts,
    ServerPath,
    ServerSide,
)
from lightning_stale.engine.local_round import pseudo_gradient_push
from lightning_stale.engine.state import Contribution, ModelVectors, ServerState
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.rules import Decision


class CentralExchange(LearnerSide):
    """A learner meets a server holding the parameters: gradients go, parameters come. With
    ``local`` updates (docs/how-to/local-updates.md) a push carries the pseudo-gradient of the
    learner's round instead: ``pulled`` (the parameters and buffers last taken) minus its own,
    ``present`` the round's parameters that got a gradient (`local_steps.LocalSteps` sets it)."""

    def __init__(self, vectors: ModelVectors,
                 buffer: Callable[[int, torch.dtype], torch.Tensor | None] | None = None,
                 device: torch.device | None = None, local: bool = False) -> None:
        self.vectors, self.buffer, self.device = vectors, buffer, device
        self.local = local
        self.pulled: torch.Tensor | None = None
        self.present: torch.Tensor | None = None

    def fill_push(self, message: Message) -> None:
        """The gradient, packed straight into shared memory where ``buffer`` offers a place."""
        buffer, dtype = self.buffer, self.vectors.dtype
        place = None if buffer is None else (lambda numel: buffer(numel, dtype))
        if self.local:
            assert self.pulled is not None, "a round starts from the parameters taken"
            message.payload, masked = pseudo_gradient_push(self.vectors, self.pulled, self.present,
                                                           device=self.device, out=place)
        else:
            message.payload, masked = self.vectors.push_vector(device=self.device, out=place)
        message.ready = streams.mark(message.payload)  # on a GPU: the server reads it on its stream
        if masked:
            message.flags |= Flag.MASKED

    def take(self, message: Message) -> None:
        """The parameters, from the message's payload or straight from its shared-memory slot."""
        if message.lent is not None:  # still in its shared-memory slot: loaded from there
            message.lent.use(self.vectors.load_state)
        elif message.payload is not None:
            self.vectors.load_state(message.payload)
        if self.local:  # where the next round starts (a copy: the module's change in place)
            self.pulled = self.vectors.state_vector(device=self.vectors.device)


class CentralPayloads(ServerSide):
    """Pushes carry gradients; refreshes, epoch ends and stops the server's parameters."""

    def __init__(self, vectors: ModelVectors,
                 place_for: Callable[[int, int, torch.dtype], torch.Tensor | None] | None = None,
                 on_device: frozenset[int] = frozenset({0})) -> None:
        self.vectors, self.place_for, self.on_device = vectors, place_for, on_device

    def attach(self, endpoint) -> None:
        if endpoint.lane_learners:  # answers may go straight into a learner's next slot
            self.place_for = endpoint.place_for

    def contribution(self, message: Message) -> Contribution:
        assert message.payload is not None, "a usable push carries its gradient"
        streams.receive(message.payload, message.ready)  # rank 0's push, on a GPU
        return self.vectors.split_push(message.payload, bool(message.flags & Flag.MASKED))

    def fill(self, message: Message, core: ServerCore, decision: Decision | None) -> None:
        if message.kind not in (Kind.PARAMS, Kind.EPOCH, Kind.STOP):
            return
        state, version = core.state, core.version
        assert state is not None, "the central server holds the model"
        if message.learner in self.on_device:  # never through the host
            message.payload = state.snapshot(version, state.vectors.device)
            message.ready = streams.mark(message.payload)  # made on the server's stream
            return
        place = None
        alone = message.kind == Kind.PARAMS and decision is not None and len(decision.refresh) == 1
        if alone and self.place_for is not None and not state.has_snapshot(version):
            place = self.place_for(message.learner, state.vectors.state_numel, state.vectors.dtype)
        message.payload = state.snapshot(version) if place is None else state.vectors.state_vector(out=place)


class CentralPath(ServerPath):
    """Every push carries a gradient to rank 0, every answer the parameters back; it runs every
    option (any variant, a dead learner, the "norm" compensation, gradient clipping)."""

    name = "central"
    payloads_through_server = True
    broadcasts_start = False  # the server's first answer carries w_0

    def problem(self, variant_name: str, on_learner_failure: str, compensation: StalenessCompensation | None,
                clips: bool = False) -> str | None:
        return None

    def traffic(self, numel: int, p: int, k: int) -> float:
        """Rank 0 gets N values from each of K pushes and sends N back, one push in P crossing no link:
        2N K (P - 1) / P, P times a ring all-reduce's share per P gradients (Patarasuk and Yuan,
        "Bandwidth optimal all-reduce algorithms", 2009)."""
        return 2 * numel * k * (p - 1) / p

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return [pair for learner in range(1, p) for pair in ((learner, 0), (0, learner))]

    def build(self, ctx: RankContext) -> RankParts:
        vectors, channels, options = ctx.vectors, ctx.channels, ctx.options
        local = options.outer is not None  # local updates: pushes carry pseudo-gradients
        if ctx.rank != 0:
            on_host = not channels  # (device channels: the payloads stay on the device)
            return RankParts(lambda endpoint: CentralExchange(vectors, endpoint.push_buffer, local=local)
                             if on_host else CentralExchange(vectors, device=vectors.device, local=local))
        # Rank 0's pushes stay on the device, beside the server; so do those on device channels.
        on_device = frozenset({0, *(dst for src, dst in channels if src == 0)})
        # (with local updates the schedulers are the inner optimizer's, which each learner steps
        # itself along the server's trajectory: `local_steps.LocalSteps`; the server steps none)
        return RankParts(lambda endpoint: CentralExchange(vectors, device=vectors.device, local=local),
                         CentralPayloads(vectors, on_device=on_device),
                         ServerState(ctx.module, ctx.optimizer, () if local else ctx.schedulers, clip=ctx.clip,
                                     outer=options.outer, steps_per_update=options.local_steps))

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        return CentralCheckpoint(view)


class CentralCheckpoint(CheckpointPart):
    """The server's `ServerState` on rank 0."""

    def read(self) -> tuple[dict, dict, dict]:
        """Copied: the server steps in place once its lock is released."""
        server: Any = self.view.server
        with server.reading():
            state = server.core.state
            if state.outer:  # local updates: the slot holds the inner optimizer's, as on the simulated engine
                books = {**copy.deepcopy(server.core.state_dict()),
                         "outer_optimizer": copy.deepcopy(state.optimizer.state_dict())}
                return (state.named_state(self.view.module), copy.deepcopy(self.view.optimizer().state_dict()),
                        books)
            return (state.named_state(self.view.module), copy.deepcopy(state.optimizer.state_dict()),
                    copy.deepcopy(server.core.state_dict()))

    def finish(self) -> None:
        server = self.view.server
        with server.reading():
            if not server.core.state.outer:  # (with local updates rank 0 keeps its inner optimizer's)
                self.view.optimizer().load_state_dict(server.core.state.optimizer.state_dict())
