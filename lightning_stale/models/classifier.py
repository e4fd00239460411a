"""LightningModule for classification with any of the package's networks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from pytorch_lightning import LightningModule
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

NetFactory = Callable[[tuple, int], nn.Module]


def build_net(net: nn.Module | NetFactory, input_shape: Sequence[int] | None,
              num_classes: int | None) -> nn.Module:
    """Return ``net`` itself if it is a module, else call it as ``net(input_shape, num_classes)``
    (a class, or the ``functools.partial`` Hydra makes from a ``_partial_: true`` config)."""
    if isinstance(net, nn.Module):
        return net
    if not callable(net):
        raise TypeError(f"net must be an nn.Module or a callable building one, got {type(net)}")
    if input_shape is None or num_classes is None:
        raise ValueError("net is a factory, so input_shape and num_classes are needed to build it "
                         "(pass the data module's input_shape and num_classes)")
    return net(tuple(int(size) for size in input_shape), int(num_classes))


def make_optimizer(name: str, parameters, lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """"sgd" (with ``momentum``), "adam" or "adamw"; ``weight_decay`` as each defines it."""
    name = name.lower()
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose sgd, adam or adamw")


class Classifier(LightningModule):
    """Cross-entropy classification around ``net``.

    Args:
        net: an ``nn.Module``, or a callable ``(input_shape, num_classes) -> nn.Module``; Hydra
            passes a ``_partial_: true`` net config, built here from ``input_shape`` and
            ``num_classes`` (the app passes the data module's).
        lr: learning rate eta. Gradients averaged over K learners are applied with this eta, not
            rescaled by K (docs/method.md's update rule).
        optimizer: "sgd" | "adam" | "adamw".
        momentum: SGD momentum (the paper's analysis is for plain SGD, momentum 0).
        weight_decay: passed to the optimizer.
        scheduler: None (constant lr) | "cosine" (``CosineAnnealingLR`` to 0 over
            ``schedule_length`` intervals) | "step" (``StepLR``: lr times ``gamma`` every
            ``step_size`` intervals).
        scheduler_interval: "step" advances the scheduler after every optimizer step, "epoch" after
            every training epoch; ``step_size`` and ``schedule_length`` count these intervals.
        schedule_length: cosine period; by default the trainer's ``estimated_stepping_batches``
            (interval "step") or ``max_epochs`` (interval "epoch").
        input_shape, num_classes: the data's, needed when ``net`` is a factory; ``num_classes``
            otherwise defaults to ``net.num_classes``.

    Logs ``train/loss`` every step (unsynchronised: cheap, and no collective a straggling or
    stale learner would have to join), ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc`` per
    epoch, synchronised across processes. ``predict_step`` returns predicted class indices.
    """

    def __init__(self, net: nn.Module | NetFactory, lr: float = 0.1, optimizer: str = "sgd",
                 momentum: float = 0.0, weight_decay: float = 0.0, scheduler: str | None = None,
                 scheduler_interval: str = "step", step_size: int = 1000, gamma: float = 0.1,
                 schedule_length: int | None = None, input_shape: Sequence[int] | None = None,
                 num_classes: int | None = None) -> None:
        super().__init__()
        # Plain Python values, so the saved hyperparameters do not hold Hydra ListConfigs.
        input_shape = None if input_shape is None else tuple(int(size) for size in input_shape)
        self.net = build_net(net, input_shape, num_classes)
        num_classes = int(num_classes if num_classes is not None
                          else getattr(self.net, "num_classes", 0))
        if num_classes < 2:
            raise ValueError("num_classes must be >= 2: pass it, or give net a num_classes attribute")
        if scheduler not in (None, "cosine", "step"):
            raise ValueError(f"unknown scheduler {scheduler!r}: choose None, 'cosine' or 'step'")
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.save_hyperparameters(ignore=["net"])
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(y))
        return loss

    def _evaluate(self, batch, stage: str, accuracy: MulticlassAccuracy) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        accuracy.update(logits.argmax(dim=-1), y)
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(y), prog_bar=stage == "val")
        # A Metric object is reduced (and synchronised by torchmetrics) once, at epoch end.
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=stage == "val")
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=-1)

    def _schedule_length(self) -> int:
        hp = self.hparams
        if hp["schedule_length"] is not None:
            return int(hp["schedule_length"])
        if hp["scheduler_interval"] == "step":
            length = self.trainer.estimated_stepping_batches
        else:
            length = self.trainer.max_epochs if self.trainer.max_epochs not in (None, -1) else math.inf
        if not math.isfinite(length):
            raise ValueError("the cosine schedule needs a finite length: set max_steps/max_epochs "
                             "on the Trainer, or schedule_length")
        return max(1, int(length))

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = make_optimizer(hp["optimizer"], self.parameters(), hp["lr"], hp["momentum"],
                                   hp["weight_decay"])
        if hp["scheduler"] is None:
            return optimizer
        if hp["scheduler"] == "cosine":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=self._schedule_length())
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(
                optimizer, step_size=hp["step_size"], gamma=hp["gamma"])
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": hp["scheduler_interval"]}}
