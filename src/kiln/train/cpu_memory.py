"""Host memory: what a rank needs at start-up (planned by `kiln plan`, checked by `kiln doctor --config` and by
the trainer before any work), and keeping the memory a CPU training step frees for the next step.

Start-up need of one rank (`startup_host_bytes`): the process itself with torch and Kiln imported
(HOST_BASE_BYTES: 0.25 GB measured on a CPU, `python -m benchmarks startup_memory`; with CUDA its context and
libraries, ~2 GB assumed until a GPU run measures it), plus the largest parameter tensor in fp32 (what the
initial draw of a layout whose part is not one box, or a checkpoint read, holds at once; the model itself is
built on the meta device and each rank materialises only its part on its device), plus, when the device is
the CPU, this rank's part of the weights, gradients and AdamW state (16 bytes a parameter).

Keeping freed memory (glibc's malloc only).

glibc hands large freed blocks back to the OS (munmap, or trimming the top of the heap) and the next
step page-faults them in again, zero-filled. A training step frees and re-allocates the same
activations every step, so that churn is pure cost: in a bf16 step of a 5 M-parameter model on 2
cores it was 330,000 extra page faults over 25 steps and 7-10% of the step time (BENCHMARKS.md,
"Training vs peers"). Fixing the thresholds keeps blocks up to 32 MB on the heap and the heap at its
high-water mark. GPU memory is untouched (CUDA has its own caching allocator).
"""

from __future__ import annotations

import ctypes

from kiln.errors import KilnError

HOST_BASE_BYTES = {"cpu": 0.5e9, "cuda": 2.5e9}  # a rank before its model (the module docstring)

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


def startup_host_bytes(model, device_type: str, shards: int) -> float:
    """One rank's host memory at start-up (the module docstring): `model` may be on the meta device; `shards`:
    the ranks one copy of the weights is split over (dp_shard · tp · pp)."""
    params = {id(p): p for p in model.parameters()}.values()
    need = HOST_BASE_BYTES.get(device_type, HOST_BASE_BYTES["cuda"]) + 4 * max(p.numel() for p in params)
    if device_type == "cpu":
        need += 16 * sum(p.numel() for p in params) / shards
    return need


def available_host_bytes() -> int | None:
    """MemAvailable of this node (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_host_memory(per_rank: float, ranks_here: int, available: int | None) -> str | None:
    """None when `ranks_here` ranks of `per_rank` bytes fit in `available`, else the one line that says why not."""
    if available is None or per_rank * ranks_here <= available:
        return None
    return (f"host memory: {ranks_here} rank(s) on this node need {ranks_here * per_rank / 1e9:,.1f} GB at start-up "
            f"({per_rank / 1e9:,.2f} GB each), and the node has {available / 1e9:,.1f} GB available; start fewer "
            f"ranks per node, shard the model over more ranks (parallel.dp_shard, tp, pp) or free memory")


def ranks_on_this_node(world: int) -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", world if world == 1 else min(world, 8)))


def require_host_memory(model, device_type: str, shards: int, world: int) -> None:
    """The trainer's check before any work: a KilnError naming the shortfall."""
    problem = check_host_memory(startup_host_bytes(model, device_type, shards), ranks_on_this_node(world),
                                available_host_bytes())
    if problem:
        raise KilnError(problem)
