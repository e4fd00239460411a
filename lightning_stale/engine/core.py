"""The one parameter server of every engine (docs/concepts/server.md): `ServerRules` decide, a
`ServerState` applies (docs/method.md's rule, Dutta et al., AISTATS 2018, with staleness-
compensation weights), `ServerCore` keeps the books, ends epochs (a pause: `running_time` excludes
it) and stops. The virtual clock and the real server are this core plus a clock or a transport,
so they cannot disagree about the method; an observer (`CoreObserver`) hears every event."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from torch import Tensor

from lightning_stale.engine.records import UpdateRecord
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.rules import Decision, ServerRules, Update
from lightning_stale.method.variants import Variant


class CoreObserver(Protocol):
    """An observer of a `ServerCore` (`replay.EventRecorder`), told after the books record."""

    def on_push(self, core: ServerCore, decision: Decision, clock: float, loss: float) -> None:
        """A push was decided (accepted, dropped or unusable)."""

    def on_update(self, core: ServerCore, update: Update, order: tuple[int, ...],
                  weights: tuple[float, ...] | None, lrs: tuple[float, ...] | None) -> None:
        """An update was applied: its gradients' ids in the order summed, weights, the step's LRs."""

    def on_epoch_end(self, core: ServerCore) -> None:
        """An epoch ended."""

    def on_validation(self, core: ServerCore, metrics: Mapping[str, float]) -> None:
        """Training goes on after an epoch's end whose validation logged ``metrics``."""

    def on_remove_learner(self, core: ServerCore, learner: int, clock: float) -> None:
        """A dead learner was removed."""

    def on_stop(self, core: ServerCore, pending: tuple[int, ...]) -> None:
        """Training stopped, with these pushes' gradients pending."""


@dataclass
class ServerLimits:
    """When epochs end and when training stops (the Trainer's settings, in server terms)."""

    max_updates: int = -1  # Trainer(max_steps): server updates; -1 for no limit
    max_epochs: int = -1  # server epochs; -1 for no limit
    pushes_per_epoch: int = 0  # mini-batches pushed per epoch; 0: the engine ends epochs itself
    # AdaComm's varying H: max_steps as inner steps (the pushes' H summed over the updates) instead
    # of max_updates, and pushes_per_epoch counted in inner steps (each push counting its H)
    max_inner_steps: int = -1
    epoch_in_inner_steps: bool = False


@dataclass
class PushedGradient:
    """An accepted gradient waiting for its update (None where it is kept elsewhere)."""

    contribution: Contribution | None
    loss: float
    samples: int
    local_steps: int = 1  # the H of the round it ends (local updates)


@dataclass(frozen=True)
class Outcome:
    """What one event led to: the decision, the update applied, whether it ended an epoch or training."""

    decision: Decision
    update: Update | None = None
    record: UpdateRecord | None = None
    epoch_ended: bool = False
    stopped: bool = False
    contributions: tuple = ()  # what the update applied (as the engine handed them in)
    weights: tuple[float, ...] | None = None  # their staleness-compensation weights


