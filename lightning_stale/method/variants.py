"""The six distributed-SGD variants of Dutta et al. (AISTATS 2018) as one description.

Every variant is the same parameter-server rule with two switches (docs/method.md, "The six
variants"):

* ``counts``: what K counts before the server updates.
  ``"learners"``: K gradients from K *distinct* learners; a learner that pushed waits for
  the next parameters (K-sync, K-async). ``"batches"``: K mini-batch gradients from any
  learners; a pusher goes straight on with another mini-batch (K-batch-sync, K-batch-async).
* ``synchronous``: sync family (Fully sync, K-sync, K-batch-sync): a gradient computed at a
  superseded version is dropped, and at every update all P learners get w_{j+1} and their
  unfinished work is cancelled. Async family (Async, K-async, K-batch-async): stale gradients are
  applied, nobody is cancelled, only pushers get new parameters.

Fully sync is K-sync with K = P; Async is K-async with K = 1 (which also equals K-batch-async
with K = 1). Everything else in the package asks a `Variant` (or its `VariantKind`) rather than
comparing names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class VariantKind:
    """What a variant is, independent of P and K.

    Attributes:
        name: the config name, e.g. ``"k_batch_sync"``.
        title: the paper's name, e.g. ``"K-batch-sync"``.
        counts: ``"learners"`` or ``"batches"`` (see the module docstring).
        synchronous: sync family (True) or async family (False).
        fixed_k: ``"P"`` for Fully sync (K = P), ``"1"`` for Async (K = 1), None where K is free.
    """

    name: str
    title: str
    counts: Literal["learners", "batches"]
    synchronous: bool
    fixed_k: Literal["P", "1"] | None = None

    @property
    def family(self) -> Literal["sync", "async"]:
        return "sync" if self.synchronous else "async"

    @property
    def k_applies(self) -> bool:
        """Whether K is the user's to choose (the four K-variants), so AdaSync can change it."""
        return self.fixed_k is None


KINDS: dict[str, VariantKind] = {kind.name: kind for kind in (
    VariantKind("sync", "Fully sync", "learners", True, fixed_k="P"),
    VariantKind("k_sync", "K-sync", "learners", True),
    VariantKind("k_batch_sync", "K-batch-sync", "batches", True),
    VariantKind("async", "Async", "learners", False, fixed_k="1"),
    VariantKind("k_async", "K-async", "learners", False),
    VariantKind("k_batch_async", "K-batch-async", "batches", False),
)}
VARIANT_NAMES = tuple(KINDS)


def kind_of(name: str) -> VariantKind:
    """The `VariantKind` of ``name``, or a ValueError listing the six names."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANT_NAMES)}")
    return kind


def check_variant_name(name: str) -> str:
    """Return ``name`` if it is one of the six variants, else raise a ValueError listing them."""
    return kind_of(name).name


def check_k(name: str, k: int | None) -> None:
    """Validate K as far as possible without knowing P (at a strategy's construction)."""
    kind = kind_of(name)
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"K must be an integer with 1 <= K <= P, got {k!r}")
    if k < 1:
        raise ValueError(f"K must satisfy 1 <= K <= P, got K={k}")
    if kind.fixed_k == "1" and k != 1:
        raise ValueError(f"variant {name!r} means K=1, got K={k}; use 'k_async' for K > 1")


def default_k(name: str, p: int) -> int:
    """K used when none is given: P for ``sync``, 1 for ``async``, ceil(P/2) otherwise."""
    fixed = kind_of(name).fixed_k
    return p if fixed == "P" else 1 if fixed == "1" else math.ceil(p / 2)


@dataclass(frozen=True)
class Variant:
    """One of the six variants with its K and the number of learners P."""

    name: str
    p: int
    k: int

    @classmethod
    def create(cls, name: str, p: int, k: int | None = None) -> Variant:
        """Validate ``name``, P and K (an integer with 1 <= K <= P) and build the variant.

        ``sync`` fixes K = P and ``async`` K = 1; passing another K for them is an error.
        """
        check_k(name, k)
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"the number of learners P must be a positive integer, got {p!r}")
        if k is None:
            k = default_k(name, p)
        if k > p:
            raise ValueError(f"K must satisfy 1 <= K <= P={p}, got K={k} for variant {name!r}")
        if kind_of(name).fixed_k == "P" and k != p:
            raise ValueError(f"variant {name!r} means K=P={p}, got K={k}; use 'k_sync' for K < P")
        return cls(name=name, p=p, k=k)

    @staticmethod
    def k_applies_to(name: str) -> bool:
        return kind_of(name).k_applies

    @property
    def kind(self) -> VariantKind:
        return KINDS[self.name]

    @property
    def title(self) -> str:
        return self.kind.title

    @property
    def family(self) -> Literal["sync", "async"]:
        return self.kind.family

    @property
    def counts(self) -> Literal["learners", "batches"]:
        return self.kind.counts

    @property
    def synchronous(self) -> bool:
        return self.kind.synchronous

    @property
    def pusher_waits(self) -> bool:
        """Whether a learner that pushed waits for the next update (K counts learners)."""
        return self.counts == "learners"

    @property
    def pusher_needs_answer(self) -> bool:
        """Whether a pusher must hear from the server before its next mini-batch. A K-batch-sync
        pusher need not: it keeps w_j, and the update that supersedes w_j reaches it anyway,
        as a cancellation of whatever it computes by then."""
        return not (self.counts == "batches" and self.synchronous)

    def equivalent(self) -> str | None:
        """The paper's name for a K-variant at an edge of K: Fully sync for K-sync and K-async
        with K = P (every learner waits, every learner restarts), Async for K-async and
        K-batch-async with K = 1. None otherwise."""
        if self.kind.fixed_k is not None:
            return None
        if self.counts == "learners" and self.k == self.p:
            return KINDS["sync"].title
        if not self.synchronous and self.k == 1:
            return KINDS["async"].title
        return None

    def with_k(self, k: int) -> Variant:
        """The same variant with another K (adaptive K), validated against P."""
        return Variant.create(self.name, self.p, k)

    def __str__(self) -> str:
        return f"{self.name}(K={self.k}, P={self.p})"
