"""Everything here starts real processes (about 8 s of start-up each): marked slow, so that
``pytest -m "not slow"`` is the quick loop."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
