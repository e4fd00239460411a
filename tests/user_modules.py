"""LightningModules written the way users write them for ``strategy="ddp"``, shared by the tests
that run them unchanged on both engines (tests/unit/test_user_modules.py,
tests/integration/scripts/user_modules.py).

The modules know nothing about lightning_stale: AdamW with a linear warm-up sized from
``estimated_stepping_batches``, torchmetrics accuracy logged with ``self.log``, a frozen
pretrained-style backbone, an unused head under weight decay, a CNN with ``BatchNorm2d`` and a
``ReduceLROnPlateau`` on ``val/loss`` (lightning-hydra-template style). ``fit_user_module`` fits
one of them in this process with the set-up several unit tests share (tests/engines.py).
"""

from __future__ import annotations

import time

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from engines import fit


def blobs(n: int = 192, features: int = 8, classes: int = 3, seed: int = 0, noise: float = 1.0):
    """Gaussian blobs around fixed centres: a small classification problem; ``seed`` draws the
    samples (one seed for training, another for validation)."""
    centres = 2.0 * torch.randn(classes, features, generator=torch.Generator().manual_seed(123))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (n,), generator=g)
    x = centres[y] + noise * torch.randn(n, features, generator=g)
    return x, y


class BlobData(pl.LightningDataModule):
    def __init__(
        self,
        batch_size: int = 16,
        n: int = 192,
        features: int = 8,
        image: bool = False,
        val_noise_labels: bool = False,
    ):
        super().__init__()
        self.batch_size, self.n, self.features, self.image = batch_size, n, features, image
        self.val_noise_labels = val_noise_labels

    def setup(self, stage=None):
        x, y = blobs(self.n, self.features)
        vx, vy = blobs(96, self.features, seed=1)
        if self.val_noise_labels:  # a validation loss that cannot keep improving
            vy = torch.randint(3, (96,), generator=torch.Generator().manual_seed(2))
        if self.image:  # 1 x 4 x (features / 4) "images" for the CNN
            x, vx = x.view(-1, 1, 4, self.features // 4), vx.view(-1, 1, 4, self.features // 4)
        self.train_set, self.val_set = TensorDataset(x, y), TensorDataset(vx, vy)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=32)


class Classifier(pl.LightningModule):
    """The common part: an MLP, cross-entropy, accuracy from torchmetrics."""

    def __init__(self, features: int = 8, classes: int = 3, hidden: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=classes)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class WarmupAdamW(Classifier):
    """AdamW with a linear warm-up over the first ``warmup`` of the run, then constant."""

    def __init__(self, warmup: float = 0.5, lr: float = 0.01, weight_decay: float = 0.01):
        super().__init__(lr=lr)
        self.save_hyperparameters()
        self.total_steps = None

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        self.total_steps = self.trainer.estimated_stepping_batches
        warmup_steps = max(1, int(self.hparams.warmup * self.total_steps))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class FrozenBackbone(Classifier):
    """A "pretrained" backbone frozen with requires_grad_(False); the optimizer is handed every
    parameter, as users often do."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr=lr)
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.net(self.backbone(x))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


class WideFrozenBatchNorm(WarmupAdamW):
    """AdamW with a warm-up, a frozen "pretrained" backbone and a BatchNorm head of 0.07M
    parameters: its gradients (0.29 MB) are too large for one message frame."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).requires_grad_(False)
        self.net = nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(),
                                 nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 3))

    def forward(self, x):
        return self.net(self.backbone(x))


class UnusedHead(Classifier):
    """A second head that training never uses, under AdamW's weight decay: no gradient reaches
    it, so under DDP (``ddp_find_unused_parameters_true``) it never moves."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr=lr)
        self.aux_head = nn.Linear(16, 2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.5)


class BatchNormCNN(Classifier):
    """A small CNN with BatchNorm2d on 1 x 4 x 2 inputs (BlobData(image=True))."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr=lr)
        self.net = nn.Sequential(
            nn.Conv2d(1, 6, 2, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, 3),
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class SlowSteps(Classifier):
    """10 ms of sleep in every training step: a fit long enough for ``max_time`` to end it."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


class Plateau(Classifier):
    """ReduceLROnPlateau on the validation loss, once per epoch (lightning-hydra-template)."""

    def __init__(self, lr: float = 0.2, factor: float = 0.5):
        super().__init__(lr=lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=self.hparams.factor, patience=0
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val/loss",
                "interval": "epoch",
                "frequency": 1,
            },
        }


class Lion(torch.optim.Optimizer):
    """A third-party optimizer with its own constructor (the Lion update, Chen et al. 2023),
    keeping one option outside ``defaults`` as some packages do."""

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        sign_scale: float = 1.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.sign_scale = sign_scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"].mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"] * self.sign_scale)
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return None


class Scheduled(torch.optim.SGD):
    """A third-party optimizer whose constructor needs an argument ``defaults`` does not hold:
    it cannot be rebuilt from its options."""

    def __init__(self, params, milestones, lr: float = 0.1):
        super().__init__(params, lr=lr, momentum=0.9)
        self.milestones = list(milestones)


class AnyOptimizer(pl.LightningModule):
    """Whatever optimizer ``make_optimizer(param_groups)`` builds, over two parameter groups with
    options of their own, a frozen layer inside the first group and an unused head inside the
    second. Every sample of its data is the same, so every mini-batch has the same gradient."""

    def __init__(self, make_optimizer, sparse: bool = False):
        super().__init__()
        self.make_optimizer, self.sparse = make_optimizer, sparse
        if sparse:
            self.embedding = nn.Embedding(10, 4, sparse=True)
        self.frozen = nn.Linear(4, 4, bias=False).requires_grad_(False)
        self.body = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 2, bias=False)
        self.unused = nn.Linear(4, 2, bias=False)

    def loss(self, batch):
        x, y = batch
        if self.sparse:
            return F.mse_loss(self.embedding(x).sum(1), y)
        return F.mse_loss(self.head(torch.tanh(self.body(self.frozen(x)))), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        if self.sparse:
            return self.make_optimizer([{"params": [self.embedding.weight]}])
        return self.make_optimizer(
            [
                {"params": [self.body.weight, self.frozen.weight]},
                {"params": [self.head.weight, self.unused.weight]},
            ]
        )

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = (
            torch.randint(10, (1, 3), generator=g)
            if self.sparse
            else torch.randn(1, 4, generator=g)
        )
        y = torch.randn(1, 4 if self.sparse else 2, generator=g)
        return DataLoader(TensorDataset(x.repeat(32, 1), y.repeat(32, 1)), batch_size=8)


def fit_user_module(
    engine: str,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    *,
    variant: str = "k_async",
    k: int | None = 2,
    learners: int = 3,
    **trainer_kwargs,
) -> pl.Trainer:
    """``engines.fit`` of ``model`` on ``engine`` with the set-up several unit tests share: K-async,
    K = 2 of 3 simulated learners (the real engine runs P = K = 1); returns the Trainer."""
    return fit(engine, model, datamodule, variant=variant, k=k, learners=learners, **trainer_kwargs)
