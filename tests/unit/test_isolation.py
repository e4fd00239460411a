"""The teardown check every test goes through (tests/isolation.py): what it catches, and that
it cleans up so that the next test starts clean."""

import socket
import threading

import torch
import torch.distributed as dist

import isolation


def test_a_leaked_default_group_is_reported_and_destroyed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    assert isolation.left_behind(grace_s=0.0) == ["a torch.distributed default group is still initialised"]
    assert not dist.is_initialized() and isolation.left_behind(grace_s=0.0) == []


def test_another_intra_op_thread_count_is_reported_and_set_back():
    assert isolation.THREADS["count"] == torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert isolation.left_behind(grace_s=0.0) == ["the intra-op thread count is 2, not the session's 1"]
    assert torch.get_num_threads() == 1 and isolation.left_behind(grace_s=0.0) == []


def test_a_running_engine_thread_is_reported_once_and_one_that_ends_in_time_is_not():
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True, name="stale-server")
    quick = threading.Thread(target=release.wait, args=(0.01,), daemon=True, name="stale-learner-recv-1")
    other = threading.Thread(target=release.wait, daemon=True, name="not-ours")
    for t in (stuck, quick, other):
        t.start()
    try:
        assert isolation.left_behind(grace_s=1.0) == ["engine threads still running: ['stale-server']"]
        assert isolation.left_behind(grace_s=0.0) == []  # reported in the test that leaked it
    finally:
        release.set()
        for t in (stuck, quick, other):
            t.join()
        isolation.REPORTED_THREADS.discard(stuck)
