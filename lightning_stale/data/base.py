"""Shared plumbing for the in-memory data modules.

Every data set in this package is small enough to sit in memory as tensors, so each module only
has to produce three map-style datasets (train, val, test); this base class turns them into plain
``DataLoader``s. Plain loaders matter: a distributed strategy replaces the train sampler with its
own (Lightning's ``DistributedSampler`` injection, or a parameter-server strategy's), which only
works on map-style datasets with an ordinary sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from pytorch_lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset


class InMemoryDataModule(LightningDataModule):
    """Base for data modules whose splits are built once by ``_build_splits``.

    Subclasses set ``input_shape`` and ``num_classes`` in ``__init__`` (before ``setup``, so an
    app can size the model from the data config alone) and implement ``_build_splits``.

    Args:
        batch_size: samples per mini-batch (the paper's m).
        num_workers: DataLoader worker processes; 0 keeps loading in the training process,
            which is fastest for tensors already in memory.
        seed: seeds the train/val split and the order of training batches.
        drop_last: drop the last incomplete training batch, so that every gradient averages
            exactly ``batch_size`` samples (the error bound of docs/method.md assumes a fixed m).
            Evaluation loaders never drop samples.
    """

    input_shape: tuple[int, ...]
    num_classes: int

    def __init__(self, batch_size: int = 32, num_workers: int = 0, seed: int = 0,
                 drop_last: bool = True) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _build_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        """Return the (train, val, test) datasets."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        # Idempotent: Lightning calls setup once per stage, and every rank builds its own copy
        # (the data is small and deterministic, so all ranks see identical splits).
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self._build_splits()

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}._build_splits returned None for a split; "
                               "it must return three datasets (train, val, test)")
        # A seeded generator makes the order of training batches reproducible per seed.
        generator = torch.Generator().manual_seed(self.seed) if train else None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=self.drop_last and train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=generator,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        """Predictions run over the test split."""
        return self.test_dataloader()


class LocalImageDataModule(InMemoryDataModule):
    """Base for image data sets read from a local folder (MNIST, CIFAR-10): the training images
    are split into train and val by ``val_fraction`` (seeded), the test images are their own split
    (and stand in for val when ``val_fraction=0``). Images stay uint8 in memory and are normalised
    with the class's ``mean`` and ``std`` per sample when fetched.

    Subclasses implement ``_read() -> (train_images, train_labels, test_images, test_labels)``.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(self, data_dir: str | Path, batch_size: int, val_fraction: float,
                 num_workers: int, seed: int, drop_last: bool) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed,
                         drop_last=drop_last)
        self.data_dir = Path(data_dir)
        self.val_fraction = float(val_fraction)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _build_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        train_images, train_labels, test_images, test_labels = self._read()
        train, val, _ = seeded_split(len(train_labels), self.val_fraction, 0.0, self.seed)

        def dataset(images: torch.Tensor, labels: torch.Tensor) -> NormalizedImageDataset:
            return NormalizedImageDataset(images, labels, self.mean, self.std)

        test_set = dataset(test_images, test_labels)
        val_set = dataset(train_images[val], train_labels[val]) if len(val) else test_set
        return dataset(train_images[train], train_labels[train]), val_set, test_set


def seeded_split(num_items: int, val_fraction: float, test_fraction: float, seed: int,
                 labels: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Split ``range(num_items)`` into (train, val, test) index tensors; train takes the rest.

    With ``labels`` the split is stratified (each class divided in the same proportions, by
    scikit-learn's ``train_test_split``); without, it cuts a seeded random permutation.
    The same seed always gives the same split.
    """
    if val_fraction < 0 or test_fraction < 0 or val_fraction + test_fraction >= 1:
        raise ValueError("need val_fraction, test_fraction >= 0 with a sum below 1, got "
                         f"{val_fraction} and {test_fraction}")
    num_val = round(val_fraction * num_items)
    num_test = round(test_fraction * num_items)
    indices = torch.arange(num_items)
    if labels is None:
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed))
        test, val = order[:num_test], order[num_test:num_test + num_val]
        return order[num_test + num_val:], val, test

    from sklearn.model_selection import train_test_split

    def take(pool: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        if count == 0:
            return pool, pool[:0]
        rest, part = train_test_split(pool.numpy(), test_size=count, random_state=seed,
                                      stratify=labels[pool].numpy())
        return torch.as_tensor(rest), torch.as_tensor(part)

    rest, test = take(indices, num_test)
    train, val = take(rest, num_val)
    return train, val, test


class NormalizedImageDataset(Dataset):
    """Images kept as uint8 (a quarter of float32's memory) and normalised when fetched.

    Returns ``((image / 255 - mean) / std, label)`` with per-channel ``mean`` and ``std``.
    Every learner process holds its own copy of the data, so the saving is per process.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: tuple[float, ...],
                 std: tuple[float, ...]) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected uint8 images of shape (N, C, H, W), got {images.dtype} "
                             f"{tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()
        # Folded into one multiply-add: (x/255 - mean)/std = x * scale + shift.
        std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1) / std_t

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index].float() * self.scale + self.shift, self.labels[index]


def find_files(folder: Path, names: Sequence[str], hint: str,
               allow_gz: bool = False) -> dict[str, Path]:
    """Map each expected file name to its path in ``folder`` (or ``name.gz`` with ``allow_gz``).

    Raises FileNotFoundError naming the folder, every expected file and how to provide them:
    nothing is downloaded here, the files must already be on disk.
    """
    found: dict[str, Path] = {}
    for name in names:
        candidates = [folder / name] + ([folder / f"{name}.gz"] if allow_gz else [])
        existing = [path for path in candidates if path.is_file()]
        if existing:
            found[name] = existing[0]
    missing = [name for name in names if name not in found]
    if missing:
        suffix = " (each may also be gzipped, with a .gz suffix)" if allow_gz else ""
        raise FileNotFoundError(
            f"data files missing in folder '{folder}': {', '.join(missing)}. Expected files: "
            f"{', '.join(names)}{suffix}. {hint}")
    return found
