"""The collective path as a plug-in (`paths.base.ServerPath`): every learner holds the model and
applies each update, whose gradients meet in one all-reduce (`collective.sides`)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from lightning_stale.engine.distributed.paths.base import (
    CheckpointPart,
    CheckpointView,
    RankContext,
    RankParts,
    ServerPath,
    spread_path_problem,
)
from lightning_stale.engine.distributed.paths.collective.overlap import OverlappedAllReduce
from lightning_stale.engine.distributed.paths.collective.sides import CollectiveExchange, CollectivePayloads
from lightning_stale.engine.schedules import Schedules
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant, kind_of


class CollectivePath(ServerPath):
    """The sync family at scale: the server decides from headers, every learner steps."""

    name = "collective"

    def problem(self, variant_name: str, on_learner_failure: str, compensation: StalenessCompensation | None,
                clips: bool = False) -> str | None:
        if not kind_of(variant_name).synchronous:
            return (f"server='collective' serves the sync family (every update refreshes every learner), "
                    f"not {variant_name!r}: use server='sharded', 'central' or 'auto'")
        # (clipping is fine: every learner holds the whole averaged gradient)
        return spread_path_problem(self.name, on_learner_failure, compensation)

    def traffic(self, numel: int, p: int, k: int) -> float:
        """A ring all-reduce of the N-value sum: each rank sends and receives N(P - 1)/P values in
        its reduce-scatter and as many in its all-gather, 2N(P - 1)/P, whatever K (Patarasuk and
        Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009)."""
        return 2 * numel * (p - 1) / p

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return []  # its payloads meet in all-reduces on the default group

    def overlaps(self, variant: Variant, adaptive: AdaptiveK | None) -> bool:
        """Fully sync, and K-sync with K = P and no AdaSync changing K (`collective.overlap`)."""
        return variant.name in ("sync", "k_sync") and variant.k == variant.p > 1 and adaptive is None

    def build(self, ctx: RankContext) -> RankParts:
        schedules = Schedules(ctx.schedulers, ctx.optimizer)
        if ctx.resume is not None:
            schedules.load_states(ctx.resume.get("schedulers", []))
        device, options = ctx.vectors.device, ctx.options
        overlap = None
        if options.overlap:  # every rank creates both groups, in this order (they are collective)
            overlap = OverlappedAllReduce(ctx.vectors, ctx.variant.p, dist.new_group(timeout=options.timeout),
                                          dist.new_group(backend="gloo", timeout=datetime.timedelta(
                                              seconds=options.shutdown_timeout)), device)
        exchange = CollectiveExchange(ctx.vectors, ctx.optimizer, schedules, ctx.rank, device, ctx.clip,
                                      overlap=overlap)
        return RankParts(lambda endpoint: exchange,
                         CollectivePayloads(overlap=options.overlap) if ctx.rank == 0 else None)

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        return CollectiveCheckpoint(view)


class CollectiveCheckpoint(CheckpointPart):
    """Every learner holds the model, rank 0's too: its module and optimizer are the checkpoint's,
    and its version and schedulers are the books'."""

    def engine_state(self) -> dict:
        saved = self.view.server.state_dict()
        learner = self.view.learner()
        if learner is not None:
            saved.update(version=learner.version, updates=learner.version,
                         schedulers=learner.exchange.schedules.states())
        return saved
