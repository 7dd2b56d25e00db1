"""The environment a run depends on: its fingerprint, the one list of what must match, and the comparison.

A run records `fingerprint()` as `run/env.json` and in each checkpoint manifest's `env` (beside the layout);
a resume (`checkpoint.strict_env`) and `kiln doctor --against RUN_DIR` judge a difference by the same list,
PINNED, so what stops a resume is what the doctor fails on.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from kiln import __version__

# Differences in these between a recorded run and now change numerics or break collectives: a resume stops (or
# warns, strict_env=false) and `kiln doctor --against` fails. The rest of the fingerprint is reported only.
PINNED = ("kiln", "python", "torch", "cuda", "nccl", "driver", "gpus")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(nvml=None) -> dict[str, Any]:
    """What a run depends on: versions, devices and host size. Plain JSON; a run stores it as run/env.json.

    nvml: an NVML module already loaded (kiln.hardware.load_nvml), else it is loaded here for the driver."""
    import torch

    from kiln.hardware import driver_version, load_nvml

    fp = {
        "kiln": __version__, "python": platform.python_version(), "os": platform.platform(),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "nccl": None, "driver": None, "gpus": [],
    }
    try:
        fp["ram_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        fp["ram_gb"] = None
    if torch.cuda.is_available():
        fp["gpus"] = [{"name": torch.cuda.get_device_name(i),
                       "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                      for i in range(torch.cuda.device_count())]
        fp["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    nvml = nvml or load_nvml()
    if nvml is not None:
        fp["driver"] = driver_version(nvml)
    return fp


def _gpu_names(value):
    return [g.get("name") if isinstance(g, dict) else g for g in value] if isinstance(value, list) else value


def compare(recorded: dict[str, Any], now: dict[str, Any]) -> list[dict[str, Any]]:
    """Every key the run recorded whose value differs now, marked `pinned` when it is in PINNED.

    GPUs compare by model name (older runs recorded names only; memory follows from the model). A key the
    record lacks is not judged: a record written before Kiln recorded that key says nothing about it."""
    diffs = []
    for k in sorted(recorded):
        was, is_ = (_gpu_names(recorded[k]), _gpu_names(now.get(k))) if k == "gpus" else (recorded[k], now.get(k))
        if was != is_:
            diffs.append({"key": k, "recorded": was, "now": is_, "pinned": k in PINNED})
    return diffs


def resume_mismatches(recorded: dict[str, Any], now: dict[str, Any] | None = None) -> dict[str, tuple]:
    """{key: (recorded, now)} of the pinned keys that differ: what a resume from `recorded` refuses or warns of."""
    return {d["key"]: (d["recorded"], d["now"]) for d in compare(recorded, now or fingerprint()) if d["pinned"]}
