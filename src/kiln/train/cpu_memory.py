"""Keep the memory a CPU training step frees for the next step (glibc's malloc only).

glibc hands large freed blocks back to the OS (munmap, or trimming the top of the heap) and the next
step page-faults them in again, zero-filled. A training step frees and re-allocates the same
activations every step, so that churn is pure cost: in a bf16 step of a 5 M-parameter model on 2
cores it was 330,000 extra page faults over 25 steps and 7-10% of the step time (BENCHMARKS.md,
"Training vs peers"). Fixing the thresholds keeps blocks up to 32 MB on the heap and the heap at its
high-water mark. GPU memory is untouched (CUDA has its own caching allocator).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit: blocks below it come from the heap
TRIM_THRESHOLD = 1 << 30  # free space at the heap's top kept before giving it back


def keep_freed_memory() -> bool:
    """Set the thresholds for this process; False where the C library has no `mallopt` (macOS) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
