"""Straggler models: the extra delay (seconds) added to each learner's mini-batch gradient.

docs/method.md models the compute time X of one mini-batch gradient as i.i.d. across learners and
mini-batches, exponential or shifted exponential (Dutta et al., AISTATS 2018). A `DelayModel`
draws that time, or the straggling part of it, for one learner at a time:

    delay = model.sample(learner)

Every random model gives each learner its own reproducible stream, seeded by
``numpy.random.default_rng([seed, learner])``, so a learner's delays never depend on how
often the other learners were sampled or in which order. ``reset()`` restarts all streams.

Recorded delays (`Trace`, `TraceRecorder`, `RecordingDelay`) live in `lightning_stale.delays.traces`
and are re-exported here, so every straggler model is ``lightning_stale.delays.<Name>``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

# Draws are made this many at a time so that `sample` on the hot path is a list lookup.
_BLOCK_SIZE = 256


def _check_learner_index(learner: int) -> int:
    if isinstance(learner, bool) or int(learner) != learner or learner < 0:
        raise ValueError(f"learner index must be an integer >= 0, got {learner!r}")
    return int(learner)


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


class DelayModel:
    """Base class. Subclasses draw the delay of one mini-batch gradient of one learner.

    Attributes:
        seed: the seed of the random streams; None for deterministic models.
    """

    seed: int | None = None
    _fields: tuple[str, ...] = ()  # constructor arguments shown by repr, for logs

    def sample(self, learner: int) -> float:
        """The next delay (seconds) of `learner`'s own stream."""
        raise NotImplementedError

    def reset(self) -> None:
        """Restart every learner's stream from the seed."""

    @property
    def mean(self) -> float:
        """Expected delay in seconds, the same for every learner."""
        raise NotImplementedError

    def mean_of(self, learner: int) -> float:
        """Expected delay of `learner`; the common `mean` unless a subclass says otherwise."""
        _check_learner_index(learner)
        return self.mean

    def check_learners(self, num_learners: int) -> None:
        """Raise ValueError if this model cannot serve learners 0 .. num_learners - 1."""
        if isinstance(num_learners, bool) or int(num_learners) != num_learners or num_learners < 1:
            raise ValueError(f"num_learners must be an integer >= 1, got {num_learners!r}")

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({args})"


class NoDelay(DelayModel):
    """No straggling: every delay is 0."""

    def sample(self, learner: int) -> float:
        return 0.0

    @property
    def mean(self) -> float:
        return 0.0


class Constant(DelayModel):
    """Every delay is `value` seconds: stragglers-free, but slower, learners."""

    _fields = ("value",)

    def __init__(self, value: float) -> None:
        self.value = _check_non_negative("Constant value", value)

    def sample(self, learner: int) -> float:
        return self.value

    @property
    def mean(self) -> float:
        return self.value


class _Stream:
    """One learner's generator and its current block of pre-drawn delays."""

    __slots__ = ("block", "position", "rng")

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.block: list[float] = []
        self.position = 0


class _RandomDelay(DelayModel):
    """Per-learner streams seeded with [seed, learner]; subclasses implement `_draw`."""

    seed: int

    def __init__(self, seed: int) -> None:
        self.seed = _check_seed(seed)
        self._streams: dict[int, _Stream] = {}

    def _draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        raise NotImplementedError

    def sample(self, learner: int) -> float:
        stream = self._streams.get(learner)
        if stream is None:
            learner = _check_learner_index(learner)
            stream = self._streams[learner] = _Stream(np.random.default_rng([self.seed, learner]))
        if stream.position == len(stream.block):
            # tolist() gives Python floats, so each later sample is a lookup, not a conversion.
            stream.block = self._draw(stream.rng, _BLOCK_SIZE).tolist()
            stream.position = 0
        value = stream.block[stream.position]
        stream.position += 1
        return value

    def reset(self) -> None:
        self._streams.clear()


class Exponential(_RandomDelay):
    """Exponential delays with the given mean, X ~ Exp(rate 1/mean).

    The straggler model of Dutta et al. 2018 (docs/method.md, "X ~ Exp(rate mu)"). `rate` (= mu) and
    `shift` (= 0) are exposed so closed-form theory treats it like `ShiftedExponential`.
    """

    _fields = ("mean", "seed")
    shift = 0.0

    def __init__(self, mean: float, seed: int = 0) -> None:
        super().__init__(seed)
        self._mean = _check_positive("Exponential mean", mean)
        self.rate = 1.0 / self._mean

    def _draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.exponential(self._mean, size)

    @property
    def mean(self) -> float:
        return self._mean


