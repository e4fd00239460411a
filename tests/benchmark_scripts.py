"""The benchmark scripts of benchmarks/, imported as modules by the tests of their computations."""

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str):
    """benchmarks/``name``.py as a module (the scripts import their `_common` as a sibling)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
