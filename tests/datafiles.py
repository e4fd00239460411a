"""Tiny MNIST and CIFAR-10 files in torchvision's on-disk formats, a tiny delay trace and a race
contestant's folder, for tests that need local data (nothing is downloaded)."""

from __future__ import annotations

import csv
import gzip
import pickle
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> None:
    """IDX as described at yann.lecun.com/exdb/mnist: magic 0x0000080N (ubyte, N dims)."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def make_mnist(root: Path, num_train: int = 20, num_test: int = 8, gz: bool = False) -> dict:
    rng = np.random.default_rng(1)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(num_train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(num_test, dtype=np.uint8) * 3) % 10,
    }
    for name, array in arrays.items():
        write_idx(raw / name, array, gz=gz)
    return arrays


def make_cifar(root: Path, rows: int = 4) -> dict:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(2)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, rows)]}
        (folder / name).write_bytes(pickle.dumps(batch))
        batches[name] = batch
    return batches


def write_trace(path: Path, learners: int = 4) -> None:
    """A `Trace` file: three delays of 10 ms per learner."""
    rows = ["learner,index,delay_s"]
    rows += [f"{learner},{index},0.01" for learner in range(learners) for index in range(3)]
    path.write_text("\n".join(rows) + "\n")


def fake_contestant(run_dir: Path, overrides: list[str], losses, seconds_per_update: float,
                    staleness: float = 0.0, staleness_max: int = 1, k: int = 2) -> Path:
    """A race contestant's folder as train() leaves it: .hydra/config.yaml and wallclock.csv,
    one row per update of ``losses``, ``seconds_per_update`` apart."""
    from omegaconf import OmegaConf

    from lightning_stale.config import compose_config
    from lightning_stale.strategies.callbacks import METRIC_NAMES

    cfg = compose_config("train", ["race=none", *overrides])
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    logs = run_dir / "csv" / "version_0"
    logs.mkdir(parents=True)
    with open(logs / "wallclock.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(METRIC_NAMES))
        writer.writeheader()
        for j, loss in enumerate(losses):
            writer.writerow(dict(zip(METRIC_NAMES, (j + 1, (j + 1) * seconds_per_update, 0.0,
                                                    32 * (j + 1), loss, staleness, staleness_max, k))))
    return run_dir
