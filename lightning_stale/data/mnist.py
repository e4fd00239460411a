"""MNIST read from a local folder in torchvision's layout; the IDX files are parsed here."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from lightning_stale.data.base import LocalImageDataModule, find_files

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# IDX element type codes (third byte of the magic number), from the format's description at
# http://yann.lecun.com/exdb/mnist/ ; MNIST itself only uses 0x08 (unsigned byte).
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic ``00 00 <type> <ndim>``, then ``ndim``
    big-endian int32 sizes, then the elements in row-major order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[raw[2]]
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(f"{path}: header promises {expected} bytes of data for shape {shape}, "
                         f"file holds {len(raw) - offset}")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape)


class MNISTDataModule(LocalImageDataModule):
    """MNIST from ``<data_dir>/MNIST/raw/`` (torchvision's layout), nothing downloaded.

    Expects the four IDX files of ``MNIST_FILES`` there, plain or gzipped (``name.gz``); they are
    checked at construction so a wrong ``data_dir`` fails before any process is launched.
    Images are scaled to [0, 1] and standardised with MNIST's mean 0.1307 and std 0.3081 (the
    constants of the PyTorch MNIST example); ``input_shape`` is ``(1, 28, 28)``. Train and val are
    a seeded split of the 60,000 training images (``val_fraction``); test is the 10,000-image
    t10k set (also used for val when
    ``val_fraction=0``). Images stay uint8 in memory and are normalised per sample when fetched.
    """

    mean = (0.1307,)
    std = (0.3081,)

    def __init__(self, data_dir: str | Path = "data", batch_size: int = 64,
                 val_fraction: float = 0.1, num_workers: int = 0, seed: int = 0,
                 drop_last: bool = True) -> None:
        super().__init__(data_dir, batch_size, val_fraction, num_workers, seed, drop_last)
        self.input_shape = (1, 28, 28)
        self.num_classes = 10
        self.files = find_files(
            self.data_dir / "MNIST" / "raw", MNIST_FILES, allow_gz=True,
            hint="Copy them there (torchvision.datasets.MNIST(root, download=True) on a machine "
                 "with network access writes exactly this layout under root) and pass "
                 "data_dir=root.")

    def _images_and_labels(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        images = read_idx(self.files[f"{prefix}-images-idx3-ubyte"])
        labels = read_idx(self.files[f"{prefix}-labels-idx1-ubyte"])
        if images.ndim != 3 or images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise ValueError(f"unexpected MNIST {prefix} shapes: images {images.shape}, "
                             f"labels {labels.shape}")
        # np.frombuffer arrays are read-only; copy before handing them to torch.
        return (torch.from_numpy(images.copy()).unsqueeze(1),
                torch.from_numpy(labels.astype(np.int64)))

    def _read(self):
        return (*self._images_and_labels("train"), *self._images_and_labels("t10k"))
