"""Keep freed memory in the process instead of handing it back to the kernel after every tensor.

glibc's malloc serves any allocation above 32 MB with a fresh `mmap` and returns it with `munmap` on
free, so every large CPU tensor (a training step's attention scores, a prefill's logits) is paid for
again in page faults: the kernel zeroes each 4 KB page on first touch. Measured on this project's
2-core CPU, one `dspark bench train` spent more system time than user time that way, and keeping the
memory (below) took the cached pipeline from 1,122 to 1,790 supervised tokens/s (docs/training.md).
PyTorch's own CPU advice is the same (jemalloc / tcmalloc); this does it with the allocator already
loaded. The cost: the process keeps its peak heap until it exits.

Applied by the `dspark` command line; a program importing the library decides for itself (call
`keep_freed_memory()`). `DSPARK_SYSTEM_MALLOC=1` leaves the allocator as it is.
"""

import ctypes
import ctypes.util
import os

#: glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

#: free memory at the top of the heap beyond this is still given back (C int: at most 2 GiB - 1)
TRIM_THRESHOLD = 2**31 - 1

_applied = False


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed memory for reuse (glibc only; once per
    process). Returns whether the setting is in force."""
    global _applied
    if _applied:
        return True
    if os.environ.get("DSPARK_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    _applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (mallopt with these meanings), else None (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
