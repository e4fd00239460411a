"""Staleness compensation: a per-gradient weight on the server step (docs/method.md, "Beyond the base
method").

A stale gradient g(w_tau) was computed at parameters that the server has since moved away from.
Both rules here shrink its step. They are expressed as a multiplicative weight a_l on the
gradient inside the server's average, so that for plain SGD the update becomes

    w_{j+1} = w_j - (eta / K) * sum_l a_l g(w_{tau(l,j)}, xi_{l,j}),

i.e. gradient l is applied with the step eta_l = a_l * eta. The engines pass the weights to
`ServerState.apply(gradients, weights)`. For optimizers other than plain SGD (momentum, Adam) the
weight scales the gradient fed to the optimizer, which is the same thing only for SGD.

Rules:

* ``"inverse"``: eta_l = eta / max(1, s_l), s_l = j - tau(l, j) the staleness in updates.
  Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016.
* ``"norm"``: eta_l = min(C / ||w_j - w_tau(l,j)||^2, eta_max), the variable learning rate of
  Dutta, Wang, Joshi, "Slow and Stale Gradients Can Win the Race" (arXiv 2003.10579,
  async SGD with a staleness-dependent learning rate). A fresh gradient (distance 0) gets
  eta_max. This rule needs the parameters w_tau at every gradient's version: an engine using it
  must keep the flat parameters of every version some pending gradient was computed at until the
  update that applies it (the simulated engine keeps those snapshots anyway).

Pure functions: no torch import; the distance is computed with operators that work on torch
tensors and numpy arrays alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

COMPENSATION_MODES = ("inverse", "norm")


def inverse_staleness(staleness: int) -> float:
    """Weight 1 / max(1, s) for a gradient of staleness s (Zhang et al., IJCAI 2016)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 / max(1, staleness)


def norm_adaptive(distance_sq: float, c: float, eta_max: float, eta: float) -> float:
    """Weight min(C / ||w_j - w_tau||^2, eta_max) / eta (Dutta, Wang, Joshi, arXiv 2003.10579).

    Args:
        distance_sq: ||w_j - w_tau||^2 between the current parameters and those the gradient was
            computed at; 0 for a fresh gradient, which gets eta_max.
        c: the constant C (> 0), in units of learning rate times squared parameter distance.
        eta_max: the largest step (> 0).
        eta: the base learning rate of the optimizer (> 0); the result is the ratio to it.
    """
    if not (c > 0 and eta_max > 0 and eta > 0):
        raise ValueError(f"need c, eta_max and eta > 0, got c={c}, eta_max={eta_max}, eta={eta}")
    if distance_sq < 0 or math.isnan(distance_sq):
        raise ValueError(f"distance_sq must be a number >= 0, got {distance_sq}")
    step = eta_max if distance_sq == 0 else min(c / distance_sq, eta_max)
    return step / eta


class StalenessCompensation:
    """Per-update gradient weights for one of the rules in the module docstring.

    Args:
        mode: ``"inverse"`` (1 / max(1, s)) or ``"norm"`` (min(C / ||w_j - w_tau||^2, eta_max)).
        c: C of the ``"norm"`` rule (required for it, > 0).
        eta_max: eta_max of the ``"norm"`` rule; default: the base learning rate, so that a fresh
            gradient keeps its step and stale ones get at most that.
    """

    def __init__(self, mode: str = "inverse", c: float | None = None,
                 eta_max: float | None = None) -> None:
        if mode not in COMPENSATION_MODES:
            raise ValueError(f"unknown staleness compensation {mode!r}; choose one of "
                             f"{', '.join(COMPENSATION_MODES)} (or None for no compensation)")
        if mode == "norm":
            if c is None or not c > 0:
                raise ValueError(f"staleness compensation 'norm' needs c > 0, got c={c!r}")
            if eta_max is not None and not eta_max > 0:
                raise ValueError(f"eta_max must be > 0, got {eta_max!r}")
        self.mode = mode
        self.c = None if c is None else float(c)
        self.eta_max = None if eta_max is None else float(eta_max)

    @property
    def needs_parameters(self) -> bool:
        """Whether `weights` needs the parameters at each gradient's version."""
        return self.mode == "norm"

    @classmethod
    def create(cls, spec: Any) -> StalenessCompensation | None:
        """From None, a mode name, a mapping of the constructor's arguments, or an instance."""
        if spec is None or isinstance(spec, StalenessCompensation):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, Mapping):
            return cls(**dict(spec))
        raise ValueError(f"unknown staleness compensation {spec!r}; give None, one of "
                         f"{', '.join(COMPENSATION_MODES)}, a dict of StalenessCompensation's "
                         "arguments or a StalenessCompensation")

    def weights(self, update: Any, current_params: Any = None,
                params_at: Callable[[int], Any] | Mapping[int, Any] | None = None,
                lr: float | None = None) -> list[float]:
        """One weight per gradient of ``update`` (a `lightning_stale.method.rules.Update`).

        Args:
            update: its ``gradients`` (pushes with ``version``) and ``staleness``.
            current_params: flat parameters w_j the update is applied to ("norm" only).
            params_at: version -> flat parameters at that version, a callable or a mapping
                ("norm" only).
            lr: the optimizer's base learning rate eta ("norm" only).
        """
        if self.mode == "inverse":
            return [inverse_staleness(s) for s in update.staleness]
        if current_params is None or params_at is None or lr is None:
            raise ValueError("staleness compensation 'norm' needs the current parameters, the "
                             "parameters at each gradient's version and the learning rate")
        assert self.c is not None  # the constructor requires c for "norm"
        lookup = params_at.__getitem__ if isinstance(params_at, Mapping) else params_at
        eta_max = lr if self.eta_max is None else self.eta_max
        weights = []
        for push in update.gradients:
            difference = current_params - lookup(push.version)
            distance_sq = float((difference * difference).sum())
            weights.append(norm_adaptive(distance_sq, self.c, eta_max, lr))
        return weights

    def __repr__(self) -> str:
        if self.mode == "inverse":
            return "StalenessCompensation(mode='inverse')"
        return f"StalenessCompensation(mode='norm', c={self.c!r}, eta_max={self.eta_max!r})"

