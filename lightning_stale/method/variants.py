"""The six distributed-SGD variants of Dutta et al. (AISTATS 2018) as one description.

Every variant is the same parameter-server rule with two switches (docs/method.md, "The six variants"):

* ``counts``: what K counts before the server updates.
  ``"learners"``: K gradients from K *distinct* learners; a learner that pushed waits for
  the next parameters (K-sync, K-async). ``"batches"``: K mini-batch gradients from any
  learners; a pusher goes straight on with another mini-batch (K-batch-sync, K-batch-async).
* ``synchronous``: sync family (Fully sync, K-sync, K-batch-sync): a gradient computed at a
  superseded version is dropped, and at every update all P learners get w_{j+1} and their
  unfinished work is cancelled. Async family (Async, K-async, K-batch-async): stale gradients are
  applied, nobody is cancelled, only pushers get new parameters.

Fully sync is K-sync with K = P; Async is K-async with K = 1 (which also equals K-batch-async
with K = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

VARIANT_NAMES = ("sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async")

# name -> (what K counts, synchronous?)
_SWITCHES: dict[str, tuple[Literal["learners", "batches"], bool]] = {
    "sync": ("learners", True),
    "k_sync": ("learners", True),
    "k_batch_sync": ("batches", True),
    "async": ("learners", False),
    "k_async": ("learners", False),
    "k_batch_async": ("batches", False),
}


def check_variant_name(name: str) -> str:
    """Return ``name`` if it is one of the six variants, else raise a ValueError listing them."""
    if name not in _SWITCHES:
        raise ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANT_NAMES)}")
    return name


def check_k(name: str, k: int | None) -> None:
    """Validate K as far as possible without knowing P (at a strategy's construction)."""
    check_variant_name(name)
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"K must be an integer with 1 <= K <= P, got {k!r}")
    if k < 1:
        raise ValueError(f"K must satisfy 1 <= K <= P, got K={k}")
    if name == "async" and k != 1:
        raise ValueError(f"variant 'async' means K=1, got K={k}; use 'k_async' for K > 1")


def default_k(name: str, p: int) -> int:
    """K used when none is given: P for ``sync``, 1 for ``async``, ceil(P/2) otherwise."""
    if name == "sync":
        return p
    if name == "async":
        return 1
    return math.ceil(p / 2)


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
        if name == "sync" and k != p:
            raise ValueError(f"variant 'sync' means K=P={p}, got K={k}; use 'k_sync' for K < P")
        return cls(name=name, p=p, k=k)

    @property
    def counts(self) -> Literal["learners", "batches"]:
        return _SWITCHES[self.name][0]

    @property
    def synchronous(self) -> bool:
        return _SWITCHES[self.name][1]

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

    def with_k(self, k: int) -> Variant:
        """The same variant with another K (adaptive K), validated against P."""
        return Variant.create(self.name, self.p, k)

    def __str__(self) -> str:
        return f"{self.name}(K={self.k}, P={self.p})"
