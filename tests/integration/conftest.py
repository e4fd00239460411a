"""Everything here starts real processes (about 8 s of start-up each): marked slow, so that
``pytest -m "not slow"`` is the quick loop.

Every launch that a selected test needs starts in the background when the session does
(tests/launches.py), in one process of the session (xdist's worker gw0 when there are several): one at
a time while the unit tests run, which are ordered first, more once tests here wait for their
results (``launched(name)``). Much of a launch is importing Lightning in one process after the
other, so it takes the core a unit test leaves free.
"""

import os
from pathlib import Path

import pytest

from exit_runs import run_exiting, run_leaving
from fault_runs import RESUMES, run_case
from launches import LaunchResults, Launches
from processes import free_port, run_crash, run_race, run_script, run_two_nodes

HERE = Path(__file__).parent

# name: (the test file, its fixture that takes the launch's result, the launch, given a folder)
LAUNCHES = {
    "advisor_sweep": ("test_advisor_sweep.py", "advised", lambda folder: run_script("advisor_sweep.py", folder)),
    "race": ("test_app_command_line.py", "race", run_race),
    "exit_groups": ("test_exit_handling.py", "exiting", run_exiting),
    "gloo_exit": ("test_exit_handling.py", "leaving", run_leaving),
    "variants": ("test_engine_processes.py", "variants", lambda folder: run_script("variants.py", folder)),
    "paths": ("test_engine_processes.py", "paths", lambda folder: run_script("paths.py", folder)),
    "transport": ("test_engine_processes.py", "transports",
                  lambda folder: run_script("transport.py", folder, timeout=120, TEST_PORT=str(free_port()))),
    "frozen": ("test_engine_processes.py", "frozen", lambda folder: run_script("frozen.py", folder)),
    "crash": ("test_engine_processes.py", "crash", run_crash),
    "two_nodes": ("test_engine_processes.py", "two_nodes", run_two_nodes),
    "local_updates": ("test_local_updates_processes.py", "runs",
                      lambda folder: run_script("local_updates.py", folder)),
    "minibatch_timer": ("test_minibatch_timer.py", "traces",
                        lambda folder: run_script("minibatch_timer.py", folder)),
    "replay": ("test_replay_processes.py", "recorded", lambda folder: run_script("replay.py", folder)),
    "user_modules": ("test_user_modules_processes.py", "runs",
                     lambda folder: run_script("user_modules.py", folder)),
}


def _needs(item):
    """The launches whose results ``item`` takes, by name."""
    if not Path(item.fspath).is_relative_to(HERE):
        return []
    module = Path(item.fspath).name
    if module == "test_faults.py":
        case = item.callspec.params["case"]  # (every test there takes one)
        return [f"faults/{RESUMES}", "faults/resume"] if case == "resume" else [f"faults/{case}"]
    return [name for name, (file, fixture, _) in LAUNCHES.items() if file == module and fixture in item.fixturenames]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
    # (a stable sort: the unit tests first, while the launches run in the background)
    items.sort(key=lambda item: Path(item.fspath).is_relative_to(HERE))


def _job(name):
    if name.startswith("faults/"):
        case = name.split("/", 1)[1]
        return lambda folder, result: run_case(case, folder, result)
    launch = LAUNCHES[name][2]
    return lambda folder, result: launch(folder)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    wanted = list(dict.fromkeys(name for item in session.items for name in _needs(item)))
    if session.config.option.collectonly or not wanted:
        return (yield)
    factory = session.config._tmp_path_factory  # (tmp_path_factory's; fixtures are not up yet)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and worker != LAUNCHING_WORKER:
        # every worker collects every test: gw0 runs the launches, the others read their results
        session.config.stash[LAUNCHES_KEY] = LaunchResults(factory.getbasetemp().parent / "launches", worker)
        return (yield)
    results = factory.getbasetemp().parent / "launches" if worker else factory.mktemp("launches")
    launches = Launches({name: (factory.mktemp(name.replace("/", "-")), _job(name)) for name in wanted}, results,
                        per_waiting_worker=2 if worker is None else 1,
                        controller=None if worker is None else os.getppid())
    session.config.stash[LAUNCHES_KEY] = launches
    finish = worker is not None  # (the other workers may wait for launches after this one is done)
    try:
        return (yield)
    except BaseException:  # (interrupted: no test waits any more)
        finish = False
        raise
    finally:
        launches.stop(finish=finish and not (session.shouldfail or session.shouldstop))


LAUNCHING_WORKER = "gw0"
LAUNCHES_KEY = pytest.StashKey["Launches | LaunchResults"]()


@pytest.fixture(scope="session")
def launched(request):
    """``launched(name)``: the result of the launch ``name`` (of `LAUNCHES`, or ``faults/CASE``),
    waiting for it."""
    return request.config.stash[LAUNCHES_KEY].result
