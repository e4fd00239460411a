"""The background launches' hand-over between test processes (tests/launches.py), with jobs
that start no process: what the launching process runs reaches a reader as it was, errors
included, and a reader never waits for a launcher that is gone."""

import os
import subprocess
import sys
import threading
import time

import pytest

from launches import LAUNCHER_PID, LaunchResults, Launches


def job(value, started=None, gate=None):
    def run(folder, result):
        if started is not None:
            started.append(value)
        if gate is not None:
            assert gate.wait(30)
        if isinstance(value, Exception):
            raise value
        return value
    return run


def until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.01)


def test_a_reader_gets_each_result_and_error_as_the_launcher_does(tmp_path):
    results = tmp_path / "results"
    launches = Launches({"a": (tmp_path, job({"x": [1, 2]})), "faults/b": (tmp_path, job(ValueError("b failed"))),
                         "c": (tmp_path, job(threading.Lock()))}, results, per_waiting_worker=1)
    reader = LaunchResults(results, "gw1")
    try:
        assert reader.result("a") == launches.result("a") == {"x": [1, 2]}
        for source in (reader, launches):
            with pytest.raises(ValueError, match="b failed"):
                source.result("faults/b")
        with pytest.raises(RuntimeError, match="launch c: its ok <unlocked _thread.lock.*cannot be handed"):
            reader.result("c")  # (a lock does not pickle: the reader is told, not left waiting)
    finally:
        launches.stop(finish=True)


def test_one_launch_at_a_time_until_a_worker_waits_then_one_more_per_waiting_worker(tmp_path):
    results, started, gate = tmp_path / "results", [], threading.Event()
    launches = Launches({name: (tmp_path, job(name, started, gate)) for name in "abcdef"}, results,
                        per_waiting_worker=1)
    try:
        until(lambda: started == ["a"])
        time.sleep(0.5)
        assert started == ["a"]  # one at a time while every test process computes
        reader = threading.Thread(target=LaunchResults(results, "gw1").result, args=("a",), daemon=True)
        reader.start()  # gw1 waits (its flag in the results folder): two at a time
        until(lambda: started == ["a", "b"])
        launches.worker_waits("gw0")  # and gw0: three
        until(lambda: started == ["a", "b", "c"])
        launches.worker_waits("gw1")  # (counted once)
        time.sleep(0.5)
        assert started == ["a", "b", "c"]
    finally:
        gate.set()
        launches.stop(finish=True)
    reader.join(5)
    assert started == list("abcdef")  # finishing runs everything, for the workers still waiting


def test_stopping_without_finishing_starts_nothing_more(tmp_path):
    started, gate = [], threading.Event()
    launches = Launches({name: (tmp_path, job(name, started, gate)) for name in "abc"}, tmp_path / "r")
    until(lambda: started == ["a"])
    threading.Timer(0.3, gate.set).start()
    launches.stop(finish=False)
    assert started == ["a"]


def test_a_reader_fails_when_the_launching_process_is_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LAUNCHER_PID).write_text(gone.stdout.strip())
    with pytest.raises(RuntimeError, match="the test process running the launches ended before launch x did"):
        LaunchResults(tmp_path, "gw1").result("x")


def test_a_reader_fails_when_no_process_starts_the_launches(tmp_path):
    with pytest.raises(RuntimeError, match="no test process started the launches within 0 s"):
        LaunchResults(tmp_path, "gw1", start_timeout_s=0.3).result("x")


def test_a_reader_fails_when_a_running_launcher_never_writes_the_result(tmp_path):
    (tmp_path / LAUNCHER_PID).write_text(str(os.getpid()))
    with pytest.raises(RuntimeError, match="launch x has no result after 0 s"):
        LaunchResults(tmp_path, "gw1", timeout_s=0.3).result("x")


def test_the_launching_worker_starts_nothing_more_once_its_controller_is_gone(tmp_path):
    started, gate = [], threading.Event()
    launches = Launches({name: (tmp_path, job(name, started, gate)) for name in "abc"}, tmp_path / "r",
                        controller=os.getppid() + 1)  # (a parent this process does not have)
    until(lambda: started == ["a"])
    until(lambda: launches.stopping)  # (the watcher looks every 0.2 s)
    launches.worker_waits("gw1")  # (slots for the others: none starts, the controller is gone)
    gate.set()
    launches.stop(finish=True)
    assert started == ["a"]
