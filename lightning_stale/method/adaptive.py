"""Gradually increasing synchrony: K grows as the training loss falls (AdaSync); and its mirror
for local updates, H shrinks as the training loss falls (AdaComm, `AdaptiveH`).

docs/method.md, "Gradually increasing synchrony"; Dutta, Wang, Joshi, "Slow and Stale Gradients Can
Win the Race" (arXiv 2003.10579, adaptive synchronicity). Training time is split into
wall-clock intervals of length T0; at the start of interval l,

    K_l = ceil(K_0 * sqrt(F(w_0) / F(w_{l T0}))),   capped at P, never decreasing.

Small K first (fast decay of the error), larger K later (a lower error floor): the schedule
follows the lower envelope of the fixed-K error-runtime curves.

F is not observable during training, so it is estimated from the training losses the engine
reports with its updates (each the mean mini-batch loss of the gradients averaged into one
update):

* F(w_0): the mean of the first ``window`` update losses (fewer if the first boundary comes
  first); they were computed at or near w_0.
* F(w_{l T0}): the mean of the last ``window`` update losses when the first update at or after
  the boundary l T0 is observed (a running mean over a short window smooths mini-batch noise
  while following the trend).

Pure logic with no torch: the simulated engine calls `observe` with virtual seconds after each
update, the real engine with wall seconds from its server thread. Losses must be positive (the
rule is a ratio of losses); non-finite losses are ignored, and a non-positive current estimate
counts as "converged" and raises K to its cap.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class _LossByInterval:
    """F's running estimate at interval boundaries, shared by `AdaptiveK` and `AdaptiveH` (see
    the module docstring): subclasses set ``interval_s`` and ``window``."""

    interval_s: float
    window: int

    def _reset_estimate(self) -> None:
        self.initial_loss: float | None = None
        self._first_losses: list[float] = []
        self._recent: deque[float] = deque(maxlen=self.window)
        self._next_boundary = self.interval_s

    @property
    def current_loss(self) -> float | None:
        """The running-mean estimate of F at the latest observation."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    def _at_boundary(self, time_s: float, loss: float) -> tuple[float, float] | None:
        """Take one update's loss; at the first update of a new interval, (F at the start, F
        now), else None."""
        loss = float(loss)
        if not math.isfinite(loss):
            return None
        self._recent.append(loss)
        if self.initial_loss is None:
            self._first_losses.append(loss)
            if len(self._first_losses) == self.window:
                self._freeze_initial_loss()
        if time_s < self._next_boundary:
            return None
        # Several intervals may have passed since the last update: the next boundary is the one
        # after the interval that time_s falls in.
        self._next_boundary = (math.floor(time_s / self.interval_s) + 1) * self.interval_s
        if self.initial_loss is None:
            self._freeze_initial_loss()
        assert self.initial_loss is not None and self.current_loss is not None
        return self.initial_loss, self.current_loss

    def _freeze_initial_loss(self) -> None:
        self.initial_loss = sum(self._first_losses) / len(self._first_losses)
        self._first_losses = []


class AdaptiveK(_LossByInterval):
    """The AdaSync schedule of K (see the module docstring).

    Args:
        k0: K_0, the K of the first interval.
        interval_s: T0, the interval length in the engine's seconds (virtual or wall).
        max_k: cap on K; None means P, which the engine sets with `limit`.
        window: how many recent update losses the running mean of F uses.

    Attributes:
        k: the K in force.
        history: (time_s, K) pairs, starting with (0.0, k0) and one more each time K grows.
    """

    def __init__(self, k0: int, interval_s: float, max_k: int | None = None,
                 window: int = 10) -> None:
        self.k0 = _check_int("AdaptiveK k0", k0, 1)
        interval_s = float(interval_s)
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"AdaptiveK interval_s must be a finite number > 0, "
                             f"got {interval_s!r}")
        self.interval_s = interval_s
        if max_k is not None:
            _check_int("AdaptiveK max_k", max_k, 1)
            if max_k < k0:
                raise ValueError(f"AdaptiveK max_k={max_k} is below k0={k0}")
        self.max_k = max_k
        self.window = _check_int("AdaptiveK window", window, 1)
        self.reset()

    @classmethod
    def create(cls, spec: Any, k0: int) -> AdaptiveK | None:
        """From None, an `AdaptiveK`, a mapping of the constructor's arguments (``k0`` defaults to
        the given one), or a number: the interval T0 in seconds, starting from ``k0``."""
        if spec is None or isinstance(spec, AdaptiveK):
            return spec
        if isinstance(spec, Mapping):
            return cls(**{"k0": k0, **dict(spec)})
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(k0, float(spec))
        raise ValueError(f"adaptive_k must be None, an AdaptiveK, a dict of its arguments or an "
                         f"interval in seconds, got {spec!r}")

    def reset(self) -> None:
        """Forget everything observed: K back to k0."""
        self.k = self.k0
        self.history: list[tuple[float, int]] = [(0.0, self.k0)]
        self._reset_estimate()

    def limit(self, p: int) -> None:
        """Cap K at P learners (the engine calls this); K_0 must not exceed P."""
        _check_int("the number of learners P", p, 1)
        if self.k0 > p:
            raise ValueError(f"AdaptiveK k0={self.k0} exceeds the number of learners P={p}")
        self.max_k = p if self.max_k is None else min(self.max_k, p)

    def target_k(self, initial_loss: float, current_loss: float) -> int:
        """ceil(K_0 sqrt(F(w_0) / F(w))), capped at max_k (not yet the never-decrease rule)."""
        cap = self.max_k if self.max_k is not None else math.inf
        if current_loss <= 0:
            return int(cap) if math.isfinite(cap) else self.k
        # The small tolerance keeps an exact ratio such as 2 * sqrt(4) from rounding up to 5.
        k = math.ceil(self.k0 * math.sqrt(max(initial_loss, 0.0) / current_loss) - 1e-9)
        return int(min(max(k, 1), cap))

    def observe(self, time_s: float, loss: float) -> int | None:
        """Report one update's loss at engine time ``time_s``; returns the new K when an interval
        boundary was crossed and K grew, else None."""
        losses = self._at_boundary(time_s, loss)
        if losses is None:
            return None
        k = max(self.k, self.target_k(*losses))
        if k == self.k:
            return None
        self.k = k
        self.history.append((float(time_s), k))
        return k

    def __repr__(self) -> str:
        return (f"AdaptiveK(k0={self.k0}, interval_s={self.interval_s}, max_k={self.max_k}, "
                f"window={self.window})")


