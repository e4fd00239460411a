"""The same kind of module as tests/user_modules.py, written against the ``lightning`` package
(``import lightning as L``), for the tests of both namespaces. Import it only where ``lightning``
is installed."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from user_modules import blobs


class LitBlobs(L.LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        self.train_set, self.val_set = TensorDataset(*blobs()), TensorDataset(*blobs(96, seed=1))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=32)


class LitClassifier(L.LightningModule):
    """An MLP under AdamW with a linear warm-up sized from ``estimated_stepping_batches``."""

    def __init__(self, lr: float = 0.01, warmup: float = 0.5):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.total_steps = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        self.total_steps = self.trainer.estimated_stepping_batches
        warmup = max(1, int(self.hparams.warmup * self.total_steps))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
