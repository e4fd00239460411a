"""Lightning's LR scheduler configs, stepped by whoever applies the updates (the server, or every
learner where an all-reduce combines the gradients) instead of by Lightning's loop.

Intervals mean what Lightning's config says, counted in server updates: ``interval="step"``
every ``frequency`` updates, ``"epoch"`` when an epoch's end is over (after its validation, as
Lightning steps them), a ``ReduceLROnPlateau`` with the value of its ``monitor`` among the
logged metrics (per update: the latest values reported; per epoch: those of the validation).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch.optim import Optimizer


class Schedules:
    """The scheduler configs of one optimizer (their schedulers are pointed at ``optimizer``).

    Attributes:
        metrics: the latest logged values, for plateau schedulers stepped per update.
    """

    def __init__(self, configs: Sequence[Any], optimizer: Optimizer) -> None:
        self.configs = list(configs)
        for config in self.configs:
            config.scheduler.optimizer = optimizer
        if self.configs:
            _mark_steps_for_schedulers(optimizer)
        self.metrics: dict[str, float] = {}

    @property
    def monitor_per_update(self) -> bool:
        """Whether a plateau scheduler is stepped per update (it needs the latest metrics)."""
        return any(c.reduce_on_plateau and c.interval == "step" for c in self.configs)

    def after_update(self, update_index: int) -> None:
        for config in self.configs:
            if config.interval == "step" and update_index % config.frequency == 0:
                _step(config, self.metrics)

    def end_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Epoch ``epoch`` (from 0) ended and its validation ran: step what is due."""
        for config in self.configs:
            if config.interval == "epoch" and (epoch + 1) % config.frequency == 0:
                _step(config, metrics)

    def states(self) -> list[dict]:
        return [c.scheduler.state_dict() for c in self.configs]

    def load_states(self, states: Sequence[dict]) -> None:
        for config, s in zip(self.configs, states):
            config.scheduler.load_state_dict(s)


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


def _mark_steps_for_schedulers(optimizer: Optimizer) -> None:
    # torch's schedulers warn unless optimizer.step was wrapped by them; stepping moved here.
    step = optimizer.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]
