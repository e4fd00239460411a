"""The sharded path as a plug-in (`paths.base.ServerPath`): every rank owns a slice of the model
(`sharded.owner`), joined by a mesh of data connections (`sharded.mesh`)."""

from __future__ import annotations

import logging
from typing import Any

from lightning_stale.engine.distributed.messages import Kind, Message, ShardData
from lightning_stale.engine.distributed.paths.base import (
    CheckpointPart,
    CheckpointView,
    RankContext,
    RankParts,
    ServerPath,
    spread_path_problem,
)
from lightning_stale.engine.distributed.paths.sharded.mesh import DataMesh
from lightning_stale.engine.distributed.paths.sharded.owner import ShardLayout, ShardOwner
from lightning_stale.engine.distributed.paths.sharded.sides import (
    FINAL,
    ShardedExchange,
    ShardedPayloads,
    assemble_optimizer_state,
)
from lightning_stale.engine.state import ServerState, named_state
from lightning_stale.method.compensation import StalenessCompensation

log = logging.getLogger(__name__)


class ShardedPath(ServerPath):
    """Any variant; every process holds a slice, so a dead learner ends the run."""

    name = "sharded"

    def problem(self, variant_name: str, on_learner_failure: str, compensation: StalenessCompensation | None,
                clips: bool = False) -> str | None:
        problem = spread_path_problem(self.name, on_learner_failure, compensation)
        if problem is not None:
            return problem
        if clips:
            return ("gradient clipping needs the norm of the whole averaged gradient, which the sharded "
                    "path holds in slices: use server='central' or 'collective'")
        return None

    def traffic(self, numel: int, p: int, k: int) -> float:
        """Each of an update's K pushes sends every other owner its piece, and each refreshed learner gets every other
        owner's slice: per push about N(P - 1)/P values up and as many down for its learner, spread over the P
        owners, so per update 2N K (P - 1) / P^2 values at each rank on average; with K = P, a ring all-reduce's
        2N(P - 1)/P (Patarasuk and Yuan, 2009)."""
        return 2 * numel * k * (p - 1) / (p * p)

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return [(a, b) for a in range(p) for b in range(p) if a != b]

    def build(self, ctx: RankContext) -> RankParts:
        """This rank's exchange, shard owner and (rank 0) the server's side, joined by a mesh."""
        vectors, rank, p = ctx.vectors, ctx.rank, ctx.variant.p
        layout = ShardLayout([t.numel() for t in vectors.params], vectors.buffer_numel, p)
        state = ServerState(ctx.module, ctx.optimizer, ctx.schedulers, buffers=rank == 0,
                            tensors=layout.tensors[rank])
        payloads = ShardedPayloads(p) if rank == 0 else None
        parts: dict[str, Any] = {}

        def deliver(peer: int, message: ShardData) -> None:
            if message.kind == Kind.PIECE:
                parts["owner"].put_piece(message)
            elif message.kind == Kind.SLICE:
                parts["exchange"].put_slice(peer, message)
            elif message.kind == Kind.STATE and payloads is not None:
                payloads.put_state(peer, message)

        def broken(peer: int, error: str) -> None:
            server = ctx.server()
            if server is not None:
                server.events.put(Message(Kind.FAILED, learner=peer, error=error))
            else:
                parts["owner"].broken(error)

        # A state message holds an optimizer's state: far more than the model's values, at most.
        mesh = DataMesh(ctx.group, rank, p, deliver, 32 * vectors.max_push_numel() + (1 << 20), broken,
                        ctx.channels)
        parts["owner"] = owner = ShardOwner(rank, state, mesh)
        parts["exchange"] = exchange = ShardedExchange(vectors, layout, rank, mesh, owner)
        mesh.start()
        return RankParts(lambda endpoint: exchange, payloads, orders=owner.commands, start=owner.start)

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        return ShardedCheckpoint(view)


class ShardedCheckpoint(CheckpointPart):
    """The model is spread over the owners: gathered to rank 0 once per checkpoint (in the order of the server's
    updates, so every slice is of the same version)."""

    def __init__(self, view: CheckpointView) -> None:
        super().__init__(view)
        side = view.learner_side
        assert isinstance(side, ShardedExchange), "rank 0's learner side is the sharded path's"
        self.layout, self.params = side.layout, side.vectors.params
        self._gathered: tuple | None = None  # (vector, optimizer state, schedulers, version)
        self._requests = FINAL
        self._warned = False

    @property
    def lost(self) -> bool:
        """The run failed: what the owners held cannot be gathered."""
        return self.live and self.view.server.error is not None

    def module_state(self, state_dict: dict) -> dict:
        if self.lost:  # (Lightning asks for the module's state first: the warning goes here)
            self._warn_lost()
            return state_dict
        if not self.live:
            return state_dict
        self._gathered = None  # a checkpoint begins here: its instant is now
        state_dict.update(named_state(self.view.module, self._gather()[0]))
        return state_dict

    def optimizer_state(self, own: dict) -> dict:
        return own if not self.live or self.lost else self._gather()[1]

    def engine_state(self) -> dict:
        saved = self.view.server.state_dict()
        learner = self.view.learner()
        if self.lost:
            version = learner.version if learner is not None else saved["version"]
            saved.update(version=version, updates=version, schedulers=[])
        elif self.live:
            _, _, schedulers, version = self._gather()
            saved.update(version=version, updates=version, schedulers=schedulers)
        self._gathered = None  # the next checkpoint gathers anew
        return saved

    def finish(self) -> None:
        """Rank 0's optimizer takes the state gathered from the owners at the stop."""
        _, saved, _ = self.view.server.payloads.gathered(FINAL, self.view.check_server)
        optimizer = self.view.optimizer()
        optimizer.load_state_dict(assemble_optimizer_state(optimizer, self.layout, self.params, saved))

    def _warn_lost(self) -> None:
        if not self._warned:
            self._warned = True
            learner = self.view.learner()
            log.warning("StaleStrategy: the run failed, so this checkpoint holds rank 0's learner's "
                        "parameters (version %d) without optimizer or scheduler state: the shard "
                        "owners' state was lost with the failure", learner.version if learner else -1)

    def _gather(self) -> tuple:
        if self._gathered is None:
            server, check = self.view.server, self.view.check_server
            if server.core.stopped:  # the owners have retired: the state gathered at the stop
                states, saved, version = server.payloads.gathered(FINAL, check, keep=True)
            else:
                self._requests += 1
                server.gather(self._requests)
                states, saved, version = server.payloads.gathered(self._requests, check)
            self._gathered = (self.layout.join(states),
                              assemble_optimizer_state(self.view.optimizer(), self.layout, self.params, saved),
                              saved[0]["schedulers"], version)
        return self._gathered
