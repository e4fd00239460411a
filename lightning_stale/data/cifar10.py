"""CIFAR-10 read from a local folder in torchvision's python-pickle layout."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from lightning_stale.data.base import LocalImageDataModule, find_files

CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled CIFAR batch: ``b"data"`` is uint8 of shape (N, 3072), each row the 1024 red,
    then green, then blue pixels of a 32x32 image in row-major order; ``b"labels"`` has N ints
    (format described at https://www.cs.toronto.edu/~kriz/cifar.html)."""
    with open(path, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise ValueError(f"{path}: unexpected CIFAR batch shapes data {data.shape}, "
                         f"labels {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


class CIFAR10DataModule(LocalImageDataModule):
    """CIFAR-10 from ``<data_dir>/cifar-10-batches-py/`` (torchvision's layout), no download.

    Expects ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, checked at construction.
    ``input_shape`` is ``(3, 32, 32)``. Pixels are scaled to [0, 1] and normalised per channel
    with the training set's mean (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616).
    Train and val are a seeded split of the 50,000 training images (``val_fraction``; with 0 the
    val loader reuses the test set); test is ``test_batch``. No augmentation: the paper's
    experiments compare training loss against wall-clock time, and augmentation would only add
    data-loading time to every learner's compute time.
    """

    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def __init__(self, data_dir: str | Path = "data", batch_size: int = 64,
                 val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0,
                 drop_last: bool = True) -> None:
        super().__init__(data_dir, batch_size, val_fraction, num_workers, seed, drop_last)
        self.input_shape = (3, 32, 32)
        self.num_classes = 10
        self.files = find_files(
            self.data_dir / "cifar-10-batches-py", CIFAR10_FILES,
            hint="Copy them there (torchvision.datasets.CIFAR10(root, download=True) on a "
                 "machine with network access extracts exactly this layout under root) and "
                 "pass data_dir=root.")

    def _read(self):
        parts = [read_cifar_batch(self.files[f"data_batch_{i}"]) for i in range(1, 6)]
        train_images = torch.from_numpy(np.concatenate([images for images, _ in parts]))
        train_labels = torch.from_numpy(np.concatenate([labels for _, labels in parts]))
        test_images, test_labels = map(torch.from_numpy, read_cifar_batch(self.files["test_batch"]))
        return train_images, train_labels, test_images, test_labels
