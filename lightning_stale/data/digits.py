"""The 8x8 handwritten digits shipped inside scikit-learn: real data with no download."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_stale.data.base import InMemoryDataModule, seeded_split


class DigitsDataModule(InMemoryDataModule):
    """scikit-learn's digits (1,797 images of 8x8 pixels, 10 classes), the project's default.

    Pixels are integers 0..16 in the source (``sklearn.datasets.load_digits``); they are divided
    by 16 to lie in [0, 1] and kept flat, so ``input_shape`` is ``(64,)``. The 1,797 samples are
    split three ways, stratified by class and seeded: train, val (``val_fraction``) and test
    (``test_fraction``), disjoint and adding up to the whole set. With ``test_fraction=0`` there
    is no separate test split and the test (and predict) loaders reuse the val split.
    """

    num_samples = 1797

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, test_fraction: float = 0.2,
                 num_workers: int = 0, seed: int = 0, drop_last: bool = True) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed,
                         drop_last=drop_last)
        self.val_fraction = float(val_fraction)
        self.test_fraction = float(test_fraction)
        self.input_shape = (64,)
        self.num_classes = 10

    def _build_splits(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        features = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0
        labels = torch.as_tensor(digits.target, dtype=torch.long)
        train, val, test = seeded_split(len(labels), self.val_fraction, self.test_fraction,
                                        self.seed, labels=labels)
        train_set, val_set = (TensorDataset(features[part], labels[part]) for part in (train, val))
        test_set = TensorDataset(features[test], labels[test]) if len(test) else val_set
        return train_set, val_set, test_set
