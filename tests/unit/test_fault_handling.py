"""The pieces of fault handling that need no second process: the signal trap, the watchdog, and
the files a failed run leaves behind (written atomically). The faults themselves, on real
processes, are in tests/integration/test_faults.py."""

import os
import signal
import threading
from types import SimpleNamespace

import pytest
from pytorch_lightning.trainer.states import TrainerFn

from lightning_stale.delays import Trace, TraceRecorder
from lightning_stale.engine.records import UpdateRecord
from lightning_stale.strategies.callbacks import WallClockLogger
from lightning_stale.strategies.faults import SignalTrap, Watchdog


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_trap_records_a_signal_instead_of_acting_on_it_and_restores_the_handlers(signum):
    before = signal.getsignal(signum)
    trap = SignalTrap(rank=3)
    trap.install()
    try:
        os.kill(os.getpid(), signum)  # handled on this (the main) thread before the next line
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not change the reason
        assert trap.reason == f"{signal.Signals(signum).name} on rank 3"
    finally:
        trap.restore()
    assert signal.getsignal(signum) is before


class Exited(Exception):
    pass


def test_the_watchdog_reports_a_signal_without_blocking_and_ends_a_stuck_process(monkeypatch):
    """A report that never returns (a frozen server) must not keep the watchdog from ending a
    process whose training thread does not stop within the grace period."""
    exits, reported, release = [], threading.Event(), threading.Event()

    def report(reason):
        reported.set()
        release.wait()  # blocked, like a send to a frozen server

    def record_exit(reason, why):
        exits.append((reason, why))
        watchdog.stop()

    monkeypatch.setattr(Watchdog, "_exit", staticmethod(record_exit))
    trap = SignalTrap(rank=1)
    trap.reason = "SIGTERM on rank 1"
    watchdog = Watchdog(trap, report, failure=lambda: trap.reason, acknowledged=lambda: False, grace=0.3)
    watchdog.start()
    try:
        assert reported.wait(5.0)
        watchdog.join(5.0)
        assert exits == [("SIGTERM on rank 1", "the training thread cannot stop (blocked in a collective or a step)")]
    finally:
        release.set()


def test_the_watchdog_keeps_a_failure_after_the_strategy_has_let_go_of_it(monkeypatch):
    """At teardown the strategy forgets its learner, and with it the failure; the watchdog still
    ends a process whose teardown or exit waits for good (on a GPU a dead peer's NCCL operation)."""
    exits, answers = [], iter(["learner 1 died"])

    def record_exit(reason, why):
        exits.append((reason, why))
        watchdog.stop()

    monkeypatch.setattr(Watchdog, "_exit", staticmethod(record_exit))
    watchdog = Watchdog(SignalTrap(rank=0), report=lambda reason: None, failure=lambda: next(answers, None),
                        acknowledged=lambda: True, exit_grace=0.3)
    watchdog.start()
    watchdog.join(5.0)
    assert exits == [("learner 1 died", "still running after the failure was raised")]


def test_the_watchdog_leaves_a_process_alone_while_all_is_well(monkeypatch):
    exits = []
    monkeypatch.setattr(Watchdog, "_exit", staticmethod(lambda *args: exits.append(args)))
    checked = threading.Event()

    def failure():
        checked.set()
        return None

    watchdog = Watchdog(SignalTrap(rank=0), report=lambda reason: None, failure=failure,
                        acknowledged=lambda: False, grace=0.0)
    watchdog.start()
    assert checked.wait(5.0)
    watchdog.stop()
    watchdog.join(5.0)
    assert exits == []


def test_a_trace_is_replaced_atomically(tmp_path):
    path = tmp_path / "delays.csv"
    path.write_text("learner,index,delay_s\n9,0,1.0\n")  # an older trace
    recorder = TraceRecorder()
    recorder.record(0, 0.25)
    recorder.record(1, 0.5)
    assert recorder.write(path) == path
    assert [Trace(path=path).sample(learner) for learner in (0, 1)] == [0.25, 0.5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delays.csv"]  # no partial file left


def test_a_failed_fit_still_writes_its_wall_clock_log(tmp_path):
    """On an exception the rows so far are written, the server's updates drained first."""
    pending = [UpdateRecord(update=u, clock=0.1 * u, samples=8 * u, loss=1.0, staleness_mean=0.0,
                            staleness_max=0, num_gradients=1, k=1, learners=(0,)) for u in (1, 2, 3)]
    engine = SimpleNamespace(virtual_clock=False, pop_update_records=lambda: [pending.pop(0) for _ in list(pending)])
    logger = SimpleNamespace(log_dir=str(tmp_path), save_dir=str(tmp_path), log_metrics=lambda *a, **k: None)
    trainer = SimpleNamespace(strategy=engine, is_global_zero=True, loggers=[logger], sanity_checking=False,
                              state=SimpleNamespace(fn=TrainerFn.FITTING), global_step=0, world_size=2)
    wall = WallClockLogger()
    wall.on_train_start(trainer, None)
    wall.on_exception(trainer, None, ValueError("boom"))
    lines = (tmp_path / "wallclock.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["update", "1", "2", "3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wallclock.csv"]


def test_a_fit_failing_before_training_writes_no_wall_clock_log(tmp_path):
    logger = SimpleNamespace(log_dir=str(tmp_path), save_dir=str(tmp_path))
    trainer = SimpleNamespace(strategy=None, is_global_zero=True, loggers=[logger],
                              state=SimpleNamespace(fn=TrainerFn.FITTING))
    wall = WallClockLogger()
    wall.rows = [{"update": 1}]  # from an earlier fit
    wall._train_start = 0.0
    wall.setup(trainer, None, "fit")
    wall.on_exception(trainer, None, ValueError("in configure_optimizers"))
    assert list(tmp_path.iterdir()) == []
