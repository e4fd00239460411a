"""A strongly convex least-squares problem whose constants are known exactly, for theory checks."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_stale.data.base import InMemoryDataModule


class ConvexDataModule(InMemoryDataModule):
    """L2-regularised least squares on generated Gaussian data.

    Objective over the n training samples (x_i, y_i)::

        F(w) = (1/2n) ||X w - y||^2 + (l2/2) ||w||^2 = (1/n) sum_i f_i(w),
        f_i(w) = (1/2) (x_i . w - y_i)^2 + (l2/2) ||w||^2.

    F has the constant Hessian H = X^T X / n + l2 I, so it is L-smooth and c-strongly convex with
    L = lambda_max(H) (``smoothness``) and c = lambda_min(H) (``strong_convexity``), and its
    minimiser is w* = H^{-1} X^T y / n (``optimum``), F* = F(w*) (``optimal_loss``).
    These are the constants of the error bound of Dutta et al. (AISTATS 2018) recalled in
    docs/method.md: for the sync family (K-sync, K-batch-sync) with a small enough step eta,

        E[F(w_J)] - F* <= eta L sigma^2 / (2 c K m) + (1 - eta c)^J (F(w_0) - F* - floor),

    where sigma^2 / m bounds the variance of an m-sample mini-batch gradient; sigma^2 is the
    per-sample gradient variance given by ``gradient_variance`` (see ``sync_error_floor``).

    Data: x ~ N(0, Sigma) with Sigma's eigenvalues spread log-uniformly from 1 down to
    1 / ``condition_number`` in a random basis (non-isotropic, so L and c differ); y = x . w_true
    + ``noise`` * N(0, 1), w_true ~ N(0, I). No intercept, so the model has no bias
    (``LinearRegression(bias=False)``). Generated at construction from ``seed``, deterministic.

    Splits: train is the n samples. Val, test and predict iterate over the same n samples in
    order, so an epoch-mean val loss of ``LeastSquares`` equals F(w) exactly (when ``batch_size``
    divides n, or with batch-size-weighted means): the quantity the bound is about.
    """

    def __init__(self, num_samples: int = 2048, num_features: int = 20, noise: float = 0.5,
                 l2: float = 0.1, batch_size: int = 32, condition_number: float = 100.0,
                 num_workers: int = 0, seed: int = 0, drop_last: bool = True) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed,
                         drop_last=drop_last)
        if l2 < 0 or condition_number < 1:
            raise ValueError(f"need l2 >= 0 and condition_number >= 1, got {l2}, "
                             f"{condition_number}")
        self.num_samples, self.num_features = int(num_samples), int(num_features)
        self.noise, self.l2 = float(noise), float(l2)
        self.input_shape = (self.num_features,)
        self.num_classes = 1

        rng = np.random.default_rng(self.seed)
        basis, _ = np.linalg.qr(rng.standard_normal((self.num_features, self.num_features)))
        feature_std = np.logspace(0.0, -0.5 * np.log10(condition_number), self.num_features)
        z = rng.standard_normal((self.num_samples, self.num_features))
        self.features = (z * feature_std) @ basis.T  # float64: exact constants
        self.true_weights = rng.standard_normal(self.num_features)
        self.targets = (self.features @ self.true_weights
                        + self.noise * rng.standard_normal(self.num_samples))

        self.hessian = (self.features.T @ self.features / self.num_samples
                        + self.l2 * np.eye(self.num_features))
        eigenvalues = np.linalg.eigvalsh(self.hessian)
        self.smoothness = float(eigenvalues[-1])
        self.strong_convexity = float(eigenvalues[0])
        self.optimum = np.linalg.solve(self.hessian,
                                       self.features.T @ self.targets / self.num_samples)
        self.optimal_loss = self.objective(self.optimum)

    @staticmethod
    def _as_vector(w) -> np.ndarray:
        if isinstance(w, torch.Tensor):
            w = w.detach().cpu().double().numpy()
        return np.asarray(w, dtype=np.float64).reshape(-1)

    def objective(self, w) -> float:
        """F(w) on the full training set, in float64 (w: array or tensor of num_features)."""
        w = self._as_vector(w)
        residual = self.features @ w - self.targets
        return float(0.5 * np.mean(residual ** 2) + 0.5 * self.l2 * w @ w)

    def gradient(self, w) -> np.ndarray:
        """grad F(w) = X^T (X w - y) / n + l2 w."""
        w = self._as_vector(w)
        return self.features.T @ (self.features @ w - self.targets) / self.num_samples + self.l2 * w

    def gradient_variance(self, w=None) -> float:
        """sigma^2 = (1/n) sum_i ||grad f_i(w) - grad F(w)||^2, at w* unless ``w`` is given.

        The per-sample variance: a mini-batch of m samples drawn uniformly with replacement has
        gradient variance sigma^2 / m, the form docs/method.md's bound assumes. The l2 term is common to
        every f_i and cancels, leaving the spread of x_i (x_i . w - y_i).
        """
        w = self.optimum if w is None else self._as_vector(w)
        residual = self.features @ w - self.targets
        per_sample = self.features * residual[:, None]
        deviation = per_sample - per_sample.mean(axis=0)
        return float(np.mean(np.sum(deviation ** 2, axis=1)))

    def sync_error_floor(self, lr: float, k: int, batch_size: int | None = None) -> float:
        """eta L sigma^2 / (2 c K m): the sync-family error floor of docs/method.md (Dutta et al. 2018),
        with sigma^2 at w* and m = ``batch_size`` (this module's by default)."""
        m = self.batch_size if batch_size is None else batch_size
        return (lr * self.smoothness * self.gradient_variance()
                / (2.0 * self.strong_convexity * k * m))

    def _build_splits(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        train = TensorDataset(torch.as_tensor(self.features, dtype=torch.float32),
                              torch.as_tensor(self.targets, dtype=torch.float32))
        # Val/test are the training set itself: the bound concerns the training objective F.
        return train, train, train