class ShiftedExponential(_RandomDelay):
    """Shifted exponential delays, X = shift + Exp(mean `mean`).

    Dutta et al. 2018 (docs/method.md, "X ~ shift D + Exp(mu)") with D = `shift` and mu = `rate` =
    1 / `mean`. Note that the constructor's `mean` is the mean of the exponential part only:
    the `mean` property, the expected total delay, is shift + mean. Its draws equal those of
    `Exponential(mean, seed)` plus `shift`.
    """

    _fields = ("shift", "exponential_mean", "seed")

    def __init__(self, shift: float, mean: float, seed: int = 0) -> None:
        super().__init__(seed)
        self.shift = _check_non_negative("ShiftedExponential shift", shift)
        self.exponential_mean = _check_positive("ShiftedExponential mean", mean)
        self.rate = 1.0 / self.exponential_mean

    def _draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.shift + rng.exponential(self.exponential_mean, size)

    @property
    def mean(self) -> float:
        return self.shift + self.exponential_mean


class Pareto(_RandomDelay):
    """Classical (type I) Pareto delays: P(X > x) = (scale / x) ** alpha for x >= scale.

    Heavy-tailed stragglers beyond the paper's exponential family. The mean is
    scale * alpha / (alpha - 1) for alpha > 1 and infinite otherwise; the variance is infinite
    for alpha <= 2, so sample means then converge slowly.
    """

    _fields = ("scale", "alpha", "seed")

    def __init__(self, scale: float, alpha: float, seed: int = 0) -> None:
        super().__init__(seed)
        self.scale = _check_positive("Pareto scale", scale)
        self.alpha = _check_positive("Pareto alpha", alpha)

    def _draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        # numpy's pareto is the Lomax (Pareto II) law, i.e. the classical one shifted to 0.
        return self.scale * (1.0 + rng.pareto(self.alpha, size))

    @property
    def mean(self) -> float:
        if self.alpha <= 1:
            raise ValueError(
                f"Pareto mean is infinite for alpha <= 1 (alpha={self.alpha}); "
                "use alpha > 1 for a finite expected delay"
            )
        return self.scale * self.alpha / (self.alpha - 1)


class SlowLearners(DelayModel):
    """`base` delays, multiplied by `factor` for the learners listed in `learners`.

    Models persistently slow machines on top of i.i.d. straggling. Learners are no longer
    identical, so `mean` raises; use `mean_of(learner)`.
    """

    _fields = ("base", "learners", "factor")

    def __init__(self, base: DelayModel, learners: Iterable[int], factor: float) -> None:
        if not isinstance(base, DelayModel):
            raise ValueError(f"SlowLearners base must be a DelayModel, got {base!r}")
        learners = [_check_learner_index(learner) for learner in learners]
        if not learners:
            raise ValueError("SlowLearners learners must name at least one learner, got []")
        self.base = base
        self.learners = tuple(sorted(set(learners)))
        self._slow = frozenset(self.learners)
        self.factor = _check_positive("SlowLearners factor", factor)

    @property
    def seed(self) -> int | None:  # type: ignore[override]  # read-only: the base model owns it
        return self.base.seed

    def sample(self, learner: int) -> float:
        delay = self.base.sample(learner)
        return delay * self.factor if learner in self._slow else delay

    def reset(self) -> None:
        self.base.reset()

    @property
    def mean(self) -> float:
        raise ValueError(
            f"SlowLearners has no common mean: learners {list(self.learners)} are {self.factor}x "
            "slower; use mean_of(learner)"
        )

    def mean_of(self, learner: int) -> float:
        base_mean = self.base.mean_of(learner)
        return base_mean * self.factor if learner in self._slow else base_mean

    def check_learners(self, num_learners: int) -> None:
        super().check_learners(num_learners)
        self.base.check_learners(num_learners)
        if self.learners[-1] >= num_learners:
            raise ValueError(
                f"SlowLearners slows learner {self.learners[-1]}, but there are only "
                f"{num_learners} learners (indices 0..{num_learners - 1})"
            )

