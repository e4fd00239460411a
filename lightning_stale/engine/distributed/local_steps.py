"""A real learner's rounds of local updates (docs/how-to/local-updates.md; local SGD: Wang and
Joshi, "Cooperative SGD", JMLR 2021; DiLoCo: Douillard et al. 2023).

A round is H steps of the module's own optimizer (the inner optimizer) from the parameters the
learner last took, ended by one push of the pseudo-gradient (`CentralExchange` with ``local``
fills it). The variant's rules apply to the pushes unchanged: new parameters or the stop arriving
between two inner steps cancel the round (the learner abandons its local steps), as they cancel a
mini-batch at its push. The inner optimizer's per-parameter state is the learner's own, kept
from one pushed round to the next; an abandoned round's changes to it are dropped, as the
simulated engine, which never computes cancelled work, never makes them. (A round whose push
is carried over an epoch's end keeps its changes, even where an update then cancels the push.)
The inner optimizer's LR schedulers follow the server's trajectory (`schedules.LearnerSchedules`):
a round from version v runs at their value of inner step v x H; plateau ones step at every epoch's
end on rank 0's metrics, which the server hands every learner (`Learner.wait_for_metrics`).

AdaComm (`method.adaptive.AdaptiveH`, Wang and Joshi, SysML 2019): the server owns the schedule of
H. Its answers carry the H in force (`Message.local_steps`) and the inner steps up to the version
they hold (`Message.inner_steps`: the sum of the H of its updates, each the H of the push that
completed it, as on the simulated engine); a round takes the H the learner last heard when it
starts and keeps it to its push, whose H the push carries. ``global_step`` and the schedules
count those inner steps, not version x H_0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.local_round import LocalRound, cloned_state, give_inner_state, optimizer_params
from lightning_stale.engine.schedules import LearnerSchedules


class LocalSteps:
    """The rounds of ``learner`` (its exchange a local `CentralExchange`) with ``optimizer``, the
    module's; call `begin` before each inner step's forward and `step` after its backward.
    ``schedulers``: Lightning's configs of the optimizer's LR schedulers, stepped here along the
    server's trajectory (`schedules.LearnerSchedules`)."""

    def __init__(self, learner: Learner, optimizer: Optimizer, local_steps: int,
                 schedulers: Sequence[Any] = (), adaptive: bool = False) -> None:
        self.learner, self.optimizer, self.local_steps = learner, optimizer, local_steps
        self.adaptive = adaptive  # the server decides each round's H (AdaComm)
        learner.draws_per_push = local_steps  # a push's time is that of its H mini-batches
        self.schedules: LearnerSchedules | None = None
        if schedulers:
            self.schedules = LearnerSchedules(schedulers, optimizer, local_steps)
        self.epochs_ended = 0  # the server's epoch ends its epoch-interval schedulers stepped for
        self.before_plateau = False  # the round in progress began after an epoch's end, before its plateau step
        self.round: LocalRound | None = None
        self.state: list | None = None  # the inner optimizer's state after the last pushed round
        self.version = -1  # the server version the round started from
        self.samples, self.started_at = 0, 0.0
        self.pushed = False  # whether the latest `step` ended a round with a push

    def begin(self) -> None:
        """Start a round where none runs, from the parameters and buffers last taken. A round
        whose parameters were replaced meanwhile (new ones taken when an epoch's pause ended)
        is abandoned first. The epoch-interval schedulers step before the first inner step after
        the learner heard of an epoch's end (the round in progress goes on at the new rate, as
        one the simulated engine computes across an epoch's end). Plateau schedulers step on rank
        0's metrics of that end, which the server hands every learner when training goes on:
        waited for here, before any update of the new epoch (the server holds them until then)."""
        learner = self.learner
        while self.schedules is not None and self.epochs_ended < learner.server_epochs:
            if self.schedules.plateaus and learner.paused:
                # (a batch the loader drew after the end, before validation gives rank 0's metrics:
                # a round started at the end takes it at the old rate, and is restarted below)
                self.before_plateau = self.round is None or self.version >= learner.epoch_version
                break
            metrics = learner.wait_for_metrics(self.epochs_ended + 1) if self.schedules.plateaus else {}
            if metrics is None:
                break  # the run stopped: no round follows
            self.schedules.epoch_ended(self.epochs_ended,
                                       self._inner_steps_at(learner.epoch_version, learner.epoch_inner_steps),
                                       metrics)
            self.epochs_ended += 1
            if self.before_plateau and self.round is not None:
                learner.cancelled += 1  # (as a mini-batch started after an epoch's end is discarded)
                self._abandon()
            self.before_plateau = False
        if self.round is not None and learner.version != self.version:
            learner.cancelled += 1
            self._abandon()
        if self.round is None:
            pulled = getattr(learner.exchange, "pulled", None)
            assert pulled is not None, "local updates start from the parameters the learner took"
            learner.vectors.load_state(pulled)
            self._follow_server()
            h = learner.next_local_steps if self.adaptive and learner.next_local_steps else self.local_steps
            learner.draws_per_push = h  # (the push carries it: the server counts its inner steps)
            # Every round's end leaves the optimizer a copy of self.state (its own tensors after a
            # push, a clone after a cancellation): only a learner that never pushed needs one.
            self.round = LocalRound(None, h, self.optimizer, self.state,
                                    give_state=self.state is None)
            self.version, self.samples, self.started_at = learner.version, 0, time.monotonic()

    def step(self, loss: float, samples: int, overflow: bool = False) -> bool:
        """One inner step on the gradients just computed (skipped on an overflow, but counted);
        the round's last pushes its pseudo-gradient. Returns whether the round ended (pushed,
        or cancelled: `pushed` says which)."""
        round_, learner = self.round, self.learner
        assert round_ is not None, "begin() starts the round"
        self.samples += samples
        self.pushed = False
        if not round_.step(self.optimizer, learner.vectors.params, loss, overflow):
            if learner.between_inner_steps():
                self._abandon()
                self._follow_server()
                return True
            return False
        self.round = None
        learner.exchange.present = round_.present  # type: ignore[attr-defined]
        cancelled, pushes = learner.cancelled, learner.pushes
        learner.step(round_.loss, self.samples, self.started_at)  # (leaves the optimizer as it is)
        if learner.cancelled == cancelled:  # pushed, or carried over an epoch's end to be pushed
            # (a copy: the optimizer keeps its own, which a checkpoint between rounds saves)
            self.state = cloned_state([self.optimizer.state.get(p) for p in optimizer_params(self.optimizer)])
        else:
            give_inner_state(self.optimizer, cloned_state(self.state))
        self.pushed = learner.pushes > pushes
        self._follow_server()  # (the schedule stands where the parameters held come from, the final ones too)
        return True

    def _follow_server(self) -> None:
        if self.schedules is not None:
            self.schedules.follow(self.inner_steps)

    @property
    def inner_steps(self) -> int:
        """Inner steps along the server's trajectory up to the version held (``global_step``)."""
        return self._inner_steps_at(self.learner.version, self.learner.inner_steps)

    def _inner_steps_at(self, version: int, counted: int) -> int:
        """Inner steps up to server ``version``: under AdaComm the server's count (``counted``,
        from its answers), else version x H."""
        return counted if self.adaptive else max(version, 0) * self.local_steps

    def _abandon(self) -> None:
        """Drop the round and what it did to the inner optimizer's state."""
        self.round = None
        give_inner_state(self.optimizer, cloned_state(self.state))
