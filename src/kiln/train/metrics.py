"""What a step reports: metrics.jsonl always, TensorBoard when installed, MFU against a peak table.

metrics.jsonl holds one JSON object per line with an `event`: "step" (one per
optimizer step, with the world size and the wall time), "eval", "task", "skip", "rollback", "save", "scale"
(fp16 loss-scale change), "budget", "stop", "alert", "resume_on_new_data", "membership" (an elastic job's group
changed: parts/membership.py), "samples" (loader.record_samples: parts/sample_log.py); every field is in
docs/formats.md.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from kiln.manifest import write_atomic

# Dense peak TFLOP/s per device (no sparsity: half the datasheets' starred figures), from NVIDIA's datasheets
# (H100 SXM/PCIe/NVL, H200 SXM/NVL, A100, L40S, L4, RTX 4090). "fp32" is TF32 tensor-core math, which torch
# uses for fp32 matmuls when allowed. A device takes the first key its name contains: the PCIe and NVL
# variants, slower than the SXM part of the same name, come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 417.5},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 417.5},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
}
PEAK_SOURCE = "vendor datasheets, dense tensor-core peak (src/kiln/train/metrics.py)"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> tuple[float | None, str]:
    """(peak, where it came from); (None, why) for a device the table does not know."""
    if override:
        return override, "config train.peak_tflops"
    return peak_of(device_name(device), dtype)


def peak_of(name: str, dtype: str) -> tuple[float | None, str]:
    """(peak, where it came from) for a device name as torch reports it, e.g. "NVIDIA H100 PCIe"."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[dtype], f"{key} ({PEAK_SOURCE})"
    return None, f"unknown device {name!r}: set train.peak_tflops to report MFU"


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / (peak * 1e12 * world)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / (2**30 if sys.platform == "darwin" else 2**20)


def host_peak_bytes() -> int:
    """This process's peak resident memory so far: VmHWM (Linux; ru_maxrss carries a forked parent's size over
    exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024


def startup_record(model: torch.nn.Module, rank: int, device: torch.device) -> dict:
    """The `startup` record of one rank (formats.md): its parameters' bytes (its shard: a DTensor's local part),
    its host peak so far and its device's peak allocation (None on a CPU)."""
    local = (getattr(p, "_local_tensor", p) for p in model.parameters())
    return {"event": "startup", "rank": rank, "param_bytes": sum(t.numel() * t.element_size() for t in local),
            "host_peak_bytes": host_peak_bytes(),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def startup_line(record: dict, world: int) -> str:
    peak = record["device_peak_bytes"]
    device = "" if peak is None else f", device peak {peak / 2**30:.2f} GiB"
    return (f"start-up done: rank {record['rank']} of {world} holds {record['param_bytes'] / 2**30:.2f} GiB of "
            f"parameters; host peak {record['host_peak_bytes'] / 2**30:.2f} GiB{device}")


def report_startup(model: torch.nn.Module, d, event, log) -> None:
    """Start-up is over: every rank's `startup` record to `event` on rank 0 (one all-gather; rank 0 writes
    metrics.jsonl), rank 0's line on the console."""
    from kiln.train.parallel.dist import all_gather_objects

    records = all_gather_objects(d, startup_record(model, d.rank, d.device))
    if d.is_main:
        for record in records:
            event(record)
        log(startup_line(records[0], d.world))


class MetricsLog:
    def __init__(self, path: Path, resume_step: int, tensorboard_dir: Path | None = None,
                 sinks: list | None = None) -> None:
        self.sinks = list(sinks or [])  # more loggers (kiln.train.loggers): write(record), close()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Lines written after the checkpoint we resume from describe steps that will run again; a line that does
        # not parse is the torn last write of a killed writer (a lost node).
        if self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and _step_of(ln) <= resume_step]
            write_atomic(self.path, "".join(ln + "\n" for ln in keep))
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                pass  # TensorBoard is optional: JSONL is the record

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "event", "wall_time"):
                    self.tb.add_scalar(f"{record['event']}/{k}", v, record.get("step", 0))
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        self.file.close()
        for sink in self.sinks:
            sink.close()
        if self.tb is not None:
            self.tb.close()


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
