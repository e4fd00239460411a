"""The parameter server's decision logic, with no transport and no tensors.

`ServerRules` is fed one event per gradient push ("learner l finished a gradient computed at
version v") and answers with a `Decision`: whether the gradient is kept or dropped (and why),
whether the server updates now and with which gradients, which learners receive the current
parameters, whose unfinished work is cancelled, and who goes on with what it holds. Both engines
(the real parameter server and the virtual-clock simulator) and the Monte Carlo theory drive
this one object, so they cannot disagree about the method.

The method is docs/method.md's update rule (Dutta et al., AISTATS 2018, Section 2):

    w_{j+1} = w_j - (eta / K) * sum_{l=1..K} g(w_{tau(l,j)}, xi_{l,j})

with the six variants expressed by the two switches of `Variant` (what K counts, sync or async).

Learner protocol assumed by the rules (both engines follow it): a learner computes a gradient
at the version it holds, pushes it, and then waits for exactly one answer, which is either
new parameters (it appears in ``refresh`` of some decision) or leave to go on with what it holds
(``resume``). A refresh sent while a learner is computing interrupts that computation
(``cancel``). A pushed gradient whose version was superseded by a refresh the learner already
has coming is dropped with no answer of its own: the refresh is its answer.

A push may carry no usable gradient (a 16-mixed gradient that overflowed): it is dropped with
its reason and the pusher goes on with what it holds. A learner may die (``remove_learner``):
it gets nothing more, K is clamped to the learners left, and its accepted gradients still count.

Every push ends in exactly one bucket: applied, dropped (by reason), pending (accepted, waiting
for the K-th gradient), or in flight at stop. `ServerRules.accounting_ok` checks that sum.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from lightning_stale.method.variants import Variant


class ProtocolError(RuntimeError):
    """An event that the learner protocol cannot produce (a bug in an engine, not a user error)."""


@dataclass(frozen=True)
class Push:
    """One gradient push: a sequence id, the learner and the version it was computed at."""

    id: int
    learner: int
    version: int


@dataclass(frozen=True)
class Update:
    """A server update: the gradients to average and their staleness j - tau(l, j)."""

    index: int  # 1 for the first update
    version: int  # the server version after the update
    gradients: tuple[Push, ...]
    staleness: tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """What the server does after one event. Learner tuples are sorted and disjoint where it
    matters: ``cancel`` is a subset of ``refresh``; ``resume`` never overlaps ``refresh``."""

    push: Push | None
    accepted: bool = False
    dropped: str | None = None  # reason, when the push is dropped
    update: Update | None = None
    refresh: tuple[int, ...] = ()  # receive the current parameters (after ``update``) now
    cancel: tuple[int, ...] = ()  # their computation in progress is interrupted
    resume: tuple[int, ...] = ()  # go on with the parameters they hold
    version: int = 0  # the server version after this decision


@dataclass
class _Learner:
    version: int = 0  # version of the parameters it holds, or will hold once its answer arrives
    waiting: bool = False  # pushed and waits for the next update (K counts learners)
    alive: bool = True


@dataclass
class Counts:
    """Accounting of every push; see `ServerRules.accounting_ok`."""

    received: int = 0
    applied: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> count
    in_flight_at_stop: int = 0
    updates: int = 0
    cancellations: int = 0  # cancel orders sent (work interrupted, not gradients)
    staleness: Counter = field(default_factory=Counter)  # staleness -> applied gradients
    pushes_per_learner: list[int] = field(default_factory=list)
    dead_learners: list[int] = field(default_factory=list)


class ServerRules:
    """Decides updates, drops, refreshes and cancellations for one run of one variant.

    Args:
        variant: the variant, with K and P (see `Variant.create`).
    """

    def __init__(self, variant: Variant) -> None:
        self.variant = variant
        self.k = variant.k
        self.version = 0
        self.stopped = False
        self.counts = Counts(pushes_per_learner=[0] * variant.p)
        self._learners = [_Learner() for _ in range(variant.p)]
        self._pending: list[Push] = []
        # updates applied before each version was created (staleness in updates across a resume)
        self._updates_at_version = [0]

    # ------------------------------------------------------------------ queries
    @property
    def p(self) -> int:
        return self.variant.p

    @property
    def pending(self) -> tuple[Push, ...]:
        return tuple(self._pending)

    @property
    def alive(self) -> tuple[int, ...]:
        """The learners that have not died."""
        return tuple(i for i, s in enumerate(self._learners) if s.alive)

    def learner_version(self, learner: int) -> int:
        return self._learners[learner].version

    def is_waiting(self, learner: int) -> bool:
        return self._learners[learner].waiting

    def staleness_of(self, version: int) -> int:
        """Server updates applied since ``version`` was current: j - tau(l, j)."""
        return self.counts.updates - self._updates_at_version[version]

    def versions_in_use(self) -> set[int]:
        """Versions whose parameters an engine still needs: the current one, those learners
        hold, and those pending gradients were computed at."""
        versions = {self.version, *(s.version for s in self._learners if s.alive)}
        versions.update(p.version for p in self._pending)
        return versions

    def accounting_ok(self) -> bool:
        c = self.counts
        settled = c.applied + sum(c.dropped.values()) + c.in_flight_at_stop + len(self._pending)
        return c.received == settled

    # ------------------------------------------------------------------ events
    def on_push(self, learner: int, version: int, unusable: str | None = None) -> Decision:
        """Learner ``learner`` pushed a gradient computed at parameters of version ``version``;
        ``unusable`` names why it carries no usable gradient (e.g. "overflow"), if so."""
        if not 0 <= learner < self.p:
            raise ProtocolError(f"learner {learner} does not exist (P={self.p})")
        c = self.counts
        push = Push(id=c.received, learner=learner, version=version)
        c.received += 1
        c.pushes_per_learner[learner] += 1
        if self.stopped:
            c.in_flight_at_stop += 1
            return Decision(push, dropped="in_flight_at_stop", version=self.version)
        if version > self.version:
            raise ProtocolError(f"learner {learner} pushed version {version} > server {self.version}")
        state = self._learners[learner]
        if state.waiting:
            raise ProtocolError(f"learner {learner} pushed while waiting for new parameters")
        if not state.alive:
            raise ProtocolError(f"learner {learner} pushed after it was removed")
        if unusable is not None:  # nothing to apply: the pusher goes on with what it holds
            decision = self._drop(push, unusable)
            resume = () if self.variant.synchronous and version < self.version else (learner,)
            return replace(decision, resume=resume)

        if self.variant.synchronous and version < self.version:
            return self._drop(push, "stale")

        self._pending.append(push)
        if self.variant.pusher_waits:
            state.waiting = True
        if len(self._pending) >= self.k:
            return self._update(push)
        if self.variant.pusher_waits:
            return Decision(push, accepted=True, version=self.version)
        return self._answer_batch_pusher(push)

    def remove_learner(self, learner: int) -> Decision:
        """Learner ``learner`` died. It gets nothing more; its accepted gradients still count.
        K is clamped to the learners left; if the pending gradients then reach K, the update
        happens now (the returned decision carries it)."""
        state = self._learners[learner]
        if not state.alive:
            return Decision(None, version=self.version)
        state.alive, state.waiting = False, False
        self.counts.dead_learners.append(learner)
        left = len(self.alive)
        if left == 0:
            raise ProtocolError("every learner has died")
        if self.k > left:
            self.k = left  # the variant keeps its P: K <= P still holds
        if not self.stopped and self._pending and len(self._pending) >= self.k:
            return self._update(None)
        return Decision(None, version=self.version)

    def stop(self) -> None:
        """The server is done: pending gradients and later pushes count as in flight at stop."""
        if not self.stopped:
            self.counts.in_flight_at_stop += len(self._pending)
            self._pending.clear()
            self.stopped = True

    def resume_at(self, version: int, updates: int) -> None:
        """Continue a saved run: every learner will be sent the parameters of ``version``."""
        self.version, self.counts.updates = version, updates
        self._updates_at_version = [updates] * (version + 1)
        for s in self._learners:
            s.version, s.waiting = version, False

    def set_k(self, k: int) -> None:
        """Change K for the following updates (adaptive K); validated against P, and never above
        the learners left alive."""
        self.variant = self.variant.with_k(k)
        self.k = min(k, len(self.alive))

    # ------------------------------------------------------------------ internals
    def _drop(self, push: Push, reason: str) -> Decision:
        self.counts.dropped[reason] += 1
        return Decision(push, dropped=reason, version=self.version)

    def _new_version(self) -> None:
        self.counts.updates += 1
        self.version += 1
        self._updates_at_version.append(self.counts.updates)

    def _answer_batch_pusher(self, push: Push) -> Decision:
        """A batch-mode pusher goes on at once: with the current parameters if newer than its
        own (K-batch-async pulls w), else with what it holds (K-batch-sync keeps w_j)."""
        state = self._learners[push.learner]
        if state.version < self.version:
            state.version = self.version
            return Decision(push, accepted=True, version=self.version, refresh=(push.learner,))
        return Decision(push, accepted=True, version=self.version, resume=(push.learner,))

    def _update(self, pusher: Push | None) -> Decision:
        """Apply the pending gradients; ``pusher`` is the push that completed them (None when a
        learner's death lowered K)."""
        c = self.counts
        gradients = tuple(self._pending)
        staleness = tuple(self.staleness_of(g.version) for g in gradients)
        self._pending.clear()
        c.applied += len(gradients)
        c.staleness.update(staleness)
        self._new_version()
        update = Update(index=c.updates, version=self.version, gradients=gradients, staleness=staleness)

        learners = self._learners
        if self.variant.synchronous:
            # Everyone restarts from w_{j+1}; whoever is still computing at w_j is interrupted.
            # The pusher is never interrupted: it is waiting for the answer to its push.
            refresh = self.alive
            cancel = tuple(i for i in refresh if not learners[i].waiting
                           and (pusher is None or i != pusher.learner))
        elif self.variant.pusher_waits:
            # K-async: the K pushers waiting for w_{j+1} get it; the others keep computing.
            refresh = tuple(i for i, s in enumerate(learners) if s.waiting and s.alive)
            cancel = ()
        else:
            # K-batch-async: only the pusher pulls, and it now gets w_{j+1}.
            refresh = (pusher.learner,) if pusher is not None else ()
            cancel = ()
        c.cancellations += len(cancel)
        for i in refresh:
            learners[i].version, learners[i].waiting = self.version, False
        return Decision(pusher, accepted=pusher is not None, update=update, refresh=refresh,
                        cancel=cancel, version=self.version)

    def stats(self) -> dict:
        """Counters as plain Python values (for ``strategy.stats``)."""
        c = self.counts
        return {
            "updates": c.updates,
            "gradients_received": c.received,
            "gradients_applied": c.applied,
            "gradients_dropped": sum(c.dropped.values()),
            "gradients_dropped_by_reason": dict(c.dropped),
            "gradients_pending": len(self._pending),
            "gradients_in_flight_at_stop": c.in_flight_at_stop,
            "cancellations": c.cancellations,
            "staleness_histogram": dict(sorted(c.staleness.items())),
            "pushes_per_learner": list(c.pushes_per_learner),
            "dead_learners": list(c.dead_learners),
            "k": self.k,
            "p": self.p,
            "variant": self.variant.name,
        }
