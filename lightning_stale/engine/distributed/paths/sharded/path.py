"""The sharded path: every rank owns a slice of the model (`sharded.owner`), joined by a mesh
(`sharded.mesh`). A learner's push goes out in pieces, parameters come in slices
(`ShardedExchange`); the server's pushes are headers, updates orders (`ShardedPayloads`)."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_stale.engine import streams
from lightning_stale.engine.distributed.messages import Flag, Kind, Message, Order, ShardData, text_payload
from lightning_stale.engine.distributed.paths.base import (
    CheckpointPart,
    CheckpointView,
    LearnerSide,
    RankContext,
    RankParts,
    ServerPath,
    ServerSide,
    spread_path_problem,
)
from lightning_stale.engine.distributed.paths.sharded.mesh import DataMesh
from lightning_stale.engine.distributed.paths.sharded.owner import WAIT_S, PieceRef, ShardLayout, ShardOwner
from lightning_stale.engine.state import ModelVectors, ServerState, named_state
from lightning_stale.method.compensation import StalenessCompensation

_IN_SLICES = torch.zeros(0)  # the payload of a resolved message whose parameters wait in slices
FINAL = 0  # the gather request of the stop; checkpoints during training ask with 1, 2, ...


class ShardedExchange(LearnerSide):
    """A learner's side of the sharded path (see the module docstring)."""

    def __init__(self, vectors: ModelVectors, layout: ShardLayout, rank: int, mesh: DataMesh,
                 owner: ShardOwner) -> None:
        self.vectors, self.layout, self.rank, self.mesh, self.owner = vectors, layout, rank, mesh, owner
        self.seq = 0
        self._slices: dict[int, dict[int, ShardData]] = {}  # delivery -> owner -> SLICE
        self._resolved: tuple[int, list[Tensor]] = (0, [])  # the latest PARAMS/STOP's slices
        self._arrived = threading.Condition()

    @property
    def payloads_on_channels(self) -> int:
        return self.mesh.payloads_on_channels

    def fill_push(self, message: Message) -> None:  # on the device where pieces go device to device
        message.payload, masked = self.vectors.push_vector(device=self.mesh.payload_device(self.vectors.device))
        if masked:
            message.flags |= Flag.MASKED

    def before_push(self, message: Message) -> None:
        """The pieces go to the owners before the header to the server: an owner rarely waits."""
        self.seq += 1
        message.seq = self.seq
        vector, message.payload = message.payload, None
        if vector is None:  # nothing to apply (an overflow): the header alone
            return
        masked = bool(message.flags & Flag.MASKED)
        for owner in range(self.layout.p):
            piece = self.layout.piece(vector, owner, masked)
            self.mesh.send(owner, ShardData(Kind.PIECE, self.rank, message.version, seq=self.seq,
                                          flags=message.flags & Flag.MASKED, payload=piece,
                                          ready=streams.mark(piece)))

    def put_slice(self, owner: int, message: ShardData) -> None:
        if message.payload is None:  # an owner of no tensor sends nothing
            message.payload = torch.zeros(0, dtype=self.vectors.dtype)
        with self._arrived:
            self._slices.setdefault(message.delivery, {})[owner] = message
            self._arrived.notify_all()

    def resolve(self, message: Message, check: Callable[[], None]) -> None:
        """A sliced message gets every owner's slice of its delivery."""
        if not message.flags & Flag.SLICED:
            return
        with self._arrived:
            while len(self._slices.get(message.delivery, ())) < self.layout.p:
                self._arrived.wait(WAIT_S)
                check()
            arrived = self._slices.pop(message.delivery)
            for delivery in [d for d in self._slices if d < message.delivery]:
                del self._slices[delivery]  # skipped: a newer delivery superseded them
        for m in arrived.values():
            streams.receive(m.payload, m.ready)  # a slice on the device: from its channel or owner
        slices = [_payload(arrived[o]) for o in range(self.layout.p)]
        if message.kind == Kind.EPOCH:  # kept whole: validation loads it later
            message.payload = self.layout.join(slices)
        else:  # loaded straight from the slices by `take`
            self._resolved, message.payload = (message.delivery, slices), _IN_SLICES

    def take(self, message: Message) -> None:
        """The parameters, joined from the slices as they are loaded."""
        if message.payload is _IN_SLICES:
            delivery, slices = self._resolved
            if delivery != message.delivery:
                raise RuntimeError(f"parameters of delivery {message.delivery} taken, {delivery} resolved")
            self.layout.load(self.vectors, slices)
        elif message.payload is not None:
            self.vectors.load_state(message.payload)

    def close(self, timeout: float, failed: bool = False) -> list[str]:
        """This rank's owner has retired; the mesh says goodbye to every peer."""
        deadline = time.monotonic() + timeout  # one bound for both
        stuck = [] if self.owner.join(timeout) else [f"stale-shard-{self.rank}"]
        self.mesh.close()
        return stuck + self.mesh.join(max(0.0, deadline - time.monotonic()))


