"""Launches of real processes, run in the background from the start of the session.

One process of the session runs them all (the only one, or xdist's worker ``gw0`` when the suite
runs on several workers) and writes each result into a shared folder, where every worker reads
the ones its tests take (`Launches`, `LaunchResults`). A launch is mostly one process importing
Lightning at a time, and it also waits: for its processes to start, for a timeout it tests, for a
peer; it uses about three quarters of a core on average. So the launches run one at a time while
every test process computes unit tests, and each test process that starts waiting for a result
frees its core for more: three at a time in one process, one more per waiting worker with xdist.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

# A launch, given its folder and ``result`` (to wait for a launch it starts from).
Job = Callable[[Path, Callable[[str], Any]], Any]

LAUNCHER_PID = "launcher.pid"  # in the results folder: the process that runs the launches
POLL_S = 0.2


def _result_file(folder: Path, name: str) -> Path:
    return folder / (name.replace("/", "-") + ".pickle")


def _waiting_flag(folder: Path, worker: str) -> Path:
    return folder / f"waiting-{worker}"


class Launches:
    """Runs ``jobs`` (name: (folder, job)) in the order given, one at a time until test processes
    wait for results: then ``per_waiting_worker`` more for each. Every result (or exception) is
    also written to ``results`` for the other workers."""

    def __init__(self, jobs: dict[str, tuple[Path, Job]], results: Path, per_waiting_worker: int = 2,
                 controller: int | None = None):
        self._jobs, self._results, self._per_waiting = jobs, results, per_waiting_worker
        self._controller = controller  # xdist's controller, this worker's parent: gone, start nothing more
        self._futures: dict[str, Future] = {name: Future() for name in jobs}
        self._slots = threading.Semaphore(1)
        self._waiting: set[str] = set()
        self._waiting_lock = threading.Lock()
        self._stopping = threading.Event()
        self._running: list[threading.Thread] = []
        results.mkdir(parents=True, exist_ok=True)
        (results / LAUNCHER_PID).write_text(str(os.getpid()))
        self._dispatcher = threading.Thread(target=self._dispatch, name="launch-dispatcher", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="launch-watcher", daemon=True)
        self._dispatcher.start()
        self._watcher.start()

    def result(self, name: str) -> Any:
        """The launch's result (or its exception), waiting for it."""
        self.worker_waits(os.environ.get("PYTEST_XDIST_WORKER", "main"))
        return self._futures[name].result()

    @property
    def stopping(self) -> bool:
        """Whether no launch starts any more."""
        return self._stopping.is_set()

    def worker_waits(self, worker: str) -> None:
        """``worker`` waits for results from now on: its core is free for more launches."""
        with self._waiting_lock:
            if worker in self._waiting:
                return
            self._waiting.add(worker)
        self._slots.release(self._per_waiting)

    def stop(self, finish: bool) -> None:
        """``finish``: run every launch to its end (other workers may still wait for them), at
        full speed; else start nothing more and wait for the launches under way (each has its
        own timeout)."""
        if finish:
            self._slots.release(len(self._jobs))
            self._dispatcher.join()
        self._stopping.set()
        self._slots.release()  # (wakes the dispatcher if it waits for a slot)
        self._dispatcher.join()
        for thread in self._running:
            thread.join()
        self._watcher.join()
        for future in self._futures.values():
            future.cancel()  # (what never started)

    def _watch(self) -> None:
        """Counts the other workers that wait (each leaves a flag in the results folder), and
        stops the launches if the controller is gone (killed, interrupted): no test waits then."""
        while not self._stopping.wait(POLL_S):
            for flag in self._results.glob("waiting-*"):
                self.worker_waits(flag.name.removeprefix("waiting-"))
            if self._controller is not None and os.getppid() != self._controller:
                self._stopping.set()
                self._slots.release()  # (wakes the dispatcher if it waits for a slot)

    def _dispatch(self) -> None:
        for name, (folder, job) in self._jobs.items():
            self._slots.acquire()
            if self._stopping.is_set():
                return
            thread = threading.Thread(target=self._run, args=(name, folder, job), name=f"launch-{name}",
                                      daemon=True)
            self._running.append(thread)
            thread.start()

    def _run(self, name: str, folder: Path, job: Job) -> None:
        future = self._futures[name]
        future.set_running_or_notify_cancel()
        try:
            future.set_result(job(folder, self._futures_result))
        except BaseException as error:  # (an assertion on the launch's exit status, a timeout...)
            future.set_exception(error)
        finally:
            publish(self._results, name, future)
            self._slots.release()

    def _futures_result(self, name: str) -> Any:
        return self._futures[name].result()


def publish(results: Path, name: str, future: Future) -> None:
    """Writes the finished ``future``'s result, or its exception, for the other workers; what
    cannot be pickled is written as an error naming it."""
    error = future.exception()
    outcome = ("error", error) if error is not None else ("ok", future.result())
    try:
        data = pickle.dumps(outcome)
    except Exception as failure:  # noqa: BLE001 (any pickling failure)
        data = pickle.dumps(("error", RuntimeError(f"launch {name}: its {outcome[0]} {outcome[1]!r} cannot be "
                                                   f"handed to another test process: {failure!r}")))
    partial = results / f".{name.replace('/', '-')}.tmp"
    partial.write_bytes(data)
    os.replace(partial, _result_file(results, name))


class LaunchResults:
    """A worker's view of the launches another process runs (`Launches`): ``result(name)``
    waits for the result file, and fails if the launching process ends before writing it, or
    has not written it after ``timeout_s`` (far more than any launch's own timeout)."""

    def __init__(self, results: Path, worker: str, start_timeout_s: float = 300.0, timeout_s: float = 1800.0):
        self._results, self._worker = results, worker
        self._start_timeout_s, self._timeout_s = start_timeout_s, timeout_s
        self._cache: dict[str, tuple[str, Any]] = {}

    def result(self, name: str) -> Any:
        if name not in self._cache:
            _waiting_flag(self._results, self._worker).touch()
            self._cache[name] = self._wait_for(name)
        kind, value = self._cache[name]
        if kind == "error":
            raise value
        return value

    def _wait_for(self, name: str) -> tuple[str, Any]:
        path, started = _result_file(self._results, name), time.monotonic()
        while not path.exists():
            pid_file = self._results / LAUNCHER_PID
            if pid_file.exists():
                if not _alive(int(pid_file.read_text())):
                    if path.exists():  # (written just before it ended)
                        break
                    raise RuntimeError(f"the test process running the launches ended before launch {name} did")
            elif time.monotonic() - started > self._start_timeout_s:
                raise RuntimeError(f"no test process started the launches within {self._start_timeout_s:.0f} s "
                                   f"(waiting for launch {name})")
            if time.monotonic() - started > self._timeout_s:
                raise RuntimeError(f"launch {name} has no result after {self._timeout_s:.0f} s")
            time.sleep(POLL_S)
        return pickle.loads(path.read_bytes())


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by xdist, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"
