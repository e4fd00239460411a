"""`StaleStrategy`'s local updates (docs/how-to/local-updates.md, "On the real engine"): its
options and refusals, and each learner's Lightning training step as one inner step of its round
(`engine.distributed.local_steps.LocalSteps`)."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from lightning_stale.engine.core import ServerLimits
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.local_steps import LocalSteps
from lightning_stale.method.adaptive import AdaptiveH
from lightning_stale.strategies.lightning_api import set_global_step
from lightning_stale.strategies.local_updates import OuterFactory, check_real_engine_local_updates


class LearnerRounds:
    """Mixin for `StaleStrategy` (which provides the learner, the closure's run and the counters)."""

    _outer: OuterFactory | None
    _schedulers: list  # Lightning's LR scheduler configs (`take_over_schedulers`)
    optimizers: list
    _batch_samples: int  # the samples of this inner step's micro-batches (the strategy counts them)
    _rounds: LocalSteps | None = None  # this rank's rounds of local updates (set at train start)
    _pushes_per_epoch: int

    def _init_learner_rounds(self, local_steps: Any, outer_optimizer: Any, adaptive_h: Any, server: str,
                             record_events: Any, payload_channels: bool) -> str:
        """Check the options; returns the server path to use (local updates: the central one, or
        the collective one where given)."""
        self._outer = check_real_engine_local_updates(local_steps, outer_optimizer, adaptive_h, server,
                                                      record_events, payload_channels)
        self.local_updates = self._outer is not None
        self.local_steps, self.outer_optimizer, self.adaptive_h = int(local_steps), outer_optimizer, adaptive_h
        return "central" if self.local_updates and server == "auto" else server  # ("auto" chooses it)

    def refuse_schedulers(self, schedulers: list) -> None:
        """With local updates, each learner steps its inner optimizer's LR schedulers along the
        server's trajectory (`engine.schedules.LearnerSchedules`). An epoch-interval
        ``ReduceLROnPlateau`` steps at every epoch's end on rank 0's monitored metric, handed to
        every learner (`handed_metrics`); a step-interval one is refused (at setup, where the
        schedulers are known): stepped per server update it would read, on each learner, the
        metrics that learner logged itself, and the learners' learning rates would part."""
        plateaus = [c for c in schedulers if c.reduce_on_plateau and c.interval == "step"]
        if self.local_updates and plateaus:
            raise ValueError(f"StaleStrategy with local_steps={self.local_steps} cannot run "
                             f"{type(plateaus[0].scheduler).__name__} with interval='step': each learner "
                             "would step it on the metrics it logged itself, so the learners' learning "
                             "rates would part; use interval='epoch' (stepped at every epoch's end on rank "
                             "0's value of the monitored metric, the same for every learner), a schedule "
                             "of the step count (LambdaLR, StepLR, CosineAnnealingLR, ...), or "
                             "SimulatedStaleStrategy")

    def handed_metrics(self, metrics: dict[str, float]) -> dict[str, float] | None:
        """On rank 0 when training goes on after an epoch's end: what the server hands every
        learner for its plateau schedulers (`handed_metrics`; None without local updates)."""
        return handed_metrics(self._schedulers, metrics) if self.local_updates else None

    def start_rounds(self, learner: Learner) -> LocalSteps | None:
        """This rank's rounds of local updates (None without them), its inner optimizer's LR
        schedulers stepped along the server's trajectory."""
        if not self.local_updates:
            return None
        return LocalSteps(learner, self.optimizers[0], self.local_steps, self._schedulers,
                          adaptive=self.adaptive_h is not None)

    def fresh_adaptive_h(self) -> AdaptiveH | None:
        """This fit's own AdaComm schedule, for rank 0's server (the caller's object stays as it is)."""
        schedule = copy.deepcopy(AdaptiveH.create(self.adaptive_h, h0=self.local_steps))
        if schedule is not None:
            schedule.reset()
        return schedule

    def server_limits(self, trainer: Any) -> ServerLimits:
        """The server's limits: with local updates ``max_steps`` counts inner steps, H per server
        update, as ``global_step`` does (ceil(max_steps / H) updates); under AdaComm the server
        stops once the H of its updates sum to ``max_steps``, and an epoch is the pushes' inner
        steps summing to one pass (the pushes of H_0 times H_0), as on `SimulatedStaleStrategy`."""
        max_steps = trainer.max_steps
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        if self.adaptive_h is not None:
            return ServerLimits(max_inner_steps=max_steps, max_epochs=max_epochs, epoch_in_inner_steps=True,
                                pushes_per_epoch=self._pushes_per_epoch * self.local_steps)
        max_updates = max_steps if max_steps < 0 else math.ceil(max_steps / self.local_steps)
        return ServerLimits(max_updates=max_updates, pushes_per_epoch=self._pushes_per_epoch, max_epochs=max_epochs)

    def _local_step(self, rounds: LocalSteps, model, optimizer, closure) -> Any:
        """One inner step of this learner's round (its own optimizer steps); the round's last
        pushes the pseudo-gradient. ``global_step`` is H x the server updates (under AdaComm the
        sum of their H, as the server counts them), as on `SimulatedStaleStrategy`."""
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        trainer, learner = self.lightning_module.trainer, self._fitting
        if loss is not None:  # (a skipped training_step is no step: the round goes on)
            loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
            self.guarded(rounds.step, loss_value, self._batch_samples, overflow)
            if rounds.pushed:
                self.minibatch_times.append(learner.last_x)  # the round's time, for MiniBatchTimer
        self._batch_samples = 0
        self.note_dead_learners(trainer)
        set_global_step(trainer, rounds.inner_steps)
        if learner.stopped:
            trainer.should_stop = True
        return loss

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.local_updates and self.fitting():
            raise ValueError(f"resuming a fit (ckpt_path={checkpoint_path!r}) with local_steps="
                             f"{self.local_steps} is not supported on StaleStrategy: the learners' inner "
                             "optimizer states are not saved; resume on SimulatedStaleStrategy, or start "
                             "a new fit from the checkpoint's weights (LightningModule.load_from_checkpoint)")
        return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]


def handed_metrics(schedulers: list, metrics: dict[str, float]) -> dict[str, float] | None:
    """Rank 0's values of the metrics that the learners' epoch-interval plateau schedulers monitor
    (None where none runs), logged by an epoch's end (its validation included): the server hands
    them to every learner, so that all step on the same value, as every DDP rank steps on the
    metric logged with ``sync_dist=True``, and as the simulated engine steps on rank 0's. A metric
    that is missing gets Lightning's own error (with ``strict=False``, its warning, and the
    schedulers skip that step, as Lightning's do)."""
    plateaus = [c for c in schedulers if c.reduce_on_plateau]
    if not plateaus:
        return None
    for config in plateaus:
        if config.monitor in metrics:
            continue
        if config.strict:  # (Lightning's words: `_TrainingEpochLoop._update_learning_rates`)
            raise MisconfigurationException(
                f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not available. "
                f"Available metrics are: {list(metrics)}. Condition can be set using `monitor` key "
                "in lr scheduler dict")
        rank_zero_warn(f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not available "
                       "but strict is set to `False`. Skipping learning rate update.", category=RuntimeWarning)
    return {c.monitor: metrics[c.monitor] for c in plateaus if c.monitor in metrics}
