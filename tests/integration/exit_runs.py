"""Processes that exit after a fault, for tests/integration/test_exit_handling.py: what
happens as Python finalizes is the subject, so each case is a fresh interpreter."""

import subprocess
import sys

from processes import clean_env

EXITING = """
import atexit
import torch.distributed as dist
from lightning_fabric.utilities.distributed import _destroy_dist_connection
from lightning_stale.strategies.faults import destroy_groups_at_exit
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
atexit.register(_destroy_dist_connection)  # as Lightning does where the default group is NCCL
destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *args: (print("destroyed", flush=True), destroy(*args))
for clean in {teardowns}:  # registered once, however many teardowns
    destroy_groups_at_exit(clean=clean)
"""

# one process per sequence of teardowns, the three side by side
TEARDOWNS = {"all-clean": [True, True], "failed-last": [True, False], "clean-after-a-failure": [False, True]}


def run_exiting(folder):
    """Each sequence of teardowns: (exit status, stdout, stderr)."""
    started = {name: subprocess.Popen([sys.executable, "-c", EXITING.format(store=folder / name, teardowns=teardowns)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
               for name, teardowns in TEARDOWNS.items()}
    ended = {name: process.communicate(timeout=120) for name, process in started.items()}
    return {name: (started[name].returncode, *ended[name]) for name in TEARDOWNS}


LEAVING = """
import os, sys, threading, time
import torch, torch.distributed as dist
from lightning_stale.strategies.faults import exit_before_finalization
rank, hook = int(sys.argv[1]), sys.argv[2] == "1"
dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2)
if rank == 0:  # a peer slower to leave: it exits once rank 1 finalizes, or has ended (the
    for _ in range(1200):  # test says so: with the hook, rank 1 ends before finalizing)
        if os.path.exists("{store}.finalizing") or os.path.exists("{store}.ended"):
            break
        time.sleep(0.05)
    os._exit(0)
threading.Thread(target=dist.recv, args=(torch.empty(4), 0), daemon=True, name="stale-mesh-recv-0").start()
if hook:
    exit_before_finalization()

class SlowToCollect:  # collected as rank 1 finalizes: it tells rank 0, and outlasts its exit
    def __del__(self):
        open("{store}.finalizing", "w").close()
        time.sleep(2.0)

sys.modules["slow_to_collect"] = SlowToCollect()
raise RuntimeError("optimizer step failed")
"""


def run_leaving(folder):
    """Without and with `exit_before_finalization`: the failed rank's (exit status, stderr)."""
    results = {}
    for hook in (False, True):
        store = folder / f"store-{int(hook)}"
        code = LEAVING.format(store=store)
        peers = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(int(hook))], stderr=subprocess.PIPE,
                                  text=True, env=clean_env()) for rank in (0, 1)]
        stderr = peers[1].communicate(timeout=60)[1]
        (folder / f"store-{int(hook)}.ended").touch()
        peers[0].communicate(timeout=60)
        results[hook] = (peers[1].returncode, stderr)
    return results
