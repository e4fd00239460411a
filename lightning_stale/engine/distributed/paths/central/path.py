"""The central path as a plug-in (`paths.base.ServerPath`): rank 0's server holds the model."""

from __future__ import annotations

import copy
from typing import Any

from lightning_stale.engine.distributed.paths.base import (
    CheckpointPart,
    CheckpointView,
    RankContext,
    RankParts,
    ServerPath,
)
from lightning_stale.engine.distributed.paths.central.sides import CentralExchange, CentralPayloads
from lightning_stale.engine.state import ServerState
from lightning_stale.method.compensation import StalenessCompensation


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
        """Rank 0 receives a gradient (N values) from each of the K pushes of an update and sends
        parameters (N values) back; one push in P is its own learner's, which crosses no link:
        2N K (P - 1) / P values, so 2N(P - 1) per P gradients, P times a ring all-reduce's
        share (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms", 2009)."""
        return 2 * numel * k * (p - 1) / p

    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        return [pair for learner in range(1, p) for pair in ((learner, 0), (0, learner))]

    def build(self, ctx: RankContext) -> RankParts:
        vectors, channels = ctx.vectors, ctx.channels
        if ctx.rank != 0:
            on_host = not channels  # (device channels: the payloads stay on the device)
            return RankParts(lambda endpoint: CentralExchange(vectors, endpoint.push_buffer) if on_host
                             else CentralExchange(vectors, device=vectors.device))
        # Rank 0's pushes stay on the device, beside the server; so do those on device channels.
        on_device = frozenset({0, *(dst for src, dst in channels if src == 0)})
        return RankParts(lambda endpoint: CentralExchange(vectors, device=vectors.device),
                         CentralPayloads(vectors, on_device=on_device),
                         ServerState(ctx.module, ctx.optimizer, ctx.schedulers, clip=ctx.clip))

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        return CentralCheckpoint(view)


class CentralCheckpoint(CheckpointPart):
    """The server's `ServerState` on rank 0, read at one instant for all the parts of one
    checkpoint, which Lightning reads one after the other while the server steps on."""

    def __init__(self, view: CheckpointView) -> None:
        super().__init__(view)
        self._held: tuple[dict, dict, dict] | None = None

    def module_state(self, state_dict: dict) -> dict:
        if not self.live:
            return state_dict
        self._held = None  # a checkpoint begins here: its instant is now
        state_dict.update(self._instant()[0])
        return state_dict

    def optimizer_state(self, own: dict) -> dict:
        return self._instant()[1] if self.live else own

    def engine_state(self) -> dict:
        saved = self._instant()[2] if self.live else self.view.server.state_dict()
        self._held = None  # the next checkpoint reads anew
        return saved

    def finish(self) -> None:
        server = self.view.server
        with server.reading():
            self.view.optimizer().load_state_dict(server.core.state.optimizer.state_dict())

    def _instant(self) -> tuple[dict, dict, dict]:
        """The server's parameters, optimizer state and books at one instant, copied (the server
        steps in place once its lock is released)."""
        if self._held is None:
            server: Any = self.view.server
            with server.reading():
                state = server.core.state
                self._held = (state.named_state(self.view.module), copy.deepcopy(state.optimizer.state_dict()),
                              copy.deepcopy(server.core.state_dict()))
        return self._held
