"""Injected faults on real processes: each case is one launch of scripts/faults.py (two CPU
learners, K-async with K = 1, unless it says otherwise), with the fault injected once every
learner is training. The README's "Faults" section states the fault model these tests check:
every process gone within 10 s of the fault, a non-zero exit status, the cause named on every
rank, the counters balanced, the logs written so far complete, and, for a learner killed under
``on_learner_failure="continue"``, a run that finishes.
"""

import csv
import re
import signal
from pathlib import Path

import pytest
import torch

from processes import books_balance

DEADLINE_S = 10.0  # from the fault until every process of the run is gone


@pytest.fixture(scope="module")
def runs(launched):
    """``runs(case)``: the run of faults.py's ``case`` (fault_runs.launch), launched in the
    background from the start of the session (tests/integration/conftest.py)."""
    return lambda case: launched(f"faults/{case}")


def assert_ended_at_once(run, cause, ranks=(0, 1)):
    """Every process gone within DEADLINE_S of the fault, the launcher's exit status 1, ``fit``
    raising on every process (its exit status 1), ``cause`` named in how each of ``ranks`` ended."""
    assert run.fault is not None, run.tail()
    assert run.gone_after < DEADLINE_S, (run.gone_after, run.tail())
    assert run.status == 1, run.tail()
    assert "terminate called" not in run.output, run.tail()  # no process aborted at exit (SIGABRT)
    assert all(run.ends[rank]["raised"] for rank in (0, 1)), run.ends
    assert all(status in (1, None) for status in run.rank0["statuses"]), run.rank0  # None: exiting
    for rank in ranks:
        assert cause in run.exceptions[rank]["message"], (rank, run.exceptions, run.tail())
        assert re.search(rf"\[rank{rank}\]: \S+: .*{re.escape(cause)}", run.output), run.tail()  # printed


def assert_books_and_logs(run, trace_learners, unfinished_updates=0):
    """The counters balance, and the files written so far parse: wallclock.csv has a row per
    update (but the last ``unfinished_updates``), delays.csv the delays of ``trace_learners``."""
    stats = run.rank0["stats"]
    assert books_balance(stats) and stats["gradients_pending"] == 0, stats
    with (run.logs() / "wallclock.csv").open() as f:
        rows = list(csv.DictReader(f))
    updates = stats["updates"] - unfinished_updates
    assert [int(float(r["update"])) for r in rows] == list(range(1, updates + 1))
    assert Path(stats["trace_path"]) == run.logs() / "delays.csv"
    with (run.logs() / "delays.csv").open() as f:
        trace = list(csv.DictReader(f))
    assert {int(r["learner"]) for r in trace} == set(trace_learners)
    assert all(float(r["delay_s"]) >= 0 for r in trace)
    assert not list(run.logs().glob(".*.tmp"))  # atomic writes left no partial file behind


# ---------------------------------------------------------------- exceptions


# The optimizer's step, and an LR scheduler stepped per update, raising on the server thread
@pytest.mark.parametrize("case, cause", [
    ("optimizer", "the parameter server failed: RuntimeError: optimizer step failed"),
    ("scheduler", "the parameter server failed: RuntimeError: scheduler failed"),
])
def test_an_exception_on_the_server_thread_ends_every_process(runs, case, cause):
    run = runs(case)
    assert_ended_at_once(run, cause)
    assert run.exceptions[0]["type"] == run.exceptions[1]["type"] == "ServerFailed"
    # the update that raised is counted (its gradients were taken) but has no wall-clock row
    assert_books_and_logs(run, trace_learners={0}, unfinished_updates=1)


@pytest.mark.parametrize("case, failed, error", [
    ("training_step", 1, "ValueError: boom"),  # a learner's step, on a child process
    ("callback", 0, "KeyError: 'callback failed'"),  # a callback, on the server's process
])
def test_an_exception_on_a_learner_ends_every_process_naming_it(runs, case, failed, error):
    run = runs(case)
    assert_ended_at_once(run, f"learner {failed} failed: {error}", ranks=[1 - failed])
    assert run.exceptions[1 - failed]["type"] == "ServerFailed"
    assert error.split(": ", 1)[1] in run.exceptions[failed]["message"]  # its own exception
    assert_books_and_logs(run, trace_learners={0})


@pytest.mark.parametrize("case, failed, cause", [
    # collective: a learner's exception while the other may wait in the update's all-reduce
    # (faults.py's "optimizer_collective", an exception in a learner's own optimizer step, takes
    # the same way out: left out of the suite for time)
    ("training_step_collective", 1, "learner 1 failed: ValueError: boom"),
    ("training_step_collective_local", 1, "learner 1 failed: ValueError: boom"),
    # sharded: a shard owner's optimizer step raises on its thread (rank 0's); every process
    # exits with status 1, none by SIGABRT (threads blocked in a gloo receive at exit)
    ("optimizer_sharded", None, "the shard server on rank 0 failed: RuntimeError: optimizer step failed"),
])
def test_an_exception_on_a_scaled_path_ends_every_process_naming_it(runs, case, failed, cause):
    run = runs(case)
    assert run.rank0["stats"]["server_path"] == next(path for path in ("collective", "sharded") if path in case)
    others = [rank for rank in (0, 1) if rank != failed]
    assert_ended_at_once(run, cause, ranks=others)
    assert all(run.exceptions[rank]["type"] == "ServerFailed" for rank in others)
    if failed is not None:
        assert cause.split(": ", 1)[1].split(": ", 1)[1] in run.exceptions[failed]["message"]
    assert_books_and_logs(run, trace_learners={0})
    # OnExceptionCheckpoint wrote rank 0's parameters, the version its books name
    checkpoint = run.rank0["checkpoint"]
    assert checkpoint["matches_server"] and 0 < checkpoint["server"]["updates"] <= run.rank0["stats"]["updates"]


