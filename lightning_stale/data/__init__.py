"""Data modules: scikit-learn digits (default, embedded), MNIST and CIFAR-10 from local files,
a generated strongly convex least-squares problem with exact constants, and the characters of
Python's help texts for a small language model."""

from lightning_stale.data.base import InMemoryDataModule, NormalizedImageDataset
from lightning_stale.data.cifar10 import CIFAR10_FILES, CIFAR10DataModule, read_cifar_batch
from lightning_stale.data.convex import ConvexDataModule
from lightning_stale.data.digits import DigitsDataModule
from lightning_stale.data.mnist import MNIST_FILES, MNISTDataModule, read_idx
from lightning_stale.data.python_docs import CharWindows, PythonDocsDataModule

__all__ = [
    "CIFAR10_FILES",
    "MNIST_FILES",
    "CIFAR10DataModule",
    "CharWindows",
    "ConvexDataModule",
    "DigitsDataModule",
    "InMemoryDataModule",
    "MNISTDataModule",
    "NormalizedImageDataset",
    "PythonDocsDataModule",
    "read_cifar_batch",
    "read_idx",
]
