"""The first GPU run, unattended: Kiln's Trainer on a ~1B-parameter Llama (examples/gpu-1b.yaml), bf16,
torch.compile, FSDP2 on one device; then its checkpoints and a bitwise resume after a kill.

Phases (each one's figures in one JSON report; the script exits 1 when any phase fails):

  throughput   Trainer.run() timed by the log line it prints after every step; the first WARMUP steps
               (compilation) are left out. Tokens/s of the median step, MFU (`kiln.train.metrics.mfu`) against
               the peak-table entry it names (`peak_source`; set train.peak_tflops for an unknown device),
               peak memory allocated and reserved, the step-time split (data, forward/backward, optimizer,
               the step's all-reduce) as medians of the timed steps, and a torch.profiler trace of the two
               steps after the window (run/profile/, copied to --report). Target on one H100/H200: MFU >= 45%.
  checkpoint   the same 1B trainer: a synchronous save (seconds and GB written), verification (sha256 of
               every file) and load back into the model, compared bitwise with the weights in memory; then an
               async save: the stall the training loop sees (snapshot to pinned host memory + hand-over) and
               the background write's time.
  resume       train.deterministic on: a run of RESUME_STEPS steps, and the same run SIGKILLed after
               KILL_AFTER steps and started again (it resumes from its checkpoint at CKPT_EVERY): every loss
               after the resume and the final weights must equal the uninterrupted run's bit for bit. The model
               is narrower than 1B (RESUME below), to keep three compilations inside the time budget; the
               kernels and the FSDP2/compile path are the same.

GPU time: about 2 minutes of data preparation on the CPU, then ~2-3 min throughput (compilation included),
~2 min checkpoints, ~3 min resume on an H100/H200: under 10 minutes in all.

    python benchmarks/gpu_1b.py                            # on the GPU machine; report in ./gpu-1b-report/
    python benchmarks/gpu_1b.py train.micro_batch_size=16  # any config override (throughput and checkpoint)
    python benchmarks/gpu_1b.py --skip resume              # leave a phase out
    python benchmarks/gpu_1b.py --smoke                    # a tiny model on CPU: checks the script end to end
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "gpu-1b.yaml"
SMOKE = ["tokenizer.vocab_size=512", "pack.seq_len=64", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
         "model.multiple_of=64", "train.batch_size=4", "train.micro_batch_size=2", "train.threads=2",
         "data.workers=1"]
BENCH = ["parallel.mode=fsdp"]  # FSDP2 on one device: the path a multi-GPU run takes, sharding included
# The resume check's model: the 1B's width and kernels, 4 of its 16 layers, a smaller batch.
RESUME = ["model.n_layers=4", "train.batch_size=8", "train.micro_batch_size=4"]
RESUME_SMOKE = ["parallel.compile=false"]  # CPU compilation would take most of the smoke run
# Killed once step KILL_AFTER is logged (the checkpoint at CKPT_EVERY is behind it); the steps after it leave
# the watcher time to kill before the run ends.
RESUME_STEPS, CKPT_EVERY, KILL_AFTER = 20, 6, 8
RESUME_STEPS_SMOKE = 30  # a CPU's tiny steps are fast
PHASES = ("throughput", "checkpoint", "resume")
MFU_TARGET = 0.45


class _WindowDone(Exception):
    pass


def _medians(records: list[dict], steps: set[int]) -> dict[str, float]:
    keys = ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_comm_s", "step_time_s")
    timed = [r for r in records if r.get("event") == "step" and r["step"] in steps]
    return {k: statistics.median(r[k] for r in timed) for k in keys if all(k in r for r in timed)} if timed else {}


def throughput(cfg, warmup: int, steps: int, report: Path):
    """Run the window, then two profiled steps; returns (figures, the trainer, for the checkpoint phase)."""
    import torch

    from kiln.train.metrics import mfu, read_metrics
    from kiln.train.trainer import Trainer

    ends: list[float] = []
    total = warmup + steps + 2  # the two after the window are profiled (train.profile_steps)

    def log(msg: str) -> None:
        if msg.startswith("step ") and "/" in msg.split()[1]:
            ends.append(time.perf_counter())
            if len(ends) == total:
                raise _WindowDone
        elif not msg.startswith("step "):
            print(msg, flush=True)

    trainer = Trainer(cfg, log=log)
    try:
        trainer.run()
    except _WindowDone:
        pass
    window = ends[warmup - 1:warmup + steps]
    times = [b - a for a, b in itertools.pairwise(window)]
    tokens = cfg.train.batch_size * cfg.pack.seq_len
    tps = tokens / statistics.median(times)
    d = trainer.d
    records = read_metrics(cfg.out / "run" / "metrics.jsonl")
    cuda = d.device.type == "cuda"
    profile = cfg.out / "run" / "profile"
    if profile.is_dir():
        shutil.copytree(profile, report / "profile", dirs_exist_ok=True)
    value = mfu(trainer.flops_per_token, tps, trainer.peak, d.world)
    return {
        "device": torch.cuda.get_device_name(d.device) if cuda else "cpu",
        "world": d.world, "mode": trainer.engine.parallel.name,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "flops_per_token": trainer.flops_per_token, "tokens_per_step": tokens, "timed_steps": len(times),
        "tokens_per_s": tps, "window_tokens_per_s": tokens * len(times) / (window[-1] - window[0]),
        "mfu": value, "mfu_target": MFU_TARGET, "mfu_target_met": value is not None and value >= MFU_TARGET,
        "peak_tflops": trainer.peak, "peak_source": trainer.peak_source,
        "peak_memory_allocated_gb": torch.cuda.max_memory_allocated(d.device) / 2**30 if cuda else None,
        "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(d.device) / 2**30 if cuda else None,
        "step_time_split_s": _medians(records, set(range(warmup + 1, warmup + steps + 1))),
        "compile": cfg.parallel.compile, "dtype": cfg.train.dtype,
        "profile": str(report / "profile") if profile.is_dir() else None,
    }, trainer


def checkpoint(trainer) -> tuple[dict, list[str]]:
    """Save (sync), verify, load back bitwise; then the async save's stall and write time."""
    import torch

    from kiln import checkpoint as ckpt

    failures = []
    saver, parallel = trainer.checkpointer.saver, trainer.engine.parallel
    saver.async_save = False
    before = parallel.state_dict()
    t0 = time.perf_counter()
    trainer.save("benchmark")
    save_s = time.perf_counter() - t0
    folder = ckpt.list_checkpoints(trainer.checkpointer.ckpt_dir)[-1]
    size_gb = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
    t0 = time.perf_counter()
    ckpt.verify_checkpoint(folder)
    verify_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.checkpointer.load(folder, rollback=True)
    if trainer.d.device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    after = parallel.state_dict()
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if not same:
        failures.append(f"checkpoint: the weights loaded back from {folder} differ from those saved")

    saver.async_save = True
    trainer.state.step += 1  # a folder of its own
    t0 = time.perf_counter()
    trainer.save("benchmark-async")
    stall_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    saver.wait()
    write_s = time.perf_counter() - t0 + stall_s
    return {"size_gb": size_gb, "save_s": save_s, "save_gb_per_s": size_gb / save_s, "verify_s": verify_s,
            "load_s": load_s, "load_bitwise": same, "async_stall_s": stall_s, "async_write_s": write_s,
            "format": "full state, written by rank 0 (safetensors weights + torch.save optimizer)"}, failures


