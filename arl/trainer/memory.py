"""The trainer rank's host allocator: freed tensor memory goes back to the system.

glibc's malloc serves a large block with its own ``mmap`` (unmapped again on free) only while the
block is above a threshold that *rises* to the size of each such block freed, up to 32 MiB.  After
the first backward every activation, gradient and temporary under 32 MiB (at 2048 tokens: all of
them) is carved from the heap instead, which is returned to the system only from its top: one small
tensor still alive above the freed ones (an adapter's 2048 x 16 activation, an optimizer scalar)
pins them.  Measured on SmolLM2-135M at bench/bench_lora.py's shapes (docs/lora.md): after an RL step
a LoRA rank held 0.2 GiB of live allocations and 5.2 GiB of freed memory malloc kept resident, and
its resident peak was above full fine-tuning's although its tensors were far fewer.  A fixed
threshold (``M_MMAP_THRESHOLD``, which also turns the rising off) keeps every block from 1 MiB up
on its own mapping, so the resident set follows the tensors alive.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def release_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where the C
    library is not glibc (nothing to do: other allocators do not have the rising threshold)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
