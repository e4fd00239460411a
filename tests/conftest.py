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


@pytest.fixture(params=["simulated", "stale"])
def engine(request, monkeypatch):
    """Each engine in turn, in this process (see tests/engines.py); the real one as P = 1."""
    from engines import one_process_environment

    one_process_environment(monkeypatch)
    return request.param


@pytest.fixture
def one_process(monkeypatch):
    """The environment of a one-process DDP-style run (the real engine with P = 1)."""
    from engines import one_process_environment

    one_process_environment(monkeypatch)
