"""Give the host heap's freed pages back to the OS during a long CPU decode.

A decode step allocates and frees a few [rows, vocab] float buffers, while the tables' small
per-step figures and the growing caches stay allocated between them. glibc's malloc then cannot
reuse most of the freed space (the small survivors split it), so the process's resident memory
grew with the tokens although what it held did not: measured on a tiny model with the default
model's 49,152-token vocabulary at batch 8, peak RSS 784 MB at 256 new tokens and 4,232 MB at 2,048
(examples/bench_memory.py). `malloc_trim` returns the free pages inside the heap
(madvise), so the resident memory stays what is live. Forcing those buffers onto mmap instead
(M_MMAP_THRESHOLD) also bounds it, but cost about 1.7x the CPU time there: every step then
faults its buffers in afresh. Nothing to do on a GPU (its caching allocator reuses blocks) or
without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

# Steps between trims: a trim costs about a millisecond; 32 steps of a large-vocabulary model
# leave tens of MB to return.
TRIM_EVERY = 32


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim_host_heap(step: int, device: torch.device) -> None:
    """Every TRIM_EVERY steps of a decode on the CPU, hand the heap's free pages back."""
    if step % TRIM_EVERY or device.type != "cpu":
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
