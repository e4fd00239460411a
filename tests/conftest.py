"""Fixtures shared by several test files, and the two workers of the quick loop and the whole suite."""

import os
from pathlib import Path

import pytest

import isolation
from datafiles import make_cifar, make_mnist, write_trace

QUICK_LOOP = "not slow"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The quick loop (``pytest -m "not slow"``) and the whole suite (``pytest`` with no
    selection) run on two worker processes (pytest-xdist, stealing work from each other) on a
    machine with two cores or more: the unit tests are in-process and single-threaded
    (`one_intra_op_thread`), so one process leaves a core idle. In the whole suite the worker
    gw0 also runs the launches of real processes in the background, and every worker reads
    their results (tests/launches.py). ``-n 0`` (or ``-p no:xdist``) runs either in
    one process; any other selection runs in one process as it is."""
    option = config.option
    whole_suite = not option.markexpr.strip() and not option.file_or_dir and not option.keyword
    if (getattr(option, "numprocesses", "no xdist") is None and "PYTEST_XDIST_WORKER" not in os.environ
            and (option.markexpr.strip() == QUICK_LOOP or whole_suite) and (os.cpu_count() or 1) >= 2
            and not option.usepdb and not option.collectonly):
        option.numprocesses = 2
        if option.dist == "no":
            option.dist = "worksteal"


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """A folder with tiny MNIST (20 training images) and CIFAR-10 files and a trace.csv."""
    root = tmp_path_factory.mktemp("data")
    make_mnist(root)
    make_cifar(root, rows=4)
    write_trace(root / "trace.csv")
    return root


@pytest.fixture(autouse=True)
def in_a_scratch_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a folder of its own: what a run writes to the working directory
    (Lightning's logs and checkpoints, the delay trace with ``logger=False``) lands there."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """One intra-op thread for every test: the models here are tiny, so a second thread only
    adds synchronisation, and on a busy machine its spinning workers stall each step many times
    over (a small GPT's step: 0.5 s with two threads on two busy cores, 0.03 s with one). The
    engine's own threads (learners, servers, thread ranks) are what runs in parallel.

    OMP_NUM_THREADS says so to Lightning too, whose launcher would otherwise set a process's
    count to its cores / processes in every in-process DDP-style run (and the processes the
    tests launch, which set one thread themselves, inherit it). A test that leaves another count
    behind fails (`leaves_nothing_behind`)."""
    import os

    import torch

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    isolation.THREADS["count"] = 1
    yield
    isolation.THREADS["count"] = None
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(autouse=True)
def leaves_nothing_behind():
    """Isolation fails loudly: a test that leaves a torch.distributed default group initialised,
    or engine threads (named ``stale-*``) still running, fails at its teardown, and the group is
    destroyed so that the tests after it run as usual (tests/isolation.py)."""
    yield
    problems = isolation.left_behind()
    if problems:
        pytest.fail("the test left state behind: " + "; ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def gloo_group_of_one():
    """A gloo default group of one process, for the module's tests (its all-reduce is the
    identity, so what goes round is checked exactly). No test leaves a group behind
    (`leaves_nothing_behind`), so none is set up when a module starts."""
    import socket

    import torch.distributed as dist

    assert not dist.is_initialized(), "a default group survived an earlier test's teardown"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    isolation.MODULE_GROUP["owned"] = True
    yield
    isolation.MODULE_GROUP["owned"] = False
    dist.destroy_process_group()


@pytest.fixture(params=["simulated", "stale"])
def engine(request, monkeypatch):
    """Each engine in turn, in this process (see tests/engines.py); the real one as P = 1."""
    from engines import one_process_environment

    one_process_environment(monkeypatch)
    return request.param


@pytest.fixture
def one_process(monkeypatch):
    """The environment of a one-process DDP-style run (the real engine with P = 1); the default
    group such a run leaves for the exit hook is destroyed afterwards."""
    import torch.distributed as dist
    from engines import one_process_environment

    one_process_environment(monkeypatch)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
