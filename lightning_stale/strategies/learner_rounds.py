"""`StaleStrategy`'s local updates (docs/how-to/local-updates.md, "On the real engine"): its
options and refusals, and each learner's Lightning training step as one inner step of its round
(`engine.distributed.local_steps.LocalSteps`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_stale.engine.distributed.local_steps import LocalSteps
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.strategies.lightning_api import set_global_step
from lightning_stale.strategies.local_updates import OuterFactory, check_real_engine_local_updates


class LearnerRounds:
    """Mixin for `StaleStrategy` (which provides the learner, the closure's run and the counters)."""

    _outer: OuterFactory | None
    _batch_samples: int  # the samples of this inner step's micro-batches (the strategy counts them)
    _rounds: LocalSteps | None = None  # this rank's rounds of local updates (set at train start)

    def _init_learner_rounds(self, local_steps: Any, outer_optimizer: Any, adaptive_h: Any, server: str,
                             record_events: Any, payload_channels: bool, on_learner_failure: str,
                             adaptive_k: Any, staleness_compensation: Any) -> str:
        """Check the options; returns the server path to use (local updates: the central one, or
        the collective one where given)."""
        compensation = StalenessCompensation.create(staleness_compensation)
        self._outer = check_real_engine_local_updates(local_steps, outer_optimizer, adaptive_h, server,
                                                      record_events, payload_channels, on_learner_failure,
                                                      adaptive_k, compensation)
        self.local_updates = self._outer is not None
        self.local_steps, self.outer_optimizer, self.adaptive_h = int(local_steps), outer_optimizer, None
        return "central" if self.local_updates and server == "auto" else server  # ("auto" chooses it)

    def refuse_schedulers(self, schedulers: list) -> None:
        """LR schedulers are refused with local updates (at setup, where they are known)."""
        if self.local_updates and schedulers:
            raise ValueError(f"StaleStrategy with local_steps={self.local_steps} cannot run LR schedulers "
                             f"({len(schedulers)} configured): each learner's inner optimizer would need "
                             "them stepped by inner steps along the server's trajectory; use a constant "
                             "learning rate, or SimulatedStaleStrategy for scheduled local updates")

    def max_updates(self, max_steps: int) -> int:
        """The server's limit: with local updates ``max_steps`` counts inner steps, H per server
        update, as ``global_step`` does (ceil(max_steps / H) updates)."""
        return max_steps if max_steps < 0 else math.ceil(max_steps / self.local_steps)

    def _local_step(self, rounds: LocalSteps, model, optimizer, closure) -> Any:
        """One inner step of this learner's round (its own optimizer steps); the round's last
        pushes the pseudo-gradient. ``global_step`` is H x the server updates, as on
        `SimulatedStaleStrategy`."""
        loss, overflow = self.compute_gradient(model, optimizer, closure)
        trainer, learner = self.lightning_module.trainer, self._fitting
        if loss is not None:  # (a skipped training_step is no step: the round goes on)
            loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
            self.guarded(rounds.step, loss_value, self._batch_samples, overflow)
            if rounds.pushed:
                self.minibatch_times.append(learner.last_x)  # the round's time, for MiniBatchTimer
        self._batch_samples = 0
        self.note_dead_learners(trainer)
        set_global_step(trainer, max(learner.version, 0) * self.local_steps)
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
