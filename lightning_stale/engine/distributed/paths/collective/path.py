"""The collective path, the sync family at scale: every update refreshes every learner, so every
learner holds the parameters and applies the update, as DDP does, the K gradients meeting in one
all-reduce. The server decides from headers and tells each learner how many of its gradients the
update takes; they sum them (weighted 1/K), all-reduce and step alike. The cost: an update waits
for a learner inside its forward or backward (docs/concepts/paths.md)."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_stale.engine.distributed.messages import Flag, Kind, Message
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
from lightning_stale.engine.distributed.paths.collective.overlap import OverlappedAllReduce
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors, load_gradients
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.rules import Update
from lightning_stale.method.variants import Variant, kind_of


def update_payload(update: Update, p: int, overlap_next: bool = False) -> Tensor:
    """What every learner hears of an update: [K, gradients taken from learner 0, ..., P-1,
    whether the next backward is an overlapped round (1) or not (0)]."""
    payload = torch.zeros(p + 2, dtype=torch.float64)
    payload[0] = len(update.gradients)
    for push in update.gradients:
        payload[1 + push.learner] += 1
    payload[-1] = float(overlap_next)
    return payload


class CollectivePayloads(ServerSide):
    """The server's side: pushes are headers, a refresh carries `update_payload`, nothing parameters."""

    def __init__(self, overlap: bool = False) -> None:
        self.overlap = overlap

    def contribution(self, message: Message) -> None:
        return None  # the gradient stays with its learner until the update's all-reduce

    def fill(self, message: Message, core, decision) -> None:
        # (a stop carries the update that stopped training, if one did: max_steps, max_epochs)
        if message.kind in (Kind.PARAMS, Kind.STOP) and decision is not None and decision.update is not None:
            p = core.rules.p
            overlap_next = self.overlap and core.rules.k == p and core.pushes_fit_in_epoch(p)
            message.payload = update_payload(decision.update, p, overlap_next)