# ---------------------------------------------------------------- signals


# SIGTERM to either process; the launcher's is the pre-emption resumed below. SIGINT takes the
# same path from the trap on (tests/unit/test_fault_handling.py traps both); faults.py can send
# it too ("sigint_launcher", "sigint_child"), left out of the suite for time.
@pytest.mark.parametrize("case, rank", [("sigterm_launcher", 0), ("sigterm_child", 1)])
def test_a_signal_to_any_process_stops_every_learner_through_the_shutdown_protocol(runs, case, rank):
    run = runs(case)
    assert_ended_at_once(run, f"{run.fault['what']} on rank {rank}: training stopped before its end")
    assert run.exceptions[0]["type"] == run.exceptions[1]["type"] == "RunInterrupted"
    assert_books_and_logs(run, trace_learners={0, 1})  # every learner said goodbye, with its delays
    # OnExceptionCheckpoint ran on rank 0 with the server's latest parameters and books
    checkpoint = run.rank0["checkpoint"]
    assert checkpoint["matches_server"] and checkpoint["server"]["updates"] == run.rank0["stats"]["updates"]


@pytest.mark.parametrize("case", ["resume"])  # from the checkpoint of "sigterm_launcher"
def test_a_preempted_run_resumes_from_its_exception_checkpoint(runs, case):
    first = runs("sigterm_launcher")
    saved = torch.load(first.out / "on_exception.ckpt", weights_only=False)["stale_server"]["updates"]
    assert 15 <= saved < 60
    run = runs(case)
    assert run.status == 0 and run.ends == {0: {"raised": None}, 1: {"raised": None}}, run.tail()
    assert run.rank0["updates"] == list(range(saved + 1, 61))  # the update count goes on
    assert run.rank0["stats"]["updates"] == 60 and books_balance(run.rank0["stats"])


# ---------------------------------------------------------------- the server's process


@pytest.mark.parametrize("case", ["sigkill_server"])
def test_a_killed_server_ends_every_learner(runs, case):
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == -signal.SIGKILL and run.ends == {1: {"raised": "ServerFailed"}}
    assert run.exceptions[1]["type"] == "ServerFailed"
    assert "learner 1: the connection to the server (rank 0) broke" in run.exceptions[1]["message"]


@pytest.mark.parametrize("case", ["sigkill_child_sharded"])
def test_a_killed_shard_owner_ends_the_run(runs, case):
    """Rank 1's process (a learner and the owner of half the parameters) SIGKILLed."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == 1 and run.ends == {0: {"raised": "ServerFailed"}}, run.tail()
    assert "learner 1 died" in run.exceptions[0]["message"]
    assert run.rank0["stats"]["server_path"] == "sharded"
    assert_books_and_logs(run, trace_learners={0})
    assert "the shard owners' state was lost with the failure" in run.output  # the checkpoint says so


@pytest.mark.parametrize("case", ["stuck_server_child_killed"])
def test_a_death_ends_rank_0_even_where_its_server_thread_is_stuck(runs, case):
    """Rank 0's server thread blocked in a step (on a GPU: behind a payload that never comes),
    then rank 1 SIGKILLed: the endpoint saw the connection break, rank 0's watchdog ends the
    process naming the death, without waiting for the server loop or the server's silence."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == 1, run.tail()
    assert re.search(r"lightning_stale: ending this process \(.*\): learner 1 died", run.output), run.tail()


@pytest.mark.parametrize("case", ["sigkill_child_collective"])
def test_a_killed_learner_on_the_collective_path_ends_the_run_with_its_death_named(runs, case):
    """Rank 1 SIGKILLed while the learners reduce their gradients during backward: the survivor
    leaves without balancing the overlapped rounds with the dead (a collective that would fail
    and put its own error in place of the death)."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == 1 and run.ends == {0: {"raised": "ServerFailed"}}, run.tail()
    assert "learner 1 died" in run.exceptions[0]["message"], run.tail()
    assert run.rank0["stats"]["server_path"] == "collective" and run.rank0["overlapped"] > 0, run.tail()
    assert_books_and_logs(run, trace_learners={0})


@pytest.mark.parametrize("case", ["sigkill_child_lanes"])
def test_a_killed_learner_sharing_memory_with_the_server_ends_the_run(runs, case):
    """Rank 1 SIGKILLed on the central path while its pushes and answers cross in shared memory:
    the server learns of the death from the broken gloo connection, as without lanes."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == 1 and run.ends == {0: {"raised": "ServerFailed"}}, run.tail()
    assert "learner 1 died" in run.exceptions[0]["message"]
    stats = run.rank0["stats"]
    assert stats["server_path"] == "central" and stats["shared_memory_learners"] == [1]
    assert_books_and_logs(run, trace_learners={0})


