"""Freed memory kept for reuse while the engine moves whole-model vectors: glibc's malloc serves
them with ``mmap`` and trims freed memory back, so every push, answer and snapshot arrives as fresh
pages faulted in on first write, several times the copy's cost (docs/benchmarks/path_breakdown.md).
`hold_freed_memory` turns that off for the process's life (its peak stays, not a leak); a caching
allocator (jemalloc, tcmalloc via ``LD_PRELOAD``) has the same effect."""

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
    """Keep memory freed by this process for reuse from now on; whether glibc took the setting."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    held = all([mallopt(option, value) for option, value in HELD.items()])
    if not held:
        log.debug("mallopt refused to hold freed memory; the allocator is left as it is")
    return held
