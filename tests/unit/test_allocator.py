"""The allocator setting the strategy makes at its first fit (`engine.distributed.allocator`),
checked in a fresh interpreter: glibc's counters say whether a large vector was mapped fresh
from the system or served from memory the process had freed. The interpreter loads the module
from its file, without the package (whose import brings Lightning, seconds for nothing here)."""

import subprocess
import sys

import pytest

from lightning_stale import StaleStrategy
from lightning_stale.engine.distributed import allocator

CHECK = """
import ctypes
import importlib.util
import sys
import torch

spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
hold_freed_memory = allocator.hold_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
mapped = lambda: libc.mallinfo2().hblkhd  # bytes in blocks mapped from the system
vector = lambda: torch.ones(10 << 20)  # 40 MB, a whole-model vector of 10M parameters

before = mapped()
a = vector(); fresh_by_default = mapped() - before >= 40 << 20
del a
took = hold_freed_memory()
b = vector(); held = mapped() - before
del b
c = vector(); held_again = mapped() - before  # the freed block, reused
print(fresh_by_default, took, held, held_again)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_large_freed_vectors_are_reused_once_held():
    done = subprocess.run([sys.executable, "-c", CHECK, allocator.__file__], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    fresh_by_default, took, held, held_again = done.stdout.split()
    assert fresh_by_default == "True"  # glibc's default: a block this large is mapped, and unmapped on free
    assert took == "True"
    assert int(held) == 0 and int(held_again) == 0  # held: from the heap, never mapped


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_hold_freed_memory_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=r"hold_freed_memory must be True or False, got"):
        StaleStrategy("k_async", 1, hold_freed_memory=bad)
