"""One launch of tests/integration/scripts/faults.py, watched from outside: when every process of
the run is gone, how each ended and what it wrote (see test_faults.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from processes import SCRIPTS, clean_env

LAUNCH_TIMEOUT_S = 150


@dataclass
class Run:
    status: int | None  # the launcher's (rank 0's) exit status; None while it is frozen
    output: str
    out: Path
    fault: dict | None  # what was injected, and when (time.time())
    gone_after: float  # seconds from the fault (or the start) until every process was gone
    exceptions: dict  # rank -> {"type", "message", "time"}: how each process's fit ended
    ends: dict  # rank -> {"raised": the exception fit raised, or None}
    rank0: dict | None  # rank 0's report after fit (see faults.py)
    frozen_status: dict  # rank -> exit status of the children of a frozen launcher

    def logs(self):
        return self.out / "logs" / "version_0"

    def tail(self):
        return self.output[-8000:]  # (after a hang: every thread's stack)


def _proc_state(pid):
    """(state letter, exit status for a zombie) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[-1]) >> 8  # exit_code (Linux >= 3.5), waitpid's encoding


def _running(pid):
    state = _proc_state(pid)
    return state is not None and state[0] not in "ZX"


def _pids(out):
    return {int(p.name.split("_")[1]): int(p.read_text()) for p in out.glob("pid_*")}


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


def launch(case, tmp_path, *args, frozen=()):
    """Run one case; ``frozen``: ranks left stopped by the fault (not waited for; killed after)."""
    out = tmp_path / case
    out.mkdir()
    start = time.time()
    with (out / "output.txt").open("w") as log:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "faults.py"), case, str(out), *map(str, args)],
                                cwd=out, env=clean_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    frozen_status = {}
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while time.monotonic() < deadline:
            pids = _pids(out)
            launcher_done = proc.poll() is not None or (0 in frozen and (out / "fault.json").exists())
            if launcher_done and pids and not any(_running(p) for r, p in pids.items() if r not in frozen):
                break
            time.sleep(0.05)
        else:  # a hang: every process prints its threads' stacks into the output
            for pid in _pids(out).values():
                if _running(pid):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
        gone = time.time()
        for rank, pid in _pids(out).items():
            state = _proc_state(pid)
            if rank not in frozen and state is not None and state[0] == "Z":
                frozen_status[rank] = state[1]  # a child the stopped launcher could not reap
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(proc.pid, sig)  # whatever is left of the run, orphans included
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    fault = _read(out / "fault.json")
    print(f"{case}: every process gone {gone - (fault['time'] if fault else start):.1f} s after the "
          f"{'fault' if fault else 'start'}")
    exceptions = {int(p.stem.split("_")[1]): _read(p) for p in out.glob("exception_*.json")}
    ends = {int(p.stem.split("_")[1]): _read(p) for p in out.glob("end_*.json")}
    return Run(None if 0 in frozen else proc.returncode, (out / "output.txt").read_text(), out, fault,
               gone - (fault["time"] if fault else start), exceptions, ends, _read(out / "rank0.json"),
               frozen_status)


# a case's ranks left stopped by its fault (see `launch`)
FROZEN = {"sigstop_server": (0,), "continue_frozen_at_epoch_end": (2,)}
# "resume" continues from the checkpoint of a pre-empted run: that case's
RESUMES = "sigterm_launcher"


def run_case(case, folder, result):
    """The launch of ``case`` in ``folder``; ``result(name)`` waits for another launch's run."""
    if case == "resume":
        return launch(case, folder, result(f"faults/{RESUMES}").out / "on_exception.ckpt")
    return launch(case, folder, frozen=FROZEN.get(case, ()))
