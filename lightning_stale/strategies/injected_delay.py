"""Straggler delays for strategies that have none of their own (Lightning's ``ddp``).

The parameter-server engines draw a delay per mini-batch inside the learner. Lightning's stock
DDP has no such hook, so a comparison against it under stragglers needs the delay injected from
outside: `InjectedDelay` sleeps each rank's draw after its backward pass, as the server engine's
default ``delay_mode="after_compute"`` does. Under DDP the gradients of a step are all-reduced
during backward, so the sleep holds back the rank's *next* step, and every all-reduce waits for
the slowest rank: fully synchronous SGD with X = compute + draw (docs/method.md, "Setting";
``benchmarks/straggler_win.py`` measures it against E[T] of the sync variant,
docs/benchmarks/straggler_win.md).
"""

from __future__ import annotations

import time
from typing import Any

from pytorch_lightning import Callback, LightningModule, Trainer


class InjectedDelay(Callback):
    """Sleeps ``delay.sample(global_rank)`` seconds on every rank before each optimizer step.

    Args:
        delay: a straggler model from `lightning_stale.delays` (``sample(learner)`` in seconds);
            rank r draws from learner r's stream, the stream the server engine's learner r uses,
            so the same seed gives both engines the same delays.
    """

    def __init__(self, delay: Any) -> None:
        if not callable(getattr(delay, "sample", None)):
            raise ValueError(f"delay must be a straggler model with sample(learner), got {delay!r}")
        self.delay = delay
        self.slept_s = 0.0  # this rank's total, for checks and reports

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # A model naming learners that do not exist (slow_learners, trace) fails here, before
        # the first step, with the model's own message.
        if hasattr(self.delay, "check_learners"):
            self.delay.check_learners(trainer.world_size)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        seconds = float(self.delay.sample(trainer.global_rank))
        if seconds > 0:
            time.sleep(seconds)
            self.slept_s += seconds
