"""Lightning's LR scheduler configs, stepped by whoever applies the updates instead of by
Lightning's loop: ``"step"`` intervals count server updates (H steps each with local updates, as
``trainer.global_step``: docs/how-to/local-updates.md), ``"epoch"`` ones epochs after validation;
a ``ReduceLROnPlateau`` reads its ``monitor`` among the logged metrics. `LearnerSchedules`: a real
learner's inner optimizer's, with local updates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.optim import Optimizer


class Schedules:
    """The scheduler configs of one optimizer, stepped here instead of by Lightning's loop.

    The schedulers stay on the learner's optimizer (``learner_optimizer``), where Lightning,
    callbacks such as ``LearningRateMonitor`` and checkpoints read the schedule. Where another
    optimizer takes the steps (``stepped``: the server's copy, or a shard of it), its group
    options (learning rate, momentum, ...) are copied from the learner's before every step and
    after every scheduler step. ``metrics``: the latest logged values, for plateau schedulers
    stepped per update; ``steps_per_update``: H with local updates, else 1."""

    steps_per_update = 1
    steps_done: int | None = None  # steps counted before the next update, where H varies

    def __init__(self, configs: Sequence[Any], learner_optimizer: Optimizer,
                 stepped: Optimizer | None = None, steps_per_update: int = 1) -> None:
        self.configs = list(configs)
        self.steps_per_update = steps_per_update
        self.learner_optimizer = learner_optimizer
        self.stepped = learner_optimizer if stepped is None else stepped
        self.metrics: dict[str, float] = {}
        self.sync_options()

    def before_step(self) -> None:
        """The stepped optimizer is about to step."""
        self.sync_options()
        self.learner_optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's schedulers check it

    def sync_options(self) -> None:
        """The learner optimizer's group options into the stepped optimizer."""
        if self.stepped is self.learner_optimizer:
            return
        for mine, theirs in zip(self.stepped.param_groups, self.learner_optimizer.param_groups):
            mine.update((k, v) for k, v in theirs.items() if k != "params")

    def after_update(self, update_index: int) -> None:
        """Update ``update_index`` (from 1) was applied: step what its steps make due (where H
        varies, the engine sets ``steps_done`` before it and ``steps_per_update`` to its H)."""
        h = self.steps_per_update
        first = (update_index - 1) * h if self.steps_done is None else self.steps_done
        for step in range(first + 1, first + h + 1):
            for config in self.configs:
                if config.interval == "step" and step % config.frequency == 0:
                    _step(config, self.metrics)
        self.sync_options()

    def end_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Epoch ``epoch`` (from 0) ended and its validation ran: step what is due."""
        for config in self.configs:
            if config.interval == "epoch" and (epoch + 1) % config.frequency == 0:
                _step(config, metrics)
        self.sync_options()

    def states(self) -> list[dict]:
        return [c.scheduler.state_dict() for c in self.configs]

    def load_states(self, states: Sequence[dict]) -> None:
        for config, s in zip(self.configs, states):
            config.scheduler.load_state_dict(s)
        self.sync_options()


class LearnerSchedules(Schedules):
    """A real learner's inner optimizer's schedulers with local updates (docs/how-to/local-updates.md,
    "What steps, epochs and schedules count"), stepped by the learner itself along the server's
    trajectory: the server's version v stands for v x H inner steps (under AdaComm's varying H, the
    sum of the H of its updates, as the server says), so before a round that starts from version v
    the step-interval schedulers are brought to that step (`follow`), and all the inner steps of the
    round run at that learning rate. This is the simulated engine's meaning
    (`SimulatedServer`: the schedule advances H steps at every update, and a round runs at the
    value of the server's update count when it is computed): the same value wherever a pushed
    round's version is the server's latest when it arrives, as under the sync family (a stale
    round is cancelled there); under the async family a round of staleness s ran at the value s x H
    steps earlier than the simulated engine's, which computes it at its push. Epoch-interval
    schedulers step once an epoch has ended (`epoch_ended`), after the step-interval ones reached
    the server's version at that end, as the simulated engine orders them. Each learner steps its
    own copies. An epoch-interval ``ReduceLROnPlateau`` steps on the metrics rank 0 logged by the
    epoch's end (its validation included), which the server hands every learner when training goes
    on (`Learner.epoch_metrics`): the value the simulated engine steps on, and under DDP, where every
    rank steps on the metric logged with ``sync_dist=True``, the same on every rank; so the learners'
    learning rates stay equal. A step-interval one is refused (`strategies.learner_rounds`)."""

    def __init__(self, configs: Sequence[Any], optimizer: Optimizer, steps_per_update: int) -> None:
        assert not any(c.reduce_on_plateau and c.interval == "step" for c in configs), "refused at setup"
        super().__init__(configs, optimizer, steps_per_update=steps_per_update)
        self.followed = 0  # the inner step the step-interval schedulers stand at
        self.plateaus = any(c.reduce_on_plateau for c in configs)  # (they need rank 0's metrics)

    def follow(self, inner_steps: int) -> None:
        """Bring the step-interval schedulers to inner step ``inner_steps`` of the server's
        trajectory (never back)."""
        if self.followed < inner_steps:
            self.before_step()  # (torch warns of a scheduler stepped before its optimizer)
            self.steps_done, self.steps_per_update = self.followed, inner_steps - self.followed
            self.after_update(0)
            self.followed = inner_steps

    def epoch_ended(self, epoch: int, inner_steps: int, metrics: Mapping[str, float] | None = None) -> None:
        """The server's epoch ``epoch`` (from 0) ended at inner step ``inner_steps``; ``metrics``:
        rank 0's monitored values then, for the plateau schedulers."""
        self.follow(inner_steps)
        self.end_epoch(epoch, metrics or {})


def _step(config: Any, metrics: Mapping[str, float]) -> None:
    if not config.reduce_on_plateau:
        config.scheduler.step()
        return
    value = metrics.get(config.monitor)
    if value is None:
        if config.strict:
            raise ValueError(f"ReduceLROnPlateau monitors {config.monitor!r}, which is not among "
                             f"the logged metrics {sorted(metrics)}: log it, or set strict=False")
        return
    config.scheduler.step(float(value))
