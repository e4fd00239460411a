"""Everything here starts real processes (about 8 s of start-up each): marked slow, so that
``pytest -m "not slow"`` is the quick loop.

The launches whose tests assert no timing run two at a time (`launched`): much of a launch is
importing Lightning and waiting on other processes. Their tests run first, so that the launches
that do check timings (the faults, a frozen or a dead learner, torchrun) run once they are over.
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from processes import free_port, run_race, run_script

HERE = Path(__file__).parent

# name: (the test file, its fixture that takes the launch's result, the launch, given a folder)
POOLED = {
    "race": ("test_app_command_line.py", "race", run_race),
    "variants": ("test_engine_processes.py", "variants", lambda folder: run_script("variants.py", folder)),
    "paths": ("test_engine_processes.py", "paths", lambda folder: run_script("paths.py", folder)),
    "transport": ("test_engine_processes.py", "transports",
                  lambda folder: run_script("transport.py", folder, timeout=120, TEST_PORT=str(free_port()))),
    "minibatch_timer": ("test_minibatch_timer.py", "traces",
                        lambda folder: run_script("minibatch_timer.py", folder)),
    "replay": ("test_replay_processes.py", "recorded", lambda folder: run_script("replay.py", folder)),
    "user_modules": ("test_user_modules_processes.py", "runs",
                     lambda folder: run_script("user_modules.py", folder)),
}


def _uses(item, name):
    module, fixture, _ = POOLED[name]
    return Path(item.fspath).name == module and fixture in item.fixturenames


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
    # (a stable sort: the pooled launches' tests, then the unit tests, then the other launches)
    items.sort(key=lambda item: Path(item.fspath).is_relative_to(HERE) and not any(_uses(item, n) for n in POOLED))


@pytest.fixture(scope="session")
def launched(request, tmp_path_factory):
    """``launched(name)``: the result of the launch ``name`` of `POOLED`. At the first call every
    launch that a selected test needs starts, two at a time, in the tests' order."""
    wanted = [name for name in POOLED if any(_uses(item, name) for item in request.session.items)]
    first = {name: next(i for i, item in enumerate(request.session.items) if _uses(item, name)) for name in wanted}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(POOLED[name][2], tmp_path_factory.mktemp(name))
                   for name in sorted(wanted, key=first.get)}
        yield lambda name: futures[name].result()
        pool.shutdown(wait=True, cancel_futures=True)  # (after a failure, what has not started never will)
