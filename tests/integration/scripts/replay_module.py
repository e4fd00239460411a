"""The module, data and Trainer limits that tests/integration/scripts/replay.py records and
tests/integration/test_replay_processes.py replays: both sides must build the same run."""

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

LIMITS = dict(max_steps=8, max_epochs=5)  # an epoch of 6 pushes ends before the stop
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)


class Blobs(pl.LightningDataModule):
    """80 samples of three Gaussian blobs in 8 dimensions, batches of 16."""

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        centres = 2.0 * torch.randn(3, 8, generator=g)
        y = torch.randint(3, (80,), generator=g)
        self.train_set = TensorDataset(centres[y] + torch.randn(80, 8, generator=g), y)
        self.val_set = TensorDataset(centres[y[:32]] + torch.randn(32, 8, generator=g), y[:32])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=32)


class DropoutBatchNormAdamW(pl.LightningModule):
    """BatchNorm, dropout, AdamW with a linear warm-up over 4 steps: buffers, optimizer state,
    a schedule and random state that a replay must all reproduce."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                                 nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def build_module():
    pl.seed_everything(3, verbose=False)  # the same initial parameters on every side
    return DropoutBatchNormAdamW()
