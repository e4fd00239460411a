"""The server core on a virtual clock (docs/method.md, "Setting"): `SimulatedServer` is
`ServerCore` driven by a `VirtualCluster`; the caller computes the gradient of the learner that
finishes next on the parameters it last pulled (`parameters_for`) and hands it to `push`, and
cancelled work is never computed. With local updates (docs/how-to/local-updates.md) a push takes
H draws on the clock and carries the pseudo-gradient of H inner steps (H may shrink: `AdaptiveH`)."""

from __future__ import annotations

from torch import Tensor

from lightning_stale.engine.core import Outcome, ServerCore, ServerLimits
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import Finish, VirtualCluster


class SimulatedServer:
    """One simulated run of one variant (``local_steps``: H mini-batches per push)."""

    def __init__(self, state: ServerState, variant: Variant, delay, compute_time: float = 0.0,
                 adaptive: AdaptiveK | None = None,
                 compensation: StalenessCompensation | None = None,
                 limits: ServerLimits | None = None, local_steps: int = 1,
                 adaptive_h: AdaptiveH | None = None) -> None:
        # Every learner computes at its own version: the core keeps those parameters.
        self.core = ServerCore(variant, state, limits, adaptive, compensation, keep_snapshots=True)
        self.adaptive_h = adaptive_h
        self.cluster = VirtualCluster(self.core.rules, delay, compute_time, local_steps)
        self.inner_steps = 0  # inner steps along the server's trajectory (H x updates for a fixed H)
        # learner -> its inner optimizer's per-parameter state (local updates only)
        self.inner_states: dict[int, list] = {}

    @property
    def state(self) -> ServerState:
        assert self.core.state is not None, "the simulated server holds the model"
        return self.core.state

    @property
    def rules(self):
        return self.core.rules

    @property
    def updates(self) -> int:
        return self.core.updates

    # ---------------------------------------------------------------- the caller's loop
    def next_finish(self) -> Finish:  # the clock moves to the next learner finishing a mini-batch
        return self.cluster.next_finish()

    def parameters_for(self, finish: Finish) -> Tensor:
        """Flat parameters (CPU) of the version the finishing learner computed at."""
        return self.core.parameters_at(finish.version)

    def push(self, finish: Finish, contribution: Contribution | None, loss: float, samples: int,
             unusable: str | None = None) -> Outcome:
        """The learner of ``finish`` pushes its gradient with its mini-batch loss."""
        h = finish.local_steps
        schedules = self.state.schedules if self.core.state is not None else None
        if schedules is not None and self.adaptive_h is not None:
            schedules.steps_done, schedules.steps_per_update = self.inner_steps, h
        outcome = self.core.push(finish.learner, finish.version, self.cluster.now,
                                 contribution=contribution, loss=loss, samples=samples,
                                 unusable=unusable)
        record = outcome.record
        if record is not None:
            self.inner_steps += h
            if self.adaptive_h is not None:
                new_h = self.adaptive_h.observe(record.clock, record.loss)
                if new_h is not None:
                    self.cluster.local_steps = new_h  # the learners this decision starts take it
        self.cluster.apply(outcome.decision)
        return outcome

    def end_epoch(self, metrics=None) -> None:
        """An epoch ended and its validation ran: a pause, not a restart of the virtual clock."""
        self.core.end_epoch()
        self.core.begin_epoch(self.cluster.now, metrics)

    def stop(self) -> None:
        self.core.stop()

    def pop_records(self):
        return self.core.pop_records()

    def stats(self) -> dict:
        stats = {**self.core.stats(), "virtual_time_s": self.cluster.now}
        if self.adaptive_h is not None:
            stats["h_history"] = list(self.adaptive_h.history)  # (virtual seconds, H) at each change
        return stats

    # ---------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict:
        # Parameters, optimizer and schedulers are saved by Lightning and the strategy, and the
        # optimizer wrapped for the schedulers cannot be pickled: the state is re-attached.
        core = self.core.__dict__.copy()
        core["state"], core["_records"] = None, []
        core["observer"] = None  # an event log is written by its own fit only
        return {"core": core, "cluster": self.cluster, "inner_states": self.inner_states,
                "adaptive_h": self.adaptive_h, "inner_steps": self.inner_steps}

    def __setstate__(self, saved: dict) -> None:
        self.core = ServerCore.__new__(ServerCore)
        self.core.__dict__.update(saved["core"])
        self.cluster = saved["cluster"]
        self.inner_states = saved.get("inner_states", {})
        self.adaptive_h = saved.get("adaptive_h")
        self.inner_steps = saved.get("inner_steps", self.core.updates * self.cluster.local_steps)
        self.cluster.rules = self.core.rules

    def attach(self, state: ServerState) -> None:
        """Reconnect an unpickled server to its restored `ServerState`."""
        self.core.state = state
