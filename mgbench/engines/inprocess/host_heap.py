"""Give the host heap's freed pages back to the OS during a long CPU decode.

A decode step allocates and frees a few [rows, vocab] float buffers. Whatever small allocation
outlives a step lands between them, and glibc's malloc can then neither reuse nor return most of
the freed space: the process's resident memory grows with the tokens although what it holds does
not. Measured on a tiny model with the default model's 49,152-token vocabulary at batch 8
(examples/bench_memory.py): peak RSS 784 MB at 256 new tokens, 4,232 MB at 2,048, when each step
kept its figures as new small tensors. The runners now write those into buffers allocated once
(runners.StepColumns), which removed that growth; this trim is the guard for what else outlives a
step (a cache's growth, a policy's state): alone, before StepColumns, it brought the 2,048-token
figure to 632 MB. `malloc_trim` returns the free pages inside the heap (madvise), under a
millisecond a call there. Forcing the buffers onto mmap instead (M_MMAP_THRESHOLD) also bounds the
memory, but cost about 1.7x the CPU time: every step faults its buffers in afresh. Nothing to do on
a GPU (its caching allocator reuses blocks) or without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

# Steps between trims: often enough that a step's leftovers cannot pile up, rarely enough that
# the trims cost nothing measurable.
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