class ServerCore:
    """Decisions, state and books of one run of one variant."""

    def __init__(self, variant: Variant, state: ServerState | None = None,
                 limits: ServerLimits | None = None, adaptive: AdaptiveK | None = None,
                 compensation: StalenessCompensation | None = None,
                 keep_snapshots: bool = False, clock: float = 0.0,
                 observer: CoreObserver | None = None, adaptive_h: AdaptiveH | None = None) -> None:
        self.rules = ServerRules(variant)
        self.observer = observer
        self.state = state
        self.limits = limits or ServerLimits()
        self.adaptive, self.compensation, self.adaptive_h = adaptive, compensation, adaptive_h
        # Inner steps along the server's trajectory (``global_step`` with local updates): each
        # update adds the H of the push that completed it, as `SimulatedServer.inner_steps` does.
        self.inner_steps = 0
        if adaptive is not None:
            self.rules.set_k(adaptive.k)
        needs_parameters = compensation is not None and compensation.needs_parameters
        if needs_parameters and state is None:
            raise ValueError(f"staleness compensation {compensation!r} needs the server's parameters")
        self.keep_snapshots = keep_snapshots or needs_parameters
        self.epoch = 0  # epochs ended
        self.samples = 0  # in all gradients applied
        self._pushes_this_epoch = 0
        self._pending: dict[int, PushedGradient] = {}  # push id -> accepted, not yet applied
        self._records: list[UpdateRecord] = []
        self._snapshots: dict[int, Tensor] = {}
        self._start = clock
        self._paused_s = 0.0
        self._paused_at: float | None = None
        self._last_update_s = 0.0  # running time of the latest update
        if self.keep_snapshots and state is not None:
            self._snapshots[self.rules.version] = state.snapshot(self.rules.version)

    # ------------------------------------------------------------------ clock
    def running_time(self, clock: float) -> float:
        """Training seconds since the start at ``clock``, pauses excluded."""
        paused = self._paused_s + (clock - self._paused_at if self._paused_at is not None else 0.0)
        return clock - self._start - paused

    def pause(self, clock: float) -> None:
        """Training is paused from ``clock`` (validation at an epoch end), until `resume`."""
        if self._paused_at is None:
            self._paused_at = clock

    def resume(self, clock: float) -> None:
        if self._paused_at is not None:
            self._paused_s += max(0.0, clock - self._paused_at)
            self._paused_at = None

    # ------------------------------------------------------------------ queries
    @property
    def version(self) -> int:
        return self.rules.version

    @property
    def updates(self) -> int:
        return self.rules.counts.updates

    @property
    def stopped(self) -> bool:
        return self.rules.stopped

    @property
    def local_steps(self) -> int:
        """The H of the rounds learners start now under AdaComm (`AdaptiveH`); 0 without it."""
        return 0 if self.adaptive_h is None else self.adaptive_h.h

    def parameters_at(self, version: int) -> Tensor:
        """Flat parameters of ``version`` (``keep_snapshots`` only)."""
        return self._snapshots[version]

    def pop_records(self) -> list[UpdateRecord]:
        records, self._records = self._records, []
        return records

    # ------------------------------------------------------------------ events
    def push(self, learner: int, version: int, clock: float, *,
             contribution: Contribution | None = None, loss: float = math.nan, samples: int = 0,
             unusable: str | None = None, local_steps: int = 1) -> Outcome:
        """A push computed at ``version``; ``unusable`` names why it has no usable gradient;
        ``local_steps``: the H of the round it ends (its inner steps, if it completes an update)."""
        stopped = self.rules.stopped  # arrived after the stop: counted as in flight, nothing else
        decision = self.rules.on_push(learner, version, None if stopped else unusable)
        if self.observer is not None:
            self.observer.on_push(self, decision, clock, loss)
        if stopped:
            return Outcome(decision)
        steps = max(1, int(local_steps))
        if decision.accepted and decision.push is not None:
            self._pending[decision.push.id] = PushedGradient(contribution, float(loss), int(samples), steps)
        return self._decided(decision, clock, pushed_steps=steps)

    def holds(self, contribution: Contribution) -> bool:
        """Whether ``contribution`` waits among the accepted gradients for a later update."""
        return any(g.contribution is contribution for g in self._pending.values())

    def pushes_fit_in_epoch(self, pushes: int) -> bool:
        """Whether the next ``pushes`` pushes will all be taken in this epoch, as far as known now."""
        per_epoch, done = self.limits.pushes_per_epoch, self._pushes_this_epoch
        return not self.rules.stopped and per_epoch > 0 and 0 < done and done + pushes <= per_epoch

    def remove_learner(self, learner: int, clock: float) -> Outcome:
        """Learner ``learner`` died (`ServerRules.remove_learner`: may complete an update now)."""
        decision = self.rules.remove_learner(learner)
        if self.observer is not None:
            self.observer.on_remove_learner(self, learner, clock)
        return self._decided(decision, clock, pushed_steps=0)

    def end_epoch(self) -> None:
        """An epoch ended; training stops if that was the last epoch or update."""
        self.epoch += 1
        self._pushes_this_epoch = 0
        if self.observer is not None:
            self.observer.on_epoch_end(self)
        if 0 <= self.limits.max_epochs <= self.epoch or self._at_step_limit():
            self.stop()

    def begin_epoch(self, clock: float, metrics: Mapping[str, float] | None = None) -> None:
        """After an epoch's end: the clock resumes, its schedulers step (``metrics``: for a plateau)."""
        self.resume(clock)
        if self.state is not None and self.epoch > 0:
            self.state.schedules.end_epoch(self.epoch - 1, metrics or {})
        if self.observer is not None:
            self.observer.on_validation(self, metrics or {})

    def report_metrics(self, metrics: Mapping[str, float]) -> None:
        """The latest logged values, for plateau schedulers stepped per update."""
        if self.state is not None:
            self.state.schedules.metrics.update(metrics)

    def stop(self) -> None:
        """Training is over: pending gradients and later pushes count as in flight at stop."""
        if self.observer is not None and not self.rules.stopped:
            self.observer.on_stop(self, tuple(self._pending))
        self.rules.stop()
        self._pending.clear()

    # ------------------------------------------------------------------ results
    def stats(self) -> dict:
        """The rules' counters, epochs, samples, mean running time per update, AdaSync's Ks."""
        stats = self.rules.stats()
        updates = stats["updates"]
        stats["mean_update_interval_s"] = self._last_update_s / updates if updates else math.nan
        stats["epochs"] = self.epoch
        stats["samples"] = self.samples
        if self.adaptive is not None:
            stats["k_history"] = list(self.adaptive.history)
        if self.adaptive_h is not None:
            stats["h_history"] = list(self.adaptive_h.history)  # (running seconds, H) at each change
        return stats

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue (parameters and optimizer are saved by Lightning)."""
        return {"version": self.rules.version, "updates": self.updates, "epoch": self.epoch,
                "samples": self.samples,
                "schedulers": self.state.schedules.states() if self.state is not None else []}

    def load_state_dict(self, saved: dict) -> None:
        self.rules.resume_at(saved["version"], saved["updates"])
        self.epoch, self.samples = saved["epoch"], saved.get("samples", 0)
        if self.state is not None:
            self.state.schedules.load_states(saved.get("schedulers", []))
        self._snapshots.clear()
        self._snapshot_current()

    # ------------------------------------------------------------------ internals
    def _decided(self, decision: Decision, clock: float, pushed_steps: int) -> Outcome:
        """Apply the update ``decision`` completes, if any; end the epoch (on a push) or stop where
        due. ``pushed_steps``: the H of the push decided (0: no push, a learner's removal)."""
        applied = self._apply(decision.update, clock) if decision.update is not None else {}
        pushed = pushed_steps > 0
        self._pushes_this_epoch += pushed_steps if self.limits.epoch_in_inner_steps else int(pushed)
        epoch_ended = pushed and 0 < self.limits.pushes_per_epoch <= self._pushes_this_epoch
        if epoch_ended:
            self.end_epoch()
        elif self._at_step_limit():
            self.stop()
        self._forget_unused_snapshots()
        return Outcome(decision, decision.update, epoch_ended=epoch_ended, stopped=self.rules.stopped, **applied)

    def _at_step_limit(self) -> bool:
        limits = self.limits
        return 0 <= limits.max_updates <= self.updates or 0 <= limits.max_inner_steps <= self.inner_steps

    def _apply(self, update: Update, clock: float) -> dict:
        """Apply ``update`` (where the core holds the state), record it; the Outcome's fields."""
        pushed = [self._pending.pop(g.id) for g in update.gradients]
        weights: Sequence[float] | None = None
        if self.compensation is not None and self.state is not None:
            numel = self.state.vectors.numel  # the parameters, without the buffers
            weights = self.compensation.weights(
                update, current_params=self.state.snapshot(update.version - 1)[:numel],
                params_at=lambda v: self._snapshots[v][:numel],
                lr=self.state.optimizer.param_groups[0]["lr"])
        elif self.compensation is not None:  # weights from staleness alone
            weights = self.compensation.weights(update)
        # Summed in the learners' order, not in the order they arrived: a float sum depends on its
        # order, and so a Fully sync fit is the same fit run after run, on every path.
        order = sorted(range(len(pushed)), key=lambda i: update.gradients[i].learner)
        contributions = tuple(pushed[i].contribution for i in order)
        weights = None if weights is None else tuple(weights[i] for i in order)
        lrs = None  # the learning rates this step uses (read before the schedulers step)
        if self.observer is not None and self.state is not None:
            lrs = self.state.step_lrs()
        if self.state is not None:
            self.state.apply(cast("list[Contribution]", list(contributions)), weights, update.index)
            self._snapshot_current()
        if self.observer is not None:
            self.observer.on_update(self, update, tuple(update.gradients[i].id for i in order),
                                    weights, lrs)
        self.samples += sum(p.samples for p in pushed)
        self._last_update_s = self.running_time(clock)
        record = UpdateRecord(
            update=update.index, clock=self._last_update_s, samples=self.samples,
            loss=math.fsum(p.loss for p in pushed) / len(pushed),
            staleness_mean=sum(update.staleness) / len(update.staleness),
            staleness_max=max(update.staleness), num_gradients=len(pushed), k=self.rules.k,
            learners=tuple(g.learner for g in update.gradients))
        self._records.append(record)
        if self.adaptive is not None:
            k = self.adaptive.observe(self._last_update_s, record.loss)
            if k is not None and k != self.rules.k:
                self.rules.set_k(k)  # between updates: nothing is pending now
        self.inner_steps += pushed[-1].local_steps  # (the H of the push that completed the update)
        if self.adaptive_h is not None:
            # A new H goes with this update's answers: the rounds they start take it; rounds in
            # progress keep theirs (as `SimulatedServer` starts rounds with the cluster's H).
            self.adaptive_h.observe(self._last_update_s, record.loss)
        return {"record": record, "contributions": contributions, "weights": weights}

    def _snapshot_current(self) -> None:
        if self.keep_snapshots and self.state is not None:
            self._snapshots[self.rules.version] = self.state.snapshot(self.rules.version)

    def _forget_unused_snapshots(self) -> None:
        if self._snapshots:
            in_use = self.rules.versions_in_use()
            for version in [v for v in self._snapshots if v not in in_use]:
                del self._snapshots[version]
