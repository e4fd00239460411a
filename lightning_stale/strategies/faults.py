"""Ending a run promptly on every process when something fails or a signal arrives.

Three pieces, each undone in the strategy's teardown:

* `SignalTrap` replaces Lightning's SIGTERM handler (which broadcasts a flag on the default
  process group from inside the handler: learners running at their own pace cannot join that
  collective, so the process hangs) and Python's SIGINT default. The handler only records the
  signal; the `Watchdog` reports it to the server, which stops every learner through the goodbye
  protocol, after which every process raises `RunInterrupted` (Lightning's ``on_exception``
  hooks run, and the exit status is non-zero).
* `Watchdog`, a thread per process, reports a trapped signal, and ends the process when the run
  has failed but the main thread cannot notice (stuck in a collective with a dead or frozen
  peer, or in a very long step): after ``grace`` seconds without the main thread raising, and
  after ``exit_grace`` more seconds for Lightning's exception handling (``on_exception`` hooks,
  `OnExceptionCheckpoint`), it prints the reason and exits with status 1.
* `watched_launcher`: Lightning's popen launcher with its child observer (which kills every
  process 0 to 5 s after any child exits) replaced by `ChildWatch`, which gives the processes
  ``grace`` seconds to end by the protocol first, and tolerates learners that die once training
  has started when the run is meant to go on without them (``on_learner_failure="continue"``).

`FaultHandling` is the strategy's side: it installs the trap and the watchdog for a fit, tells
the server about this process's exception, hands a stop wanted inside an epoch to the server,
and, after a failure, lets the threads receiving from peers end before the process exits.
`destroy_groups_at_exit` has the process groups destroyed at interpreter exit if no fit or
evaluation in the process failed (docs/how-to/faults.md).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_stale.engine.distributed.frames import RECEIVER
from lightning_stale.engine.distributed.learner import Learner, RunInterrupted, ServerFailed

log = logging.getLogger(__name__)
TRAPPED = (signal.SIGTERM, signal.SIGINT)
# After a failure, how long a process waits for its threads receiving from peers to end (see
# `FaultHandling.leave_failed_run`; a dead peer's connection errors at once)
LEAVE_TIMEOUT_S = 5.0


def run_bounded(target: Callable[..., Any], *args: Any, name: str, timeout: float) -> None:
    """Run ``target(*args)`` on a daemon thread and wait ``timeout`` seconds at most: leaving a
    run must not hang on a peer that stopped answering."""
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    thread.start()
    thread.join(timeout)


_AT_EXIT = {"registered": False, "clean": True, "leave_early": False}
# Where Lightning keeps the exit hook that destroys the process groups (`destroy_groups_at_exit`)
LIGHTNING_EXIT_HOOKS = ("lightning_fabric.utilities.distributed", "lightning.fabric.utilities.distributed")


def destroy_groups_at_exit(clean: bool) -> None:
    """Have this process's process groups destroyed when the interpreter exits, while it is
    still whole, if every teardown in this process was ``clean``. One failure is enough to
    leave them to the process's exit for good: a group whose connections broke, destroyed under
    a thread blocked in a receive, aborts the process, and a later clean teardown (say a
    ``trainer.validate`` after a failed fit) does not mend those connections. A gloo group left
    for the interpreter's finalization can abort a process that trained successfully
    ("terminate called without an active exception"): its worker threads still hold finished
    work whose tensors are freed then. docs/how-to/faults.md says more."""
    _AT_EXIT["clean"] = _AT_EXIT["clean"] and clean
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(_destroy_groups)
    # Lightning has every group destroyed at exit where the default one is NCCL, after a failure
    # too and without a bound: NCCL's destroy waits for every operation, and one left waiting for
    # a dead or frozen peer would keep the process from ever exiting. This hook does that work.
    for name in LIGHTNING_EXIT_HOOKS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "_destroy_dist_connection"):
            atexit.unregister(module._destroy_dist_connection)


def exit_before_finalization() -> None:
    """After a failed run: at the interpreter's exit, end this process with status 1 before
    Python finalizes if a thread of ours is still blocked in a gloo receive then (a peer slower
    to leave than `LEAVE_TIMEOUT_S`, on a loaded machine). Past that point a thread coming back
    from its receive (the peer exited, closing the connection) is ended by Python with a forced
    unwind through torch's C++ frames, which aborts the process ("terminate called without an
    active exception", SIGABRT). Exit hooks run while the interpreter is still whole, after the
    failure's traceback has been printed."""
    if not _AT_EXIT["leave_early"]:
        _AT_EXIT["leave_early"] = True
        atexit.register(_exit_if_still_receiving)