class ShardedPayloads(ServerSide):
    """The server's side of the sharded path (see the module docstring)."""

    def __init__(self, p: int, send: Callable[[int, Order], None] | None = None) -> None:
        self.p, self.send = p, send
        self._delivery = 0
        self._gathered: dict[int, dict[tuple[int, bool], ShardData]] = {}
        self._gathered_ready = threading.Condition()

    def attach(self, endpoint) -> None:
        self.send = endpoint.send  # orders go to the owners as messages to their ranks

    def contribution(self, message: Message) -> PieceRef:
        return PieceRef(message.learner, message.seq)

    def fill(self, message: Message, core, decision) -> None:  # parameters: every owner sends a slice
        if message.kind not in (Kind.PARAMS, Kind.EPOCH, Kind.STOP):
            return
        self._delivery += 1
        self._to_owners(Order(Kind.SEND, message.learner, delivery=self._delivery))
        message.delivery, message.flags = self._delivery, message.flags | Flag.SLICED

    def on_update(self, update, contributions: Sequence[PieceRef], weights) -> None:
        weights = [1.0] * len(contributions) if weights is None else list(weights)
        orders = torch.tensor([[c.learner, c.seq, w] for c, w in zip(contributions, weights)],
                              dtype=torch.float64).reshape(-1)
        self._to_owners(Order(Kind.APPLY, version=update.version, payload=orders))

    def on_schedule(self, epoch: int, metrics: dict, per_update: bool) -> None:
        self._to_owners(Order(Kind.SCHEDULE, epoch=epoch, flags=Flag.PER_UPDATE if per_update else 0,
                              payload=text_payload(json.dumps(metrics))))

    def on_stop(self) -> None:
        """The final state goes to rank 0, then the owners retire."""
        self.gather(FINAL)
        self._to_owners(Order(Kind.RETIRE))

    def gather(self, request: int) -> None:
        """Ask every owner for its state (answered through `put_state`, to rank 0)."""
        with self._gathered_ready:
            self._gathered[request] = {}
        self._to_owners(Order(Kind.GATHER, delivery=request))

    def put_state(self, owner: int, message: ShardData) -> None:
        with self._gathered_ready:
            self._gathered.setdefault(message.delivery, {})[(owner, bool(message.flags & Flag.OPTIMIZER))] = message
            self._gathered_ready.notify_all()

    def gathered(self, request: int, check: Callable[[], None],
                 keep: bool = False) -> tuple[list[Tensor], list[dict], int]:
        """Every owner's state vector and saved states for ``request``, and their version."""
        with self._gathered_ready:
            while len(self._gathered.get(request, ())) < 2 * self.p:
                self._gathered_ready.wait(WAIT_S)
                check()
            parts = self._gathered[request] if keep else self._gathered.pop(request)
        states = [_payload(parts[(o, False)]) for o in range(self.p)]
        # On the host: saved from an owner's GPU, which rank 0 must not allocate on (may not see).
        saved = [torch.load(io.BytesIO(_payload(parts[(o, True)]).numpy().tobytes()), map_location="cpu",
                            weights_only=True) for o in range(self.p)]
        return states, saved, parts[(0, False)].version

    def _to_owners(self, command: Order) -> None:
        assert self.send is not None, "the server's endpoint is attached before the server starts"
        for owner in range(self.p):
            self.send(owner, replace(command))  # one each: its receiver notes the arrival on it


def _payload(message: ShardData) -> Tensor:
    """A message's payload; none (an owner of no tensor) is an empty one."""
    return message.payload if message.payload is not None else torch.zeros(0)


def assemble_optimizer_state(optimizer, layout: ShardLayout, params: Sequence[Tensor],
                             saved: Sequence[dict]) -> dict:
    """The state dict of ``optimizer`` (rank 0's, over ``params``) as if it had taken every update:
    each owner's per-parameter state, renumbered, and owner 0's current group options."""
    full = optimizer.state_dict()
    numbering = {id(p): i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
    state = {}
    for owner, part in enumerate(saved):
        owned = {id(params[i]) for i in layout.tensors[owner]}
        mine = [numbering[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in owned]
        for local, value in part["optimizer"]["state"].items():
            state[mine[local]] = value
    groups = [{**{k: v for k, v in shard_group.items() if k != "params"}, "params": group["params"]}
              for shard_group, group in zip(saved[0]["optimizer"]["param_groups"], full["param_groups"])]
    return {"state": state, "param_groups": groups}


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
        """Per push about N(P - 1)/P values up to the other owners and as many down, spread over P
        owners: 2N K (P - 1) / P^2 per rank; with K = P a ring all-reduce's (Patarasuk and Yuan, 2009)."""
        return 2 * numel * k * (p - 1) / (p * p)

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return [(a, b) for a in range(p) for b in range(p) if a != b]

    def build(self, ctx: RankContext) -> RankParts:
        """This rank's exchange, shard owner and (rank 0) server side, joined by a mesh."""
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
    """Gathered from the owners once per checkpoint, in the order of the updates: one version."""

    def __init__(self, view: CheckpointView) -> None:
        super().__init__(view)
        side = view.learner_side
        assert isinstance(side, ShardedExchange), "rank 0's learner side is the sharded path's"
        self.layout, self.params = side.layout, side.vectors.params
        self._requests = FINAL
        self._warned = False

    @property
    def lost(self) -> bool:
        """The run failed: the owners' state cannot be gathered."""
        return self.live and self.view.server.error is not None

    def engine_state(self) -> dict:
        if not self.lost:
            return super().engine_state()
        saved, learner = self.view.server.state_dict(), self.view.learner()
        version = learner.version if learner is not None else saved["version"]
        saved.update(version=version, updates=version, schedulers=[])
        return saved

    def finish(self) -> None:
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

    def read(self) -> tuple[dict, dict, dict] | None:
        if self.lost:  # (Lightning asks for the module's state first: the warning goes there)
            self._warn_lost()
            return None
        server, check = self.view.server, self.view.check_server
        if server.core.stopped:  # the owners have retired: the state gathered at the stop
            states, saved, version = server.payloads.gathered(FINAL, check, keep=True)
        else:
            self._requests += 1
            server.gather(self._requests)
            states, saved, version = server.payloads.gathered(self._requests, check)
        return (named_state(self.view.module, self.layout.join(states)),
                assemble_optimizer_state(self.view.optimizer(), self.layout, self.params, saved),
                {"version": version, "updates": version, "schedulers": saved[0]["schedulers"]})
