"""Freed heap memory handed back to the operating system after a burst of large bodies: glibc keeps
what a burst freed in its arenas (the router's RSS stays grown) until malloc_trim returns it.
A no-op where the C library is not glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("pdserve.router.heap_trim")


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the OS (blocks for milliseconds: call it off the loop)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
