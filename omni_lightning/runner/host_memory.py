"""Giving freed host memory back to the operating system after a predict run.

A CPU decode allocates and frees large activations every step, and glibc's malloc keeps most of what
is freed (the heap shrinks only from its top, which returned waveforms pin): after a run the process
holds memory nothing uses. ``malloc_trim(0)`` returns every free page of every arena, so what stays
resident is what is still referenced. Once per run, not per step: the next step would fault the pages
in again. Where the C library has no ``malloc_trim`` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_free_host_memory() -> bool:
    """Returns the C heap's free pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
