"""A learner that dies mid-training must end the run with an error, not a hang."""

import os
import signal

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from common import QUIET
from lightning_stale import StaleStrategy
from lightning_stale.models import MLP, Classifier


class DieAtStep(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == 2 and trainer.global_step >= 10:
            os.kill(os.getpid(), signal.SIGKILL)


data = TensorDataset(torch.randn(50_000, 8), torch.randint(0, 4, (50_000,)))
trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=100_000, callbacks=[DieAtStep()],
                     strategy=StaleStrategy("k_sync", 3), **QUIET)
trainer.fit(Classifier(MLP((8,), 4), lr=0.05), DataLoader(data, batch_size=16))
