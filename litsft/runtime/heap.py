"""Handing the memory that large short-lived arrays leave behind back to the operating system.

glibc's malloc serves a block larger than its mmap threshold with a mapping of its own, unmapped when it is
freed, but the threshold rises to the size of each such block freed (up to 32 MB on 64-bit systems,
https://man7.org/linux/man-pages/man3/mallopt.3.html, M_MMAP_THRESHOLD): after one large temporary numpy
array is freed, the next ones up to its size come from the heap, and once freed they stay resident while
any live block lies above them. Loading 1.9M samples left 18 MB that way in every rank, and planning
their epoch 29 MB more (72 MB of anonymous memory with 26 MB live; 30 MB once released).
`release_freed_heap` asks glibc to return every whole free page
(malloc_trim(0), https://man7.org/linux/man-pages/man3/malloc_trim.3.html); elsewhere (macOS, musl) it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library to load, or one without malloc_trim (not glibc)
        return None


def release_freed_heap() -> bool:
    """Return the heap's free pages to the operating system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
