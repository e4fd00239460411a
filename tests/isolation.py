"""What a test may not leave behind for the next one (checked by tests/conftest.py's
``leaves_nothing_behind`` at every test's teardown): a torch.distributed default group, the
engine's threads (all named ``stale-*``) still running, or another intra-op thread count than the
session's (a replay or a timing after it would compute otherwise)."""

import threading
import time

# The default group tests/conftest.py's `gloo_group_of_one` holds for its module: not a leak.
MODULE_GROUP = {"owned": False}
# Threads that outlived an earlier test, reported there, so that only new leaks fail a test.
REPORTED_THREADS: set = set()
# The session's intra-op thread count (tests/conftest.py's `one_intra_op_thread`); None: not set.
THREADS = {"count": None}
# How long a test's ``stale-*`` threads may take to end after it returns (told to stop at the end
# of a fit, they leave at their next message or timeout tick).
THREAD_GRACE_S = 5.0


def left_behind(grace_s: float | None = None) -> list[str]:
    """What the test that just ended left behind, described; a default group is destroyed
    (the threads cannot be ended from outside: they are daemons and are reported once)."""
    import torch
    import torch.distributed as dist

    problems = []
    if THREADS["count"] is not None and torch.get_num_threads() != THREADS["count"]:
        problems.append(f"the intra-op thread count is {torch.get_num_threads()}, not the session's "
                        f"{THREADS['count']}")
        torch.set_num_threads(THREADS["count"])
    if dist.is_available() and dist.is_initialized() and not MODULE_GROUP["owned"]:
        problems.append("a torch.distributed default group is still initialised")
        dist.destroy_process_group()
    running = [t for t in threading.enumerate()
               if t.name.startswith("stale-") and t.is_alive() and t not in REPORTED_THREADS]
    deadline = time.monotonic() + (THREAD_GRACE_S if grace_s is None else grace_s)
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = [t for t in running if t.is_alive()]
    if leaked:
        REPORTED_THREADS.update(leaked)
        problems.append(f"engine threads still running: {sorted(t.name for t in leaked)}")
    return problems