def _losses(out: Path) -> dict[int, float]:
    from kiln.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(out / "run" / "metrics.jsonl") if r["event"] == "step"}


def _last_step(out: Path) -> int:
    path = out / "run" / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(ln).get("step", 0) for ln in path.read_text().splitlines() if '"event": "step"' in ln]
    return max(steps, default=0)


def resume(cfg_path: Path, base_overrides: list[str], work: Path, timeout_s: float,
           total: int) -> tuple[dict, list[str]]:
    """An uninterrupted deterministic run against one killed with SIGKILL and started again."""
    import torch
    from safetensors.torch import load_file

    from kiln.config import load_config
    from kiln.checkpoint import list_checkpoints

    failures: list[str] = []
    runs = {}
    for name in ("uninterrupted", "killed"):
        out = work / name
        for part in ("tokenizer", "shards"):
            shutil.copytree(Path(load_config(cfg_path, base_overrides).out) / part, out / part)
        cfg = load_config(cfg_path, base_overrides + [f"out_dir={out}"])
        path = work / f"{name}.yaml"
        path.write_text(cfg.to_yaml())
        runs[name] = (out, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    def command(path: Path) -> list[str]:
        return [sys.executable, "-m", "kiln", "train", str(path)]
    logs = {}

    def finish(proc: subprocess.Popen, name: str) -> None:
        out, _ = proc.communicate(timeout=timeout_s)
        logs[name] = out.decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{name} exited {proc.returncode}:\n{logs[name][-4000:]}")

    t0 = time.perf_counter()
    finish(subprocess.Popen(command(runs["uninterrupted"][1]), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT), "uninterrupted")
    out, path = runs["killed"]
    proc = subprocess.Popen(command(path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + timeout_s
    while _last_step(out) < KILL_AFTER:
        if proc.poll() is not None:
            raise RuntimeError(f"the run to be killed ended early:\n{proc.stdout.read().decode()[-4000:]}")
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the run to be killed did not reach step {KILL_AFTER} in {timeout_s:.0f} s")
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = _last_step(out)
    finish(subprocess.Popen(command(path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), "restarted")
    want, got = _losses(runs["uninterrupted"][0]), _losses(out)
    differ = [s for s in sorted(want) if got.get(s) != want[s]]
    a, b = (load_file(str(list_checkpoints(o / "run" / "checkpoints")[-1] / "model.safetensors"))
            for o, _ in runs.values())
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    found = re.search(r"resumed from .*?\(step (\d+)\)", " ".join(logs["restarted"].split()))  # rich wraps lines
    resumed_from = int(found.group(1)) if found else None
    if resumed_from is None:
        failures.append("resume: the restarted run did not resume from a checkpoint")
    if differ:
        failures.append(f"resume: losses differ from the uninterrupted run at steps {differ[:10]} "
                        f"(e.g. step {differ[0]}: {got.get(differ[0])!r} vs {want[differ[0]]!r})")
    if not same_weights:
        failures.append("resume: the final weights differ from the uninterrupted run's")
    return {"steps": total, "killed_after_step": killed_at, "resumed_from_step": resumed_from,
            "losses_bitwise": not differ, "weights_bitwise": same_weights, "seconds": time.perf_counter() - t0,
            "overrides": base_overrides}, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE (throughput and checkpoint phases)")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU, a few steps")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 10; smoke 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 4)")
    parser.add_argument("--skip", action="append", default=[], choices=PHASES, help="leave a phase out")
    parser.add_argument("--out", default=None, help="out_dir (default: a temporary folder)")
    parser.add_argument("--report", default="gpu-1b-report", help="folder for report.json and the profile trace")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each resume-phase process may take")
    args = parser.parse_args(argv)

    from kiln.config import load_config
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    warmup = args.warmup or (3 if args.smoke else 10)
    steps = args.steps or (4 if args.smoke else 20)
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    result: dict = {"phases": {}, "failures": []}
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-1b-") as tmp:
        out = Path(args.out or tmp)
        inputs = [str(p if Path(p).is_absolute() else ROOT / p) for p in load_config(args.config).data.inputs]
        base = (SMOKE if args.smoke else []) + [f"data.inputs={json.dumps(inputs)}"]
        total = warmup + steps + 2
        bench = base + BENCH + args.overrides + [
            f"out_dir={out / 'bench'}", f"train.max_steps={total + 1}", "train.log_every=1", "train.eval_every=0",
            f"checkpoint.every={total + 10}", f"train.profile_steps=[{warmup + steps + 1},{warmup + steps + 2}]"]
        cfg = load_config(args.config, bench)
        t0 = time.perf_counter()
        for stage in (run_data_stage, run_tokenizer_stage, run_pack_stage):
            stage(cfg, print)
        result["prepare_s"] = time.perf_counter() - t0

        def phase(name: str, fn) -> object:
            if name in args.skip:
                return None
            t = time.perf_counter()
            try:
                figures, failures = fn()
            except Exception as exc:  # one phase failing must not hide the others' figures
                figures, failures = {"error": f"{type(exc).__name__}: {exc}"}, [f"{name}: {exc}"]
                traceback.print_exc()
            figures["phase_s"] = time.perf_counter() - t
            result["phases"][name], result["failures"] = figures, result["failures"] + failures
            print(f"== {name}: {json.dumps(figures)}", flush=True)
            return figures

        trainer = {}

        def run_throughput():
            figures, trainer["t"] = throughput(cfg, warmup, steps, report)
            return figures, []

        phase("throughput", run_throughput)
        if "checkpoint" not in args.skip and "t" not in trainer:
            result["failures"].append("checkpoint: no trainer (the throughput phase was skipped or failed)")
        elif "t" in trainer:
            phase("checkpoint", lambda: checkpoint(trainer["t"]))
            trainer["t"].checkpointer.wait()
            trainer["t"].loader.close()
            trainer.clear()  # free the 1B model before the resume runs
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        resume_steps = RESUME_STEPS_SMOKE if args.smoke else RESUME_STEPS
        resume_overrides = base + RESUME + (RESUME_SMOKE if args.smoke else []) + [
            f"out_dir={out / 'bench'}", f"train.max_steps={resume_steps}", "train.log_every=1", "train.eval_every=0",
            f"checkpoint.every={CKPT_EVERY}", "train.deterministic=true", "parallel.mode=fsdp"]
        if args.smoke:
            resume_overrides.remove("train.batch_size=8")
            resume_overrides.remove("train.micro_batch_size=4")
        phase("resume", lambda: resume(Path(args.config), resume_overrides, out / "resume", args.timeout, resume_steps))

    (report / "report.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    t = result["phases"].get("throughput") or {}
    if "tokens_per_s" in t:
        mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "not reported"
        print(f"{t['device']}: {t['params'] / 1e9:.2f} B parameters, {t['dtype']}, compile={t['compile']}, "
              f"{t['mode']}: {t['tokens_per_s']:,.0f} tokens/s (median step), MFU {mfu} against {t['peak_source']}")
    for failure in result["failures"]:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
