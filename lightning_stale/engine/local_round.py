"""A learner's local updates (docs/how-to/local-updates.md): its round of H steps of the module's
own optimizer (the inner optimizer) between two pushes, the inner optimizer's per-parameter state
each learner keeps between rounds (as DiLoCo keeps it: Douillard et al. 2023), and the push that
ends a round, the pseudo-gradient, pulled minus current parameters. The simulated engine
(`strategies.local_updates.LocalUpdatesMixin`) and the real one
(`engine.distributed.local_steps.LocalSteps`) both run their rounds with these."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stale.engine.state import Contribution, ModelVectors


# ------------------------------------------------------------------ inner optimizer states
def optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def take_inner_state(optimizer: Optimizer) -> list[dict | None]:
    """Remove the per-parameter state (momentum, moments, step counts) from ``optimizer`` and
    return it, one entry per parameter in group order (None: no state yet)."""
    return [optimizer.state.pop(p, None) for p in optimizer_params(optimizer)]


def give_inner_state(optimizer: Optimizer, states: Sequence[dict | None] | None) -> None:
    """Make ``states`` (from `take_inner_state`; None: a fresh learner) the optimizer's state."""
    optimizer.state.clear()
    if states is None:
        return
    for param, state in zip(optimizer_params(optimizer), states):
        if state is not None:
            optimizer.state[param] = state


def cloned_state(states: Sequence[dict | None] | None) -> list[dict | None] | None:
    """A copy of `take_inner_state`'s result whose tensors the inner steps may change in place
    while the stored one stays as it was (a checkpoint taken in the middle of a round)."""
    if states is None:
        return None
    return [None if s is None else {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                                    for k, v in s.items()} for s in states]


class LocalRound:
    """One learner's H inner steps between two pushes, on either engine.

    Args:
        finish: on the simulated engine, the learner's `Finish` on the virtual clock (its push
            at the round's end); None on the real one.
        local_steps: H.
        optimizer: the module's optimizer, which takes this learner's inner state now.
        state: that state (`take_inner_state` of its previous round), None for a fresh one.
        give_state: False where ``optimizer`` already holds a copy of ``state`` (the real
            engine's learner, whose optimizer keeps its state between rounds): one model-sized
            copy fewer per round.
    """

    def __init__(self, finish: Any, local_steps: int, optimizer: Optimizer,
                 state: Sequence[dict | None] | None, give_state: bool = True) -> None:
        self.finish, self.local_steps = finish, local_steps
        self.done = 0
        self.losses: list[float] = []
        self.present: Tensor | None = None  # which parameters got a gradient in some step
        self.paused: Tensor | None = None  # the learner's parameters while validation runs
        if give_state:
            give_inner_state(optimizer, cloned_state(state))

    def step(self, optimizer: Optimizer, params: Sequence[Tensor], loss: float, overflow: bool) -> bool:
        """One inner step on the gradients just computed (skipped on an overflow, as a grad
        scaler skips it, but counted); returns whether the round is complete."""
        seen = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
        self.present = seen if self.present is None else self.present | seen
        if not overflow:
            optimizer.step()
        self.done += 1
        self.losses.append(loss)
        return self.done >= self.local_steps

    @property
    def loss(self) -> float:
        """The mean loss of the round's mini-batches (the push's loss)."""
        return math.fsum(self.losses) / len(self.losses)

    def contribution(self, vectors: ModelVectors, pulled: Tensor) -> Contribution:
        """The push: the pseudo-gradient (``pulled`` minus the learner's current parameters), the
        learner's buffers and, where some parameter got no gradient in the whole round, which
        ones did (the outer optimizer leaves the others alone, as the inner one did)."""
        current = vectors.state_vector()
        pseudo = pulled[:vectors.numel] - current[:vectors.numel]
        buffers = current[vectors.numel:] if vectors.buffers else None
        present = None if self.present is None or bool(self.present.all()) else self.present
        return Contribution(pseudo, buffers, present)


def pseudo_gradient_push(vectors: ModelVectors, pulled: Tensor, present: Tensor | None = None,
                         device: torch.device | None = None, out: Tensor | Any | None = None,
                         mask: bool = False) -> tuple[Tensor, bool]:
    """A round's push in `ModelVectors.push_vector`'s layout, so that the server splits it as a
    gradient: the pseudo-gradient (``pulled``, the `state_vector` the round started from, minus
    the learner's current parameters), its current buffers and, where some parameter got no
    gradient in the whole round (``present``: which did, one entry per parameter) or ``mask``
    asks for it always, the presence mask; and whether it holds one. ``out``: a vector, or a
    function of the size giving one (a shared-memory slot) or None; the push is written into it
    in place, without an intermediate copy."""
    device = torch.device("cpu") if device is None else device
    n, s = vectors.numel, vectors.state_numel
    masked = mask or (present is not None and not bool(present.all()))
    total = s + (len(vectors.params) if masked else 0)
    place = out(total) if callable(out) else out
    if place is None or place.numel() != total:
        place = torch.empty(total, dtype=vectors.dtype, device=device)
    vectors.state_vector(out=place[:s])  # the current parameters, then the buffers
    torch.sub(pulled[:n].to(place.device), place[:n], out=place[:n])
    if masked:
        place[s:] = 1.0 if present is None else present.to(device=place.device, dtype=place.dtype)
    return place, masked
