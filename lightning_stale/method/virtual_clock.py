"""P learners on a virtual clock, driven by `ServerRules`: the event-level model of docs/method.md.

Each learner's mini-batch takes a random time X (drawn from a straggler model); the learner that
finishes first pushes, the rules decide, and the learners they refresh or resume start their
next mini-batch at that instant. Cancelled work simply never finishes. With local updates a push
follows ``local_steps`` = H mini-batches, so its time is the sum of H draws
(docs/how-to/local-updates.md). There are no tensors here: the theory's Monte Carlo estimate of
E[T] runs this clock alone, and the simulated strategy computes a gradient only when a learner's
push is popped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from lightning_stale.method.rules import Decision, ServerRules


@dataclass(frozen=True)
class Finish:
    """Learner ``learner`` finishes a mini-batch (with local updates: its H mini-batches) computed
    from ``version`` at virtual ``time``; it started at ``started``, so its time X is
    ``time - started``. ``local_steps``: the H of this push (the cluster's H when it started:
    with AdaComm's adaptive H a learner takes a new H at the start of its next round)."""

    time: float
    learner: int
    version: int
    started: float = 0.0
    local_steps: int = 1


class VirtualCluster:
    """Discrete-event clock for P learners following the rules' decisions.

    Args:
        rules: the decision object (its variant fixes P).
        delay: any object with ``sample(learner) -> seconds`` (a `lightning_stale.delays` model).
        compute_time: virtual seconds added to every mini-batch on top of the delay.
        local_steps: H, the mini-batches of one push: its time is the sum of H draws. It may be
            changed between pushes (adaptive H): learners started afterwards take the new H.
    """

    local_steps = 1  # (clusters pickled before local updates existed)

    def __init__(self, rules: ServerRules, delay, compute_time: float = 0.0,
                 local_steps: int = 1) -> None:
        self.rules = rules
        self.local_steps = local_steps
        self.delay = delay
        self.compute_time = compute_time
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, float]] = []  # (time, seq, learner, generation, start)
        self._generation = [0] * rules.p
        self._steps_of = [local_steps] * rules.p  # the H of each learner's push in progress
        self._seq = 0
        for learner in range(rules.p):
            self._start(learner)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "_steps_of" not in state:  # pickled before adaptive H: every push has the cluster's H
            self._steps_of = [self.local_steps] * self.rules.p

    def _start(self, learner: int) -> None:
        # A new generation invalidates whatever the learner was computing before (cancellation).
        self._generation[learner] += 1
        self._steps_of[learner] = self.local_steps
        finish = self.now + self.compute_time + self.delay.sample(learner)
        for _ in range(self.local_steps - 1):
            finish += self.compute_time + self.delay.sample(learner)
        heapq.heappush(self._heap, (finish, self._seq, learner, self._generation[learner], self.now))
        self._seq += 1

    def next_finish(self) -> Finish:
        """Advance the clock to the next mini-batch that completes (cancelled ones are skipped)."""
        while self._heap:
            time, _, learner, generation, started = heapq.heappop(self._heap)
            if generation == self._generation[learner]:
                self.now = time
                return Finish(time, learner, self.rules.learner_version(learner), started,
                              self._steps_of[learner])
        raise RuntimeError("no learner is computing: every learner waits, which the rules never allow")

    def apply(self, decision: Decision) -> None:
        """Start the next mini-batch of every learner the decision refreshed or resumed."""
        for learner in decision.refresh + decision.resume:
            self._start(learner)

    def step(self) -> Decision:
        """One push: pop the next finisher, ask the rules, schedule what follows."""
        finish = self.next_finish()
        decision = self.rules.on_push(finish.learner, finish.version)
        self.apply(decision)
        return decision
