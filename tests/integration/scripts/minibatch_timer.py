"""MiniBatchTimer on 2 CPU processes, one launch: stock ddp with injected delays (learner 1 sleeps
six times longer than learner 0 after every backward pass), then StaleStrategy. Rank 0 writes the
paths of the two traces."""

import json
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from common import QUIET
from lightning_stale import StaleStrategy
from lightning_stale.data import DigitsDataModule
from lightning_stale.delays import Constant, ShiftedExponential, SlowLearners
from lightning_stale.models import MLP, Classifier
from lightning_stale.strategies.timing import MiniBatchTimer

torch.set_num_threads(1)
out = Path(sys.argv[1])


class SleepAfterBackward(pl.Callback):
    """Stragglers for stock ddp: each rank sleeps its own delay after backward (listed before
    the timer, so the sleep is part of the learner's recorded computation)."""

    def __init__(self, delay):
        self.delay = delay

    def on_before_optimizer_step(self, trainer, *args):
        time.sleep(self.delay.sample(trainer.global_rank))


results = {}
for name, strategy, callbacks in [
        ("ddp", "ddp", [SleepAfterBackward(SlowLearners(Constant(0.005), [1], 6.0))]),
        ("stale", StaleStrategy("k_async", 1, delay=ShiftedExponential(0.002, 0.005, seed=1)), [])]:
    pl.seed_everything(0)
    dm = DigitsDataModule(batch_size=16)
    model = Classifier(MLP(dm.input_shape, dm.num_classes), lr=0.2)
    timer = MiniBatchTimer(out.parent / f"{name}_times.csv")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=60,
                         limit_val_batches=0, callbacks=[*callbacks, timer], **QUIET)
    trainer.fit(model, dm)
    if trainer.global_rank == 0:
        results[name] = str(timer.written)
if trainer.global_rank == 0:
    out.write_text(json.dumps(results))
