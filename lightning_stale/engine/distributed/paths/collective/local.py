"""Local updates on the collective path (docs/how-to/local-updates.md; local SGD: Wang and Joshi,
"Cooperative SGD", JMLR 2021; DiLoCo: Douillard et al. 2023).

A learner's round is H steps of the module's own optimizer (`local_steps.LocalSteps`); its push is
a header, its pseudo-gradient (the parameters the round started from minus where it ended) stays
with the learner until an update takes it, as a gradient does on this path. The K pseudo-gradients
of an update meet in the path's one all-reduce, weighted 1/K, and every learner applies the outer
optimizer to its own copy of the server's parameters (`ServerState`, the central server's class),
so that the outer optimizer's state is replicated on every learner as the parameters are. The new
parameters and buffers are where every learner's next round starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stale.engine.distributed.messages import Kind, Message
from lightning_stale.engine.distributed.paths.collective.path import CollectiveExchange
from lightning_stale.engine.local_round import pseudo_gradient_push
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import Contribution, ModelVectors, ServerState


class CollectiveLocalExchange(CollectiveExchange):
    """A learner's side of the collective path with local updates (see the module docstring).

    Args:
        module: the learner's module, holding w_0 (every learner's, broadcast from rank 0).
        optimizer: the module's own, the inner optimizer.
        outer: builds the outer optimizer over the server's parameters (`ServerState`'s ``outer``).
        local_steps: H (the server's LR schedules, none here, would step H times per update).
    """

    def __init__(self, vectors: ModelVectors, optimizer: Optimizer, schedules: Schedules, rank: int,
                 device: torch.device, module: nn.Module, outer: Callable[[Sequence[Tensor]], Optimizer],
                 local_steps: int, group=None) -> None:
        super().__init__(vectors, optimizer, schedules, rank, device, clip=None, group=group)
        # Every learner's copy of the server's parameters, buffers and outer optimizer: equal on
        # every learner, since each applies the same all-reduced pseudo-gradients to the same w_0.
        self.server = ServerState(module, optimizer, outer=outer, steps_per_update=local_steps)
        self.pulled: Tensor = self.server.vectors.state_vector(device=vectors.device)  # where rounds start
        self.present: Tensor | None = None  # the round's parameters that got a gradient (`LocalSteps`)

    def _pack(self) -> Tensor:
        """The push in the path's layout: pseudo-gradient, the learner's buffers, presence mask."""
        spare = self._spare.pop() if self._spare else None
        return pseudo_gradient_push(self.vectors, self.pulled, self.present, self.device,
                                    out=spare, mask=True)[0]

    def resolve(self, message: Message, check) -> None:
        """An epoch's end: validation runs on the server's parameters and buffers, not the round's."""
        if message.kind == Kind.EPOCH:
            message.payload = self.server.vectors.state_vector(device=self.vectors.device)

    def take(self, message: Message) -> None:
        """An update: the learners' pseudo-gradients all-reduced, the outer step, the new
        parameters loaded (a round in progress is abandoned by `LocalSteps`); a message without
        an update (the first parameters, a stop after none) loads the server's state as it is."""
        if message.kind not in (Kind.PARAMS, Kind.STOP):
            return
        if message.payload is not None:
            self._outer_step(message.payload)
        self.vectors.load_state(self.pulled)
        if self._settled is not None:
            self._settled.copy_(self.pulled[self.vectors.numel:].to(self._settled.device))

    def _outer_step(self, payload: Tensor) -> None:
        k, mine = float(payload[0]), int(payload[1 + self.rank])
        pending = cast("list[Tensor]", self._pending)  # (no overlapped rounds with local updates)
        taken, stale = pending[:mine], pending[mine:]
        largest = self._largest_integers(taken)  # before the sum overwrites the first of them
        reduced = self._reduce(taken, k)
        self._pending = []
        n, s = self.vectors.numel, self.vectors.state_numel
        buffers = reduced[n:s]
        for (a, z), value in zip(self._integers, largest):
            buffers[a - n:z - n] = value
        present = reduced[s:] > 0
        # (one contribution, the mean already: `apply` steps on it as it is; the server's .grad view it)
        self.server.apply([Contribution(reduced[:n], buffers if self.vectors.buffers else None,
                                        None if bool(present.all()) else present)])
        if self._in_grads is not None:
            self._spare.append(self._in_grads)
        self._spare += taken[1:] + stale
        self._in_grads = reduced
        self.pulled = self.server.vectors.state_vector(device=self.vectors.device)