class CollectiveExchange(LearnerSide):
    """A learner's side of the collective path (see the module docstring)."""

    schedules: Schedules  # every learner steps its own

    def __init__(self, vectors: ModelVectors, optimizer: Optimizer, schedules: Schedules, rank: int,
                 device: torch.device, clip: Callable[[Optimizer], None] | None = None,
                 group=None, overlap: OverlappedAllReduce | None = None) -> None:
        self.vectors, self.optimizer, self.schedules = vectors, optimizer, schedules
        self.rank, self.device, self.clip, self.group = rank, device, clip, group
        self.overlap = overlap
        self.overlapped_updates = 0  # updates whose all-reduce ran during backward
        # This learner's pushed gradients, oldest first (None: the one in the overlapped round).
        self._pending: list[Tensor | None] = []
        self._in_round = False  # the push being made went round during its backward
        self._carried: Tensor | None = None  # its gradient, packed when it was carried
        self._own_integers: Tensor | None = None  # its integer buffers, when it did
        # Vectors are recycled: a fresh one of a large model is a page-faulting allocation. The
        # parameters' .grad are views of `_in_grads` until the next update, so it is never spare.
        self._spare: list[Tensor] = []
        self._in_grads: Tensor | None = None
        self._size = vectors.state_numel + len(vectors.params)
        offsets, start = [], vectors.numel
        for b in vectors.buffers:
            offsets.append((start, start + b.numel(), b.is_floating_point()))
            start += b.numel()
        self._integers = [(a, z) for a, z, floating in offsets if not floating]
        # The buffers as the last update left them (w_0's before any): a forward pass that began
        # after it changes the module's own, so validation at an epoch's end loads these.
        self._settled = (torch.cat([b.detach().reshape(-1).to(self.vectors.dtype) for b in vectors.buffers])
                         if vectors.buffers else None)

    def fill_push(self, message: Message) -> None:
        """Nothing yet: only the header travels; the gradient is packed once it left (`after_push`)."""
        self._in_round = self.overlap is not None and self.overlap.finish()
        if self._in_round and self._integers:
            self._own_integers = torch.cat([b.detach().reshape(-1).to(self.device, self.vectors.dtype)
                                            for b in self.vectors.buffers if not b.is_floating_point()])

    def carry(self, message: Message) -> None:
        """Lightning zeroes the gradients before validation (and one more backward may run): the
        gradient is packed onto the message now, until `before_push` takes it off again."""
        if message.payload is None and not (message.flags & Flag.UNUSABLE or self._in_round):
            message.payload = self._pack()

    def before_push(self, message: Message) -> None:
        self._carried, message.payload = message.payload, None  # only the header travels

    def after_push(self, message: Message) -> None:
        """The gradient, packed now (or when carried), kept until an update takes it."""
        carried, self._carried = self._carried, None
        if message.flags & Flag.UNUSABLE:
            return
        if self._in_round:  # already on its way round the all-reduce
            self._pending.append(None)
            return
        self._pending.append(carried if carried is not None else self._pack())

    def _pack(self) -> Tensor:
        spare = self._spare.pop() if self._spare else None
        vector, _ = self.vectors.push_vector(mask=True, device=self.device, out=spare)
        return vector

    def resolve(self, message: Message, check) -> None:
        """An epoch's end: validation runs on the last update's parameters (the module's own) and buffers."""
        if message.kind == Kind.EPOCH and self._settled is not None:
            state = self.vectors.state_vector()
            state[self.vectors.numel:] = self._settled.to(state.device)
            message.payload = state

    def close(self, timeout: float, failed: bool = False) -> list[str]:
        """The overlapped rounds complete (`OverlappedAllReduce.close`); after a failure only the
        hooks go: balancing is a collective of every learner, one of which may be dead."""
        if self.overlap is not None:
            self.overlap.release() if failed else self.overlap.close(timeout)
        return []

    def release(self) -> None:
        if self.overlap is not None:
            self.overlap.release()

    def take(self, message: Message) -> None:
        """An update: add this learner's share, all-reduce, step."""
        if message.payload is None:
            if message.kind == Kind.STOP and self._settled is not None:
                self.vectors.load_buffers(self._settled)
            return
        if message.kind not in (Kind.PARAMS, Kind.STOP):
            return
        if self._pending and self._pending[0] is None:
            assert self.overlap is not None, "a push that went round during backward"
            self._check_round(self.overlap.learners, message.payload)
            largest = self._largest_integers([], self._own_integers)
            reduced, recycled = self.overlap.result(), []
            self.overlapped_updates += 1
        else:
            k, mine = float(message.payload[0]), int(message.payload[1 + self.rank])
            # (only the overlapped round's push is None, and it is taken alone)
            pending = cast("list[Tensor]", self._pending)
            taken, stale = pending[:mine], pending[mine:]
            largest = self._largest_integers(taken)  # before the sum overwrites the first of them
            reduced, recycled = self._reduce(taken, k), taken[1:] + stale
        self._pending = []
        n, s = self.vectors.numel, self.vectors.state_numel
        load_gradients(self.vectors.params, reduced[:n], reduced[s:] > 0)
        if self._in_grads is not None and not (self.overlap and self.overlap.owns(self._in_grads)):
            recycled.append(self._in_grads)
        self._spare += recycled
        self._in_grads = reduced
        if self.clip is not None:
            self.clip(self.optimizer)
        self.optimizer.step()
        buffers = reduced[n:s]
        for (a, z), value in zip(self._integers, largest):
            buffers[a - n:z - n] = value
        self.vectors.load_buffers(buffers)
        if self._settled is not None:
            self._settled.copy_(buffers)
        self.schedules.after_update(message.version)
        if self.overlap is not None and message.payload[-1] > 0:  # the next update takes a round
            self.overlap.arm()

    def _reduce(self, taken: list[Tensor], k: float) -> Tensor:
        """The taken gradients weighted 1/K, summed over the learners."""
        if taken:  # summed in place into the first: no zero-filled vector of the model's size
            reduced = taken[0].mul_(1.0 / k)
            for vector in taken[1:]:
                reduced.add_(vector, alpha=1.0 / k)
        else:
            reduced = (self._spare.pop().zero_() if self._spare
                       else torch.zeros(self._size, dtype=self.vectors.dtype, device=self.device))
        dist.all_reduce(reduced, group=self.group)
        return reduced

    def _check_round(self, p: int, payload: Tensor) -> None:
        """An overlapped round is only ever taken whole: one gradient from every learner (P)."""
        if len(self._pending) != 1 or payload[0] != p or not bool((payload[1:1 + p] == 1).all()):
            raise RuntimeError(f"learner {self.rank}: the server's update {payload[:1 + p].tolist()} "
                               "does not take the overlapped round of every learner")

    def _largest_integers(self, taken: list[Tensor], own: Tensor | None = None) -> list[Tensor]:
        """Integer buffers (BatchNorm's count) take the largest pushed value."""
        if not self._integers:
            return []
        sizes = [z - a for a, z in self._integers]
        local = (own.clone() if own is not None else
                 torch.full((sum(sizes),), float("-inf"), dtype=self.vectors.dtype, device=self.device))
        for vector in taken:
            local = torch.maximum(local, torch.cat([vector[a:z] for a, z in self._integers]))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return list(torch.split(local, sizes))