def _exit_if_still_receiving() -> None:
    if any(RECEIVER.match(t.name) and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _destroy_groups() -> None:
    if _AT_EXIT["clean"] and dist.is_available() and dist.is_initialized():
        run_bounded(_destroy_quietly, name="stale-exit", timeout=LEAVE_TIMEOUT_S)  # never hangs on a peer


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the process is exiting anyway
        log.debug("could not destroy the process groups at exit: %s", exc)


class SignalTrap:
    """Records SIGTERM and SIGINT instead of acting on them (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.reason: str | None = None
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in TRAPPED:
            self._saved[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if self.reason is None:
            self.reason = f"{signal.Signals(signum).name} on rank {self.rank}"

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()


class Watchdog(threading.Thread):
    """See the module docstring.

    Args:
        trap: the signal trap of this process.
        report: tells the server that this process was interrupted (called with the reason, on
            a thread of its own: a report to a frozen server must not block the watchdog).
        failure: the run's failure (or interruption) as this process knows it (None while all
            is well).
        acknowledged: whether the main thread has raised the failure.
    """

    def __init__(self, trap: SignalTrap, report: Callable[[str], None],
                 failure: Callable[[], str | None], acknowledged: Callable[[], bool],
                 grace: float = 5.0, exit_grace: float = 30.0) -> None:
        super().__init__(daemon=True, name="stale-watchdog")
        self.trap, self.report, self.failure, self.acknowledged = trap, report, failure, acknowledged
        self.grace, self.exit_grace = grace, exit_grace
        self._done = threading.Event()  # (not `_stop`: a method of Thread)

    def run(self) -> None:
        reported = False
        reason = failed_at = acknowledged_at = None
        while not self._done.wait(0.1):
            if self.trap.reason is not None and not reported:
                reported = True
                threading.Thread(target=self._report, args=(self.trap.reason,), daemon=True,
                                 name="stale-signal-report").start()
            # (kept once known: the watchdog bounds the teardown too, when the strategy has let
            # go of its learner and server)
            reason = reason or self.failure()
            if reason is None:
                continue
            now = time.monotonic()
            failed_at = failed_at or now
            if self.acknowledged():
                acknowledged_at = acknowledged_at or now
                if now - acknowledged_at > self.exit_grace:
                    self._exit(reason, "still running after the failure was raised")
            elif now - failed_at > self.grace:
                self._exit(reason, "the training thread cannot stop (blocked in a collective or a step)")

    def _report(self, reason: str) -> None:
        try:
            self.report(reason)
        except Exception as exc:  # noqa: BLE001 - the server may be gone already
            log.warning("could not report %s to the server: %s", reason, exc)

    def stop(self) -> None:
        self._done.set()

    @staticmethod
    def _exit(reason: str, why: str) -> None:
        end_process(reason, why)


def end_process(reason: str, why: str) -> None:
    """Print why this process ends and end it with status 1, now (no exit hooks: one may wait
    for a dead peer)."""
    print(f"lightning_stale: ending this process ({why}): {reason}", file=sys.stderr, flush=True)
    os._exit(1)


class ChildWatch(threading.Thread):
    """Lightning's child-process observer with a grace period and, optionally, tolerance for
    learners that die once training has started (see the module docstring)."""

    def __init__(self, children: list[subprocess.Popen], tolerate: Callable[[], bool],
                 grace: float = 10.0) -> None:
        super().__init__(daemon=True, name="stale-child-watch")
        self.children, self.tolerate, self.grace = children, tolerate, grace

    def run(self) -> None:
        failed_at = None
        tolerated: set[int] = set()
        while True:
            time.sleep(0.5)
            codes = [child.poll() for child in self.children]
            if all(code == 0 for code in codes):
                return
            failed = [i for i, code in enumerate(codes) if code not in (None, 0) and i not in tolerated]
            if not failed:
                continue
            if self.tolerate():
                for i in failed:
                    log.warning("learner process %d (rank %d) ended with status %s; the run goes on",
                                self.children[i].pid, i + 1, codes[i])
                tolerated.update(failed)
                continue
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > self.grace:
                for child in self.children:
                    if child.poll() is None:
                        child.kill()
                i = failed[0]
                end_process(f"learner process {self.children[i].pid} (rank {i + 1}) ended with status {codes[i]}",
                               f"still running {self.grace:.0f} s after a learner process failed")
                return


def watched_launcher(launcher: Any, tolerate: Callable[[], bool]) -> Any:
    """``launcher`` (Lightning's popen launcher, of either namespace) with `ChildWatch` in
    place of Lightning's observer; other launchers are returned as they are."""
    module = sys.modules.get(type(launcher).__module__)
    if module is None or type(launcher).__name__ != "_SubprocessScriptLauncher":
        return launcher
    set_threads = importlib.import_module(module.__name__).__dict__.get("_set_num_threads_if_needed")

    def launch(self: Any, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # Lightning's launch, with our observer.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            ChildWatch(self.procs, tolerate).start()
        if set_threads is not None:
            set_threads(num_processes=self.num_processes)
        return function(*args, **kwargs)

    launcher.launch = launch.__get__(launcher)
    return launcher


class FaultHandling:
    """Mixin for `StaleStrategy` (which sets ``_learner``, ``_server`` and ``global_rank``):
    failures and stops of this process, as the module docstring describes."""

    _trap: SignalTrap | None = None
    _watchdog: Watchdog | None = None
    lost_learner: bool  # (`OwnPaceCollectives`')
    _failure_raised = False  # this process's training thread raised the run's failure

    def watch(self, learner: Learner) -> Callable[[], None]:
        """Trap signals and start the watchdog for this fit; returns the undo of the trap."""
        self._failure_raised = False
        trap = self._trap = SignalTrap(self.global_rank)
        trap.install()
        self._watchdog = Watchdog(trap, report=learner.interrupt, failure=self._known_failure,
                                  acknowledged=lambda: self._failure_raised)
        self._watchdog.start()
        return trap.restore

    def stop_watching(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def _known_failure(self) -> str | None:
        """Why this process must end soon, as far as it knows: the run failed, or a signal is
        stopping it (the watchdog gives the training thread its grace period from then)."""
        server, learner = self._server, self._learner
        if server is not None and (server.error or server.interruption):
            return server.error or server.interruption
        if server is not None and (dead := server.unheard_death()):
            return dead
        if learner is None:
            return None
        return (learner.failure or learner.endpoint.interrupted
                or (self._trap.reason if self._trap is not None else None))

    def guarded(self, fn, *args):
        """Call ``fn``; a failure of the run it raises is this process's acknowledged failure."""
        try:
            return fn(*args)
        except (ServerFailed, RunInterrupted):
            self._failure_raised = True
            raise

    def leave_failed_run(self, learner: Learner) -> None:
        """The run failed: tell every peer this process is leaving (the learner's last ABORT to
        the server, a goodbye on each of the sharded path's data connections), and wait up to
        `LEAVE_TIMEOUT_S` for the threads receiving from them to end. A thread still blocked in a
        gloo receive when Python exits aborts the process ("terminate called without an active
        exception", SIGABRT) instead of letting it exit with status 1."""
        deadline = time.monotonic() + LEAVE_TIMEOUT_S  # one bound for all of it

        def left() -> float:
            return max(0.0, deadline - time.monotonic())
        run_bounded(self._say_leaving, learner, name="stale-leaving", timeout=left())  # a send may block
        stuck = learner.exchange.close(left(), failed=True)
        if self._server is not None:  # every learner heard why; the receivers end on their leaving
            stuck += self._server.endpoint.join(left())
        if stuck:
            log.warning("StaleStrategy: threads still receiving from peers after the failure: %s", stuck)
        exit_before_finalization()

    @staticmethod
    def _say_leaving(learner: Learner) -> None:
        try:
            learner.leave_after_failure()
        except Exception as exc:  # noqa: BLE001 - the connection may be gone with the server
            log.debug("could not tell the server that learner %d left: %s", learner.rank, exc)

    def check_server(self) -> None:
        """Raise if the server failed (while rank 0 waits for something from it)."""
        if self._server is not None and self._server.error:
            raise (RunInterrupted if self._server.interrupted else ServerFailed)(self._server.error)

    def ask_to_stop(self) -> bool:
        """A stop wanted inside an epoch goes to the server, which stops every learner."""
        learner = self._learner
        if learner is None or learner.stopped:
            return False
        self.guarded(learner.request_stop)
        return True

    def stop_heard(self) -> bool:
        learner = self._learner
        return learner is not None and bool(self.guarded(learner.stop_heard))

    def note_dead_learners(self, trainer: Any) -> None:
        """A learner died (``on_learner_failure="continue"``): the default process group lost a
        member, so for the rest of this fit Lightning's collectives are answered locally and
        validation is skipped (its metrics would be reduced with the dead learner, torchmetrics'
        by torch.distributed directly). Paused at an epoch's end, the learner first waits for
        the server's roll call, so that a death noticed late is known here all the same."""
        learner = self._learner
        if learner.paused:  # (bounded as Lightning's collectives are: the process group's timeout)
            self.guarded(learner.confirm_epoch_end, (self._timeout or default_pg_timeout).total_seconds())
        if self.lost_learner or not learner.dead_learners:
            return
        self.lost_learner = self.local_collectives = True
        if trainer.limit_val_batches:
            self.patch(trainer, "limit_val_batches", 0)
            log.warning("StaleStrategy: a learner died; validation is skipped for the rest of this fit "
                        "(the default process group lost a member)")

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.fit_failed(exception)

    def fit_failed(self, exception: BaseException) -> None:
        """This process's exception ends the run: the server hears it (once) and, on rank 0,
        stops deciding before the ``on_exception`` hooks read its state."""
        self._failure_raised = True
        learner = self._learner
        if learner is None or isinstance(exception, (ServerFailed, RunInterrupted)) or learner.failure:
            return  # the failure came from elsewhere, or was reported: everyone knows already
        reason = f"learner {self.global_rank} failed: {type(exception).__name__}: {exception}"
        try:
            learner.abort(reason)
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            log.warning("could not tell the server that %s: %s", reason, exc)
        if self._server is not None:
            self._server.join(2.0)
