"""How a process ends after a fault, as Python finalizes (exit_runs.py: a fresh interpreter per
case); the pieces that need no process of their own are in tests/unit/test_fault_handling.py."""

import signal

import pytest

from exit_runs import TEARDOWNS


@pytest.fixture(scope="module")
def exiting(launched):
    return launched("exit_groups")


@pytest.fixture(scope="module")
def leaving(launched):
    return launched("gloo_exit")


def test_the_process_groups_are_destroyed_at_exit_only_if_no_teardown_failed(exiting):
    """A clean teardown after a failed one (a validate after a failed fit) must not have the
    broken groups destroyed at exit, by this project's hook or by Lightning's (registered for
    NCCL, unbounded: a NCCL destroy waits for an operation stuck on a dead peer)."""
    for name, teardowns in TEARDOWNS.items():
        status, stdout, stderr = exiting[name]
        assert status == 0, (name, stderr)
        assert stdout.split() == (["destroyed"] if all(teardowns) else []), name


@pytest.mark.parametrize("hook", [False, True], ids=["finalized", "exit-before-finalization"])
def test_a_failed_process_with_a_thread_in_a_gloo_receive_exits_with_status_1(leaving, hook):
    """A thread still blocked in a gloo receive when Python finalizes, whose peer then exits,
    aborts the process (SIGABRT) unless `exit_before_finalization` ends it first: status 1,
    the original error printed."""
    status, stderr = leaving[hook]
    assert "RuntimeError: optimizer step failed" in stderr
    if hook:
        assert status == 1 and "terminate called" not in stderr, stderr
    else:  # what the hook prevents, shown to happen
        assert status == -signal.SIGABRT, stderr