@pytest.mark.parametrize("case", ["sigkill_child_channels"])
def test_a_killed_learner_with_payloads_on_channels_ends_the_run(runs, case):
    """Rank 1 SIGKILLed on the central path while its pushes and answers travel on the groups of
    their directions (``payload_channels=True``): its broken connections end the run."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.status == 1 and run.ends == {0: {"raised": "ServerFailed"}}, run.tail()
    assert "learner 1 died" in run.exceptions[0]["message"]
    stats = run.rank0["stats"]
    assert stats["server_path"] == "central" and stats["payload_channels"] == "gloo"
    assert stats["shared_memory_learners"] == [] and stats["payloads_on_channels"] > 0
    assert_books_and_logs(run, trace_learners={0})


@pytest.mark.parametrize("case", ["sigstop_server"])
def test_a_frozen_server_is_taken_for_dead_by_its_learners(runs, case):
    """Rank 0 stopped with SIGSTOP: its learner hears no heartbeat for server_timeout = 3 s."""
    run = runs(case)
    assert run.fault is not None and run.gone_after < DEADLINE_S, run.tail()
    assert run.gone_after > 2.0, run.tail()  # it heard from the server until the freeze
    assert "learner 1: no message from the server for 3 s" in run.exceptions[1]["message"], run.tail()
    assert run.frozen_status == {1: 1}, run.tail()  # rank 1 exited with status 1


# ---------------------------------------------------------------- on_learner_failure="continue"


@pytest.mark.parametrize("case", ["continue_k_async", "continue_k_batch_sync", "continue_k_async_lanes",
                                  "continue_killed_at_epoch_end"])
def test_with_continue_a_killed_learner_is_dropped_and_the_run_finishes(runs, case):
    """Three learners, K = 2, rank 2 SIGKILLed mid-run under Lightning's own launcher (its
    payloads in shared memory for the lanes' case; frozen mid-epoch and killed only once the
    others have ended the epoch, a death the server notices after the epoch's end, in the last
    case)."""
    run = runs(case)
    assert run.status == 0, run.tail()
    lanes = [1, 2] if case.endswith("_lanes") else []  # the small model's payloads fit a frame
    assert run.rank0["stats"]["shared_memory_learners"] == lanes
    # ranks 1 and 2: the launcher's watch saw rank 2 die, and let the run go on
    assert run.rank0["statuses"][0] in (0, None) and run.rank0["statuses"][1] == -signal.SIGKILL
    assert run.ends == {0: {"raised": None}, 1: {"raised": None}}
    stats = run.rank0["stats"]
    assert stats["updates"] == 60 and stats["dead_learners"] == [2] and books_balance(stats)
    # after the first epoch (and its validation), before most of the run
    assert run.rank0["epoch_at_death"] >= 1 and run.rank0["updates_at_death"] <= 45
    assert "learner 2 died" in run.output and "training goes on without it" in run.output
    # validation ran at the first epoch's end, and is skipped once the process group lost a member
    # every push decided before the stop counts toward an epoch (3 learners x 8 batches), the
    # dropped ones too (K-batch-sync drops those that crossed an update on the wire)
    decided = stats["gradients_received"] - stats["gradients_in_flight_at_stop"]
    assert "val/acc" in run.rank0["metrics"] and stats["epochs"] == decided // 24
    assert "a learner died; validation is skipped for the rest of this fit" in run.output
    # the learners left said goodbye; the dead one's delays are lost with it
    assert_books_and_logs(run, trace_learners={0, 1})


@pytest.mark.parametrize("case", ["continue_frozen_at_epoch_end"])
def test_with_continue_a_learner_frozen_at_an_epochs_end_fails_the_run_after_the_timeout(runs, case):
    """Rank 2 SIGSTOPped mid-epoch for good: neither dead nor at the epoch's end, it holds up the
    roll call, which ends the run after the strategy's timeout (4 s here) instead of waiting."""
    run = runs(case)
    assert run.status == 1 and "terminate called" not in run.output, run.tail()
    assert 4.0 < run.gone_after < 4.0 + DEADLINE_S, (run.gone_after, run.tail())
    assert run.ends == {0: {"raised": run.ends[0]["raised"]}, 1: {"raised": run.ends[1]["raised"]}}
    assert run.ends[0]["raised"] and run.ends[1]["raised"], run.ends
    for rank in (0, 1):  # its own timeout, or the server's abort naming the learner's
        assert "no answer from the server to the roll call at the end of epoch" in run.exceptions[rank]["message"]
    assert run.rank0["stats"]["dead_learners"] == [] and books_balance(run.rank0["stats"])
