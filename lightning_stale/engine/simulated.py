"""The simulated parameter server: virtual clock + rules + server state, with no Lightning.

`SimulatedServer` runs P learners in one process (Dutta et al., AISTATS 2018; docs/method.md). A
`VirtualCluster` says which learner finishes its mini-batch next and at which virtual time; the
caller computes that learner's gradient on the parameters it last pulled
(`parameters_for`) and hands it to `push`; `ServerRules` decides, exactly as in the real engine,
whether it is kept, dropped or completes an update; an update is applied by `ServerState.apply`
(optionally with staleness-compensation weights), and the K in force may grow under `AdaptiveK`.

Work that the real engine would cancel never finishes on the virtual clock, so it is never
computed: a simulated run costs one gradient per push.

Memory: the flat parameters of a version are kept while a learner holds that version or a
pending gradient was computed at it (the "norm" staleness compensation needs the latter), and
pushed gradients are kept by push id until their update applies them or the rules drop them.
"""

from __future__ import annotations

import math
from torch import Tensor

from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.engine.records import UpdateRecord
from lightning_stale.method.rules import Decision, ServerRules, Update
from lightning_stale.engine.state import PushedGradient, ServerState
from lightning_stale.method.virtual_clock import Finish, VirtualCluster
from lightning_stale.method.variants import Variant


class SimulatedServer:
    """One simulated run of one variant.

    Args:
        state: the server's parameters and optimizer (shared arithmetic with the real engine).
        variant: the variant with K and P.
        delay: straggler model with ``sample(learner)`` (seconds).
        compute_time: virtual seconds added to every mini-batch.
        adaptive: `AdaptiveK` schedule, or None for a fixed K.
        compensation: `StalenessCompensation`, or None.
    """

    def __init__(self, state: ServerState, variant: Variant, delay, compute_time: float = 0.0,
                 adaptive: AdaptiveK | None = None,
                 compensation: StalenessCompensation | None = None) -> None:
        self.state = state
        self.rules = ServerRules(variant)
        self.cluster = VirtualCluster(self.rules, delay, compute_time)
        self.adaptive = adaptive
        self.compensation = compensation
        if adaptive is not None:
            self.rules.set_k(adaptive.k)
        self.records: list[UpdateRecord] = []
        self.last_update_time = 0.0
        self._snapshots: dict[int, Tensor] = {self.rules.version: state.snapshot()}
        self._pushed: dict[int, PushedGradient] = {}

    # ---------------------------------------------------------------- the caller's loop
    def next_finish(self) -> Finish:
        """Advance the virtual clock to the next learner that finishes a mini-batch."""
        return self.cluster.next_finish()

    def parameters_for(self, finish: Finish) -> Tensor:
        """Flat parameters (CPU) of the version the finishing learner computed at."""
        return self._snapshots[finish.version]

    def push(self, finish: Finish, gradient: Tensor, loss: float, samples: int) -> Decision:
        """The learner of ``finish`` pushes ``gradient`` (flat) with its mini-batch loss."""
        decision = self.rules.on_push(finish.learner, finish.version)
        self.cluster.apply(decision)
        if decision.accepted:
            assert decision.push is not None
            self._pushed[decision.push.id] = PushedGradient(gradient, float(loss), int(samples))
        if decision.update is not None:
            self._apply(decision.update)
        self._forget_unused_snapshots()
        return decision

    def end_epoch(self, epoch: int, flush: bool = True) -> None:
        """Epoch ``epoch`` ended: step epoch-interval schedulers and, like the real engine, flush
        (pending gradients are dropped as "epoch_end", every learner restarts from the current
        parameters, and work in progress is cancelled)."""
        self.state.end_epoch(epoch)
        if not flush or self.rules.stopped:
            return
        decision = self.rules.flush("epoch_end")
        self._pushed.clear()  # only pending gradients are kept, and the flush dropped them all
        self.state.new_version(decision.version)
        self._snapshots[decision.version] = self.state.snapshot()
        self.cluster.apply(decision)
        self._forget_unused_snapshots()

    def pop_records(self) -> list[UpdateRecord]:
        records, self.records = self.records, []
        return records

    def stop(self) -> None:
        """End of training: pending gradients count as in flight at stop; memory is released."""
        self.rules.stop()
        self._pushed.clear()
        self._snapshots.clear()

    # ---------------------------------------------------------------- results
    @property
    def updates(self) -> int:
        return self.rules.counts.updates

    def stats(self) -> dict:
        """`ServerRules.stats` plus virtual-time figures (seconds of the delay model)."""
        stats = self.rules.stats()
        updates = stats["updates"]
        # The first interval starts at 0, when every learner starts its first mini-batch.
        stats["mean_update_interval_s"] = self.last_update_time / updates if updates else math.nan
        stats["virtual_time_s"] = self.cluster.now
        if self.adaptive is not None:
            stats["k_history"] = list(self.adaptive.history)
        return stats

    # ---------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict:
        # The server state is saved by Lightning (module and optimizer state) and the caller;
        # it holds a wrapped optimizer that cannot be pickled.
        state = self.__dict__.copy()
        state["state"] = None
        state["records"] = []
        return state

    def attach(self, state: ServerState) -> None:
        """Reconnect an unpickled server to its restored `ServerState`."""
        self.state = state

    # ---------------------------------------------------------------- internals
    def _apply(self, update: Update) -> None:
        pushed = [self._pushed.pop(push.id) for push in update.gradients]
        now = self.cluster.now
        record = self.state.apply_update(update, pushed, now, self.rules.k, self.compensation, self._snapshots)
        self._snapshots[update.version] = self.state.snapshot()
        self.records.append(record)
        self.last_update_time = now
        if self.adaptive is not None:
            new_k = self.adaptive.observe(now, record.loss)
            if new_k is not None:
                self.rules.set_k(new_k)  # between updates: nothing is pending now

    def _forget_unused_snapshots(self) -> None:
        in_use = self.rules.versions_in_use()
        for version in [v for v in self._snapshots if v not in in_use]:
            del self._snapshots[version]
