"""Launches of real processes, run in the background from the start of the session: one at a
time while the unit tests run in the foreground (a launch is mostly one process importing
Lightning at a time, so it takes the core the unit tests leave), three at a time once a test
waits for a result (`Launches.result`): a launch also waits, for its processes to start, for a
timeout it tests, for a peer, and uses about three quarters of a core on average, so two leave
much of two cores idle."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

# A launch, given its folder and ``result`` (to wait for a launch it starts from).
Job = Callable[[Path, Callable[[str], Any]], Any]


class Launches:
    """Runs ``jobs`` (name: (folder, job)) in the order given, ``slots`` at a time."""

    def __init__(self, jobs: dict[str, tuple[Path, Job]]):
        self._jobs = jobs
        self._futures: dict[str, Future] = {name: Future() for name in jobs}
        self._slots = threading.Semaphore(1)
        self._full_speed = threading.Event()
        self._stopping = threading.Event()
        self._running: list[threading.Thread] = []
        self._dispatcher = threading.Thread(target=self._dispatch, name="launch-dispatcher", daemon=True)
        self._dispatcher.start()

    def result(self, name: str) -> Any:
        """The launch's result (or its exception), waiting for it; from now on, three at a time."""
        if not self._full_speed.is_set():
            self._full_speed.set()
            self._slots.release(2)  # the foreground waits: its core is free, and so are the waits
        return self._futures[name].result()

    def stop(self) -> None:
        """Starts nothing more and waits for the launches under way (each has its own timeout)."""
        self._stopping.set()
        self._slots.release()  # (wakes the dispatcher if it waits for a slot)
        self._dispatcher.join()
        for thread in self._running:
            thread.join()
        for future in self._futures.values():
            future.cancel()  # (what never started)

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
            self._slots.release()

    def _futures_result(self, name: str) -> Any:
        return self._futures[name].result()
