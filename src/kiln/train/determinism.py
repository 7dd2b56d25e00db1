"""`train.deterministic`: the same step on the same layout gives the same bits, on GPUs too.

On a CPU Kiln's step is deterministic already. On a GPU three things are not unless asked: kernels that
accumulate with atomics (flash attention's backward, index_add, scatter), cuBLAS's split-K workspace
(which needs CUBLAS_WORKSPACE_CONFIG before the first matmul), and inductor, which benchmarks kernel
configurations per process and may pick another one after a restart. What stays out of reach is the
layout: NCCL chooses its reduction algorithm (ring, tree, the number of channels) from the number of
GPUs and how they connect, so a resume on another layout sums gradients in another order. The layout is
recorded in each checkpoint and a resume on a different one warns. A GPU run confirms the bitwise resume
(benchmarks/gpu_1b.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kiln.train.parallel import Dist

CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(enabled: bool) -> None:
    """Call before the first CUDA matmul (cuBLAS reads its workspace setting once, at its first handle)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    import torch._inductor.config as inductor

    inductor.deterministic = True  # no per-process autotuning: the same kernels after a restart


def layout(d: Dist, deterministic: bool) -> dict[str, Any]:
    """What a bitwise resume needs unchanged besides the software: ranks, ranks per node, the device model."""
    return {"deterministic": deterministic, "world_size": d.world,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "device": torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"}


def layout_warning(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """Why a resume of a deterministic run is not bitwise (None when it is, or the run was not deterministic)."""
    if not saved or not saved.get("deterministic"):
        return None
    diff = {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k]}
    if not diff:
        return None
    text = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
    return (f"resuming a deterministic run on another layout ({text}): the losses will not be bitwise those of "
            "an uninterrupted run (NCCL and the kernels choose their reduction order per layout)")