class CollectivePath(ServerPath):
    """The sync family at scale: the server decides from headers, every learner steps."""

    name = "collective"
    learners_step_optimizer = True

    def __init__(self, local_exchange: Callable[..., CollectiveExchange] | None = None) -> None:
        # the learner side with local updates (`collective.local.CollectiveLocalExchange`, which
        # builds on this module's `CollectiveExchange`: given by the registry, not imported here)
        self.local_exchange = local_exchange

    def problem(self, variant_name: str, on_learner_failure: str, compensation: StalenessCompensation | None,
                clips: bool = False) -> str | None:
        if not kind_of(variant_name).synchronous:
            return (f"server='collective' serves the sync family (every update refreshes every learner), "
                    f"not {variant_name!r}: use server='central' or 'auto' (or 'sharded', without local updates)")
        # (clipping is fine: every learner holds the whole averaged gradient)
        return spread_path_problem(self.name, on_learner_failure, compensation)

    def traffic(self, numel: int, p: int, k: int) -> float:
        """A ring all-reduce: N(P - 1)/P values each way in its reduce-scatter and all-gather, whatever
        K (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009)."""
        return 2 * numel * (p - 1) / p

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return []  # its payloads meet in all-reduces on the default group

    def overlaps(self, variant: Variant, adaptive: AdaptiveK | None) -> bool:
        """Fully sync, and K-sync with K = P and no AdaSync changing K (`collective.overlap`)."""
        return variant.name in ("sync", "k_sync") and variant.k == variant.p > 1 and adaptive is None

    def build(self, ctx: RankContext) -> RankParts:
        # with local updates each learner's rounds step its schedulers (`LocalSteps`), not updates
        schedules = Schedules([] if ctx.options.outer is not None else ctx.schedulers, ctx.optimizer)
        if ctx.resume is not None:
            schedules.load_states(ctx.resume.get("schedulers", []))
        device, options = ctx.vectors.device, ctx.options
        overlap = None
        if options.overlap:  # every rank creates both groups, in this order (they are collective)
            overlap = OverlappedAllReduce(ctx.vectors, ctx.variant.p, dist.new_group(timeout=options.timeout),
                                          dist.new_group(backend="gloo", timeout=datetime.timedelta(
                                              seconds=options.shutdown_timeout)), device)
        exchange: CollectiveExchange
        if options.outer is not None:  # local updates: pseudo-gradients, every learner's outer step
            assert overlap is None, "an overlapped round would reduce an inner step's gradient"
            assert self.local_exchange is not None, "the registry gives the path its local updates' side"
            exchange = self.local_exchange(ctx.vectors, ctx.optimizer, schedules, ctx.rank, device,
                                           ctx.module, options.outer, options.local_steps)
        else:
            exchange = CollectiveExchange(ctx.vectors, ctx.optimizer, schedules, ctx.rank, device, ctx.clip,
                                          overlap=overlap)
        return RankParts(lambda endpoint: exchange,
                         CollectivePayloads(overlap=options.overlap) if ctx.rank == 0 else None)

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        return CollectiveCheckpoint(view)


class CollectiveCheckpoint(CheckpointPart):
    """Rank 0's learner holds the model: its module, optimizer, version and schedulers are saved.
    With local updates its copy of the server's state does: the server's parameters and buffers,
    the outer optimizer's state in the books, and (as on the central path) rank 0's inner
    optimizer in the optimizer's slot."""

    def read(self) -> tuple[dict, dict, dict] | None:
        server = getattr(self.view.learner_side, "server", None)  # `CollectiveLocalExchange`'s
        if server is None:
            return None
        return (server.named_state(self.view.module), copy.deepcopy(self.view.optimizer().state_dict()),
                {"outer_optimizer": copy.deepcopy(server.optimizer.state_dict())})

    def engine_state(self) -> dict:
        saved = self.view.server.state_dict()
        learner = self.view.learner()
        if learner is not None:
            saved.update(version=learner.version, updates=learner.version,
                         schedulers=learner.exchange.schedules.states())
        instant, self._held = self._instant(), None  # (the next checkpoint reads anew)
        if instant is not None:
            saved.update(instant[2])
        return saved
