"""The server core on a virtual clock (docs/method.md, "Setting"): `SimulatedServer` is
`ServerCore` driven by a `VirtualCluster`; the caller computes the gradient of the learner that
finishes next on the parameters it last pulled (`parameters_for`) and hands it to `push`, and
cancelled work is never computed. With local updates (docs/how-to/local-updates.md) a push takes
H draws on the clock and carries the pseudo-gradient of H inner steps."""

from __future__ import annotations

from torch import Tensor

from lightning_stale.engine.core import Outcome, ServerCore, ServerLimits
from lightning_stale.engine.state import Contribution, ServerState
from lightning_stale.method.adaptive import AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from lightning_stale.method.virtual_clock import Finish, VirtualCluster


class SimulatedServer:
    """One simulated run of one variant (``local_steps``: H mini-batches per push)."""

    def __init__(self, state: ServerState, variant: Variant, delay, compute_time: float = 0.0,
                 adaptive: AdaptiveK | None = None,
                 compensation: StalenessCompensation | None = None,
                 limits: ServerLimits | None = None, local_steps: int = 1) -> None:
        # Every learner computes at its own version: the core keeps those parameters.
        self.core = ServerCore(variant, state, limits, adaptive, compensation, keep_snapshots=True)
        self.cluster = VirtualCluster(self.core.rules, delay, compute_time, local_steps)
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
        outcome = self.core.push(finish.learner, finish.version, self.cluster.now,
                                 contribution=contribution, loss=loss, samples=samples,
                                 unusable=unusable)
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
        return {**self.core.stats(), "virtual_time_s": self.cluster.now}

    # ---------------------------------------------------------------- checkpoints
    def __getstate__(self) -> dict:
        # Parameters, optimizer and schedulers are saved by Lightning and the strategy, and the
        # optimizer wrapped for the schedulers cannot be pickled: the state is re-attached.
        core = self.core.__dict__.copy()
        core["state"], core["_records"] = None, []
        core["observer"] = None  # an event log is written by its own fit only
        return {"core": core, "cluster": self.cluster, "inner_states": self.inner_states}

    def __setstate__(self, saved: dict) -> None:
        self.core = ServerCore.__new__(ServerCore)
        self.core.__dict__.update(saved["core"])
        self.cluster = saved["cluster"]
        self.inner_states = saved.get("inner_states", {})
        self.cluster.rules = self.core.rules

    def attach(self, state: ServerState) -> None:
        """Reconnect an unpickled server to its restored `ServerState`."""
        self.core.state = state
