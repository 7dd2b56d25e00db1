"""Throughput probes shared by `kiln doctor` and `kiln preflight`: matmul TFLOP/s against the device's
datasheet peak, the training loader's tokens/s on real shards, and all-reduce bandwidth over N local processes."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_peak(dtype: str) -> tuple[str, float | None, str]:
    """(device name, datasheet peak TFLOP/s or None, source). The table is the trainer's, for MFU: one place."""
    from kiln.train.metrics import device_name, peak_tflops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak, source = peak_tflops(device, dtype, None)
    return device_name(device), peak, source


def _timed_loop(fn, seconds: float, min_iters: int = 3) -> tuple[int, float]:
    """Run fn until `seconds` have passed (at least min_iters times); (iterations, elapsed)."""
    fn()  # warm-up: first-call allocation and kernel selection are not throughput
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0, n = time.perf_counter(), 0
    while n < min_iters or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    sync()
    return n, time.perf_counter() - t0


def matmul_tflops(dtype: str = "fp32", size: int | None = None, seconds: float = 1.0) -> float:
    """Achieved TFLOP/s of a square matmul in `dtype` on the default device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    # The peak table's fp32 figure is TF32 tensor-core math, so measure fp32 the same way.
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        iters, elapsed = _timed_loop(lambda: a @ b, seconds)
    finally:
        torch.set_float32_matmul_precision(before)
    return 2 * n**3 * iters / elapsed / 1e12


def loader_tokens_per_s(shards: Path, batch_size: int, seed: int, seconds: float = 1.0) -> float:
    """Tokens/s of the training Loader itself (seeded permutation, memmap reads, int64 tensors) on the train split."""
    from kiln.shards.reader import ShardSet
    from kiln.train.loader import Loader

    samples = ShardSet(shards, "train")
    loader = Loader(samples, min(batch_size, len(samples)), min(batch_size, len(samples)), 0, 1, seed)
    iters, elapsed = _timed_loop(loader.next_batch, seconds)
    return iters * loader.global_batch * (samples.sample_len - 1) / elapsed


# --- all-reduce ---------------------------------------------------------------------------------

def _collective_loop(fn, seconds: float, device: torch.device) -> tuple[int, float]:
    """Like _timed_loop, but every rank must run the same number of collectives: rank 0's count is broadcast."""
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    if device.type == "cuda":  # NCCL returns before the reduction is done: time the work, not the launches
        torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / 3
    n = torch.tensor([max(3, int(seconds / max(per_call, 1e-9)))], device=device)
    dist.broadcast(n, src=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(int(n.item())):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return int(n.item()), time.perf_counter() - t0


def measure_allreduce(rank: int, world: int, device: torch.device, sizes: list[int], seconds: float) -> dict[int, dict]:
    """Bus bandwidth and correctness of all-reduce at each size, over the initialised default group."""
    results = {}
    for size in sizes:
        t = torch.full((size // 4,), float(rank + 1), device=device)
        dist.all_reduce(t)  # also the correctness probe: every element must be 1 + 2 + ... + world
        correct = bool((t == world * (world + 1) / 2).all())
        iters, elapsed = _collective_loop(lambda: dist.all_reduce(t), seconds, device)
        # Bus bandwidth as nccl-tests defines it: a ring moves 2(n-1)/n of the buffer per rank.
        results[size] = {"busbw_gbps": 2 * (world - 1) / world * size * iters / elapsed / 1e9, "correct": correct}
    return results


def _allreduce_worker(rank: int, world: int, init_file: str, sizes: list[int], seconds: float, out_dir: str) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = measure_allreduce(rank, world, device, sizes, seconds)
        if rank == 0:
            import json

            Path(out_dir, "allreduce.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def group_allreduce(sizes: list[int], seconds: float, timeout_s: float = 600) -> dict:
    """All-reduce over every rank of the torchrun group this process belongs to (several nodes too):
    {"backend", "world", "hosts", "results"} with rank 0's measurement, the same on every rank."""
    from kiln.train.parallel import all_gather_objects, broadcast_object, init_distributed

    torch.set_num_threads(1)
    d = init_distributed(timeout_s)
    try:
        hosts = sorted(set(all_gather_objects(d, d.host)))
        results = measure_allreduce(d.rank, d.world, d.device, sizes, seconds)
        correct = all_gather_objects(d, all(r["correct"] for r in results.values()))
        summary = {"backend": dist.get_backend(), "world": d.world, "hosts": hosts, "results": results,
                   "wrong_ranks": [r for r, ok in enumerate(correct) if not ok]}
        return broadcast_object(d, summary)
    finally:
        dist.destroy_process_group()


def allreduce_bandwidth(procs: int, sizes: list[int], seconds: float = 0.5) -> dict[int, dict]:
    """Bus bandwidth (GB/s) and correctness of all-reduce over `procs` local processes (nccl on GPU, gloo on CPU)."""
    import json

    with tempfile.TemporaryDirectory(prefix="kiln-allreduce-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_allreduce_worker, args=(procs, init_file, sizes, seconds, tmp), nprocs=procs,
                           join=True, start_method="spawn")
        return {int(k): v for k, v in json.loads(Path(tmp, "allreduce.json").read_text()).items()}
