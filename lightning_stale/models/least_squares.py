"""LightningModule for the strongly convex least-squares problem of ``ConvexDataModule``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pytorch_lightning import LightningModule

from lightning_stale.models.classifier import make_optimizer
from lightning_stale.models.nets import LinearRegression


class LeastSquares(LightningModule):
    """Linear regression trained on F(w) = (1/2n)||X w - y||^2 + (l2/2)||w||^2.

    The loss of a mini-batch (X_b, y_b) of m samples is

        (1/2m) ||X_b w - y_b||^2 + (l2/2) ||w||^2,

    the mean of the per-sample objectives f_i of ``ConvexDataModule``: an unbiased estimate of
    F(w), whose gradient is an unbiased estimate of grad F(w), as the error bound of docs/method.md
    (Dutta et al. 2018) assumes. The l2 term is part of the loss rather than optimizer weight
    decay so that ``train/loss`` and ``val/loss`` are values of F itself; with ``bias=True`` only
    the weights are regularised (and ``ConvexDataModule.optimum`` no longer applies).

    Args:
        l2: regularisation strength; Hydra's config takes it from the data config
            (``${data.l2}``) so model and data always agree.
        lr: step size eta; docs/method.md's bound needs eta small enough (eta <= 1/L is safe).
        optimizer, momentum: as for ``Classifier``; theory checks use plain "sgd", momentum 0.
        bias: give the model an intercept (default False, matching the generated data).
        input_shape: the data's (num_features,); required.
        num_classes: accepted for a uniform app interface; must be 1 (or None).

    Logs ``train/loss`` per step (unsynchronised) and ``val/loss`` / ``test/loss`` per epoch
    (synchronised, weighted by batch size: equal to F(w) over ``ConvexDataModule``'s val split,
    which is the training set). ``predict_step`` returns the predictions X w.
    """

    def __init__(self, l2: float = 0.1, lr: float = 0.1, optimizer: str = "sgd",
                 momentum: float = 0.0, bias: bool = False,
                 input_shape: Sequence[int] | None = None, num_classes: int | None = 1) -> None:
        super().__init__()
        if input_shape is None:
            raise ValueError("LeastSquares needs input_shape, the data's (num_features,)")
        if num_classes not in (None, 1):
            raise ValueError(f"LeastSquares fits one scalar target, got num_classes={num_classes}")
        input_shape = tuple(int(size) for size in input_shape)
        num_classes = 1
        self.save_hyperparameters()
        self.net = LinearRegression(input_shape, 1, bias=bias)

    @property
    def weights(self) -> torch.Tensor:
        """w as a flat vector (a detached copy), comparable with ``ConvexDataModule.optimum``."""
        return self.net.linear.weight.detach().reshape(-1).clone()

    def load_weights(self, w) -> None:
        """Set w (array or tensor of num_features), e.g. to start every run from the same w_0."""
        weight = self.net.linear.weight
        with torch.no_grad():
            weight.copy_(torch.as_tensor(w, dtype=weight.dtype).reshape(weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        residual = self(x) - y
        weight = self.net.linear.weight
        return 0.5 * residual.pow(2).mean() + 0.5 * self.hparams["l2"] * weight.pow(2).sum()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(x, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(x, y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(y), prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(x, y)
        self.log("test/loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=len(y))
        return loss

    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return make_optimizer(hp["optimizer"], self.parameters(), hp["lr"], hp["momentum"])
