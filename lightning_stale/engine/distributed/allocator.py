"""Freed memory kept for reuse while the engine moves whole-model vectors.

Every push, answer and parameter snapshot of the central path is a fresh vector of the model's
size (of the sharded path, a slice of one), allocated while the previous ones are still alive
(queued for a send, held by an update). glibc's malloc serves an allocation that large with
``mmap`` (always above 32 MB, its largest threshold) and trims the heap's free top back to the
system, so such vectors keep arriving as fresh pages, each faulted in on first write, on the
server thread and the receiving threads: several times the cost of the copy itself.
`hold_freed_memory` turns that off (``mallopt``: no ``mmap`` for blocks, no trimming), so freed
vectors are reused in place; the path_breakdown benchmark page has the measurement.

The cost: memory the process frees stays with it for reuse (its peak, not a leak). The setting
stays for the process's life: glibc cannot say what its settings were, and setting its defaults
back would also switch off its adaptive threshold, leaving a later fit (stock DDP's included)
worse off than before. Elsewhere than glibc (musl, macOS, Windows) this does nothing. PyTorch's
advice for CPU training, a caching allocator such as jemalloc or tcmalloc loaded with
``LD_PRELOAD``, has the same effect for the whole process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
HELD = {M_TRIM_THRESHOLD: 2**31 - 1, M_MMAP_MAX: 0}


def _mallopt() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt does nothing
    except (OSError, AttributeError):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@functools.cache  # once per process: every fit asks, and benchmarks ask before the first
def hold_freed_memory() -> bool:
    """Keep memory freed by this process for reuse from now on (see the module docstring);
    whether the allocator took the setting (False off glibc)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    held = all([mallopt(option, value) for option, value in HELD.items()])
    if not held:
        log.debug("mallopt refused to hold freed memory; the allocator is left as it is")
    return held
