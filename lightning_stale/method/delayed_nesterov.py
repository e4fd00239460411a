"""The delayed Nesterov momentum (DN) outer optimizer of asynchronous local SGD: Liu, Chhaparia,
Douillard, Kale, Rusu, Shen, Szlam and Ranzato, "Asynchronous Local-SGD Training for Language
Modeling" (arXiv 2401.09135, v2 2024), Algorithm 3 "Delayed Nesterov Update".

Applying Nesterov momentum to every stale pseudo-gradient one at a time decays the momentum
faster and moves the parameters further than one step on their mean (the paper's Eq. 5), which
a smaller learning rate cannot undo. DN keeps the momentum fixed for N server updates while
summing their pseudo-gradients, moves the parameters by each pseudo-gradient / N in between, and
updates the momentum with the mean of the N every N-th update. It is a ``torch.optim.Optimizer``,
so it is an ``outer_optimizer`` of the strategies like any other
(docs/how-to/local-updates.md):

    outer_optimizer={"class_path": "lightning_stale.method.delayed_nesterov.DelayedNesterov",
                     "init_args": {"lr": 0.7, "momentum": 0.9, "period": 4}}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch.optim import Optimizer


class DelayedNesterov(Optimizer):
    """Delayed Nesterov momentum (DN), the outer optimizer of asynchronous local SGD (Liu et al.,
    "Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135, Algorithm 3).

    At server update t, with ``p.grad`` the update's pseudo-gradient g_t, learning rate eps,
    momentum decay beta, period N and momentum activation c (Algorithm 3; m_0 = 0, Delta = 0):

        Delta <- Delta + g_t
        if (t + 1) % N == 0:                     # every N-th update
            m_{t+1} = beta m_t + Delta / N
            theta  <- theta - eps ((1 - c N + c) beta m_{t+1} + g_t / N)
            Delta <- 0
        else:                                    # the momentum waits
            m_{t+1} = m_t
            theta  <- theta - eps (c beta m_{t+1} + g_t / N)

    With c = 0 (the paper's default) the steps between two momentum updates are plain gradient
    descent on g_t / N, and the N steps of a cycle together move theta by
    -eps (Delta / N + beta m_new): one Nesterov step on the mean of the cycle's pseudo-gradients.
    With c = 1/N each of the N steps carries 1/N of the momentum term. With N = 1 it is
    Nesterov momentum on every update (the paper's Eq. 4), ``torch.optim.SGD(lr, momentum=beta,
    nesterov=True)``, whatever c.

    Each parameter counts the server updates it takes part in (t). A parameter with no
    pseudo-gradient at an update (``grad`` None: no round of the update touched it) is skipped,
    as torch's optimizers skip it, and its cycle waits with it. The counts, the momentum and the
    sums are the optimizer's state, so ``state_dict`` and a checkpoint keep a cycle in progress.

    Args:
        params: the parameters (or parameter groups; each group may set its own values).
        lr: eps, the outer learning rate, >= 0 (DiLoCo's 0.7 by default).
        momentum: beta, the momentum decay, in (0, 1) (0.9 by default).
        period: N, the number of server updates between two momentum updates, an integer >= 1
            (the paper's "buffer size" or "delay period"; it tries 4, 8 and 16, and 4 is the
            default here).
        momentum_activation: c, in [0, 1/N]: the share of the momentum term applied at each
            update between two momentum updates (0 by default, the paper's choice).
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.7, momentum: float = 0.9, period: int = 4,
                 momentum_activation: float = 0.0) -> None:
        defaults = {"lr": lr, "momentum": momentum, "period": period,
                    "momentum_activation": momentum_activation}
        _check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])  # a group's own values too, defaults filled in

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One server update: every parameter with a ``grad`` takes Algorithm 3's step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["period"]
            c = group["momentum_activation"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DelayedNesterov does not take sparse gradients; use dense "
                                       "parameters (the outer optimizer's pseudo-gradients are dense)")
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0  # t: the server updates this parameter took part in
                    state["momentum_buffer"] = torch.zeros_like(p)  # m
                    state["pseudo_gradient_sum"] = torch.zeros_like(p)  # Delta
                m, delta = state["momentum_buffer"], state["pseudo_gradient_sum"]
                delta.add_(g)
                if (state["step"] + 1) % n == 0:
                    m.mul_(beta).add_(delta, alpha=1.0 / n)
                    delta.zero_()
                    share = 1.0 - c * n + c
                else:
                    share = c
                p.add_(g, alpha=-lr / n)
                if share != 0.0:
                    p.add_(m, alpha=-lr * share * beta)
                state["step"] += 1
        return loss


def _check_group(group: dict[str, Any]) -> None:
    """Refuse a value outside Algorithm 3's ranges, naming it."""
    lr, beta = group["lr"], group["momentum"]
    n, c = group["period"], group["momentum_activation"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"DelayedNesterov: lr must be a finite number >= 0, got {lr!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise ValueError(f"DelayedNesterov: momentum (beta) must be in (0, 1), got {beta!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"DelayedNesterov: period (N) must be an integer >= 1, got {n!r}")
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0 / n:
        raise ValueError(f"DelayedNesterov: momentum_activation (c) must be in [0, 1/period] = "
                         f"[0, {1.0 / n:g}], got {c!r}")
