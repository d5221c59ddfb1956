"""Keep freed host memory in the process instead of returning it to the OS after every step.

PyTorch's CPU tensors come from the C library's ``malloc``. With glibc's defaults, every block above a
(dynamic) threshold is ``mmap``-ed on allocation and ``munmap``-ed when freed, and memory freed at the top
of the heap is trimmed back to the OS. A training step frees and re-allocates the same activation and
gradient buffers every step, so each step pays the page faults of touching fresh pages again (10-25% of a
CPU step for the models here, measured with ``benchmarks/k3_speed.py``). Raising the thresholds makes the
heap keep and reuse those pages; the process's peak memory is unchanged, it just stops shrinking between
steps. Same effect as starting Python with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_applied = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed blocks instead of unmapping or trimming them. Returns whether the
    settings were applied (False on non-glibc platforms, where nothing is changed). Idempotent."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, 1 << 30),  # blocks below 1 GiB come from the heap, not from mmap
            (_M_TRIM_THRESHOLD, 2**31 - 1),  # never trim the heap top back to the OS
            (_M_TOP_PAD, 1 << 28),  # grow the heap in 256 MiB steps
        )
    )
    _applied = ok
    return ok