class AdaptiveH(_LossByInterval):
    """AdaComm's schedule of the communication period H: H shrinks as the training loss falls.

    Wang and Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
    Trade-off in Local-Update SGD" (SysML 2019), AdaComm: training time is split into intervals
    of length T0; at the start of interval l the period becomes

        H_l = ceil(sqrt(F(x_l) / F(x_0)) * H_0),

    never below 1 (the paper's rule for a fixed learning rate, F's floor taken as 0; its variant
    for a changing rate is not provided). Infrequent averaging first (fast progress per second),
    frequent averaging later (a lower error floor): the mirror of AdaSync's growing K (`AdaptiveK`). As AdaSync's K
    never decreases, H here never grows: a noisy loss estimate keeps the H in force.

    F is estimated as `AdaptiveK` estimates it, from the losses of the updates (with local
    updates, each the mean loss of the inner steps averaged into one update): F(x_0) is the mean
    of the first ``window`` update losses, F(x_l) the mean of the last ``window`` ones when the
    first update at or after the boundary l T0 is observed. A non-positive loss estimate counts
    as "converged" and sets H to 1. Pure logic with no torch: the simulated engine calls
    `observe` with virtual seconds after each update, and learners take the new H at the start
    of their next round.

    Args:
        h0: H_0, the H of the first interval (``local_steps``).
        interval_s: T0, the interval length in the engine's seconds.
        window: how many recent update losses the running mean of F uses.

    Attributes:
        h: the H in force.
        history: (time_s, H) pairs, starting with (0.0, h0) and one more each time H shrinks.
    """

    def __init__(self, h0: int, interval_s: float, window: int = 10) -> None:
        self.h0 = _check_int("AdaptiveH h0 (local_steps)", h0, 1)
        if self.h0 == 1:
            raise ValueError("AdaptiveH shrinks H from h0 = local_steps, which is 1 here, the "
                             "least H already; give local_steps > 1 or no adaptive_h")
        interval_s = float(interval_s)
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"AdaptiveH interval_s must be a finite number > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.window = _check_int("AdaptiveH window", window, 1)
        self.reset()

    @classmethod
    def create(cls, spec: Any, h0: int) -> AdaptiveH | None:
        """From None, an `AdaptiveH`, a mapping of the constructor's arguments (``h0`` defaults to
        the given one, ``local_steps``, and must equal it), or a number: the interval T0 in
        seconds."""
        if spec is None:
            return None
        if isinstance(spec, AdaptiveH):
            schedule = spec
        elif isinstance(spec, Mapping):
            schedule = cls(**{"h0": h0, **{str(k): v for k, v in spec.items()}})
        elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
            schedule = cls(h0, float(spec))
        else:
            raise ValueError(f"adaptive_h must be None, an AdaptiveH, a dict of its arguments "
                             f"(interval_s, window) or an interval in seconds, "
                             f"got {spec!r}")
        if schedule.h0 != h0:
            raise ValueError(f"local_steps={h0} disagrees with adaptive_h's h0={schedule.h0}; give one")
        return schedule

    def reset(self) -> None:
        """Forget everything observed: H back to h0."""
        self.h = self.h0
        self.history: list[tuple[float, int]] = [(0.0, self.h0)]
        self._reset_estimate()

    def target_h(self, initial_loss: float, current_loss: float) -> int:
        """ceil(sqrt(F(x_l) / F(x_0)) * H_0), at least 1 (not yet the never-grow rule)."""
        if current_loss <= 0:
            return 1
        if initial_loss <= 0:
            return self.h
        # The small tolerance keeps an exact ratio such as sqrt(1/4) * 8 = 4 from rounding up to 5.
        h = math.ceil(math.sqrt(current_loss / initial_loss) * self.h0 - 1e-9)
        return max(h, 1)

    def observe(self, time_s: float, loss: float) -> int | None:
        """Report one update's loss at engine time ``time_s``; returns the new H when an interval
        boundary was crossed and H shrank, else None."""
        losses = self._at_boundary(time_s, loss)
        if losses is None:
            return None
        h = min(self.h, self.target_h(*losses))
        if h == self.h:
            return None
        self.h = h
        self.history.append((float(time_s), h))
        return h

    def __repr__(self) -> str:
        return f"AdaptiveH(h0={self.h0}, interval_s={self.interval_s}, window={self.window})"
