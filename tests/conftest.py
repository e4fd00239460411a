"""Fixtures shared by several test files."""

from pathlib import Path

import pytest

from datafiles import make_cifar, make_mnist, write_trace


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A folder with tiny MNIST (20 training images) and CIFAR-10 files and a trace.csv."""
    root = tmp_path_factory.mktemp("data")
    make_mnist(root)
    make_cifar(root, rows=4)
    write_trace(root / "trace.csv")
    return root
