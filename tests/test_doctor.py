"""`kiln doctor`: passes on this machine with every probe run for real (loader on real shards, matmul, a gloo
all-reduce over 2 spawned processes); fails with a verdict and a fix when a check is broken on purpose.
The NVIDIA checks cannot run here (no GPU): their verdict logic is tested with a fake NVML module."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config
from kiln.cli import main as kiln
from kiln import env
from kiln.config import load_config
from kiln.env import compare, fingerprint
from kiln.ops.doctor import check_disk, check_env
from kiln.ops.nvml import gpu_checks

FAST = ["doctor.probe_seconds=0.2", "doctor.allreduce_small_bytes=4096", "doctor.allreduce_large_bytes=1048576"]


@pytest.fixture
def config(prepared, tmp_path):
    out = tmp_path / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    path = tmp_path / "c.yaml"
    path.write_text(tiny_config(out).to_yaml())
    return path


@pytest.fixture
def trained_run(config):
    """The run folder of 2 real training steps on the config: its env.json is what the trainer writes."""
    from kiln.train.trainer import Trainer

    cfg = load_config(config, ["train.max_steps=2", "train.eval_every=0"])
    Trainer(cfg, log=lambda *_: None).run()
    return cfg.out / "run"


def doctor_json(capsys, *args) -> tuple[int, dict]:
    rc = kiln(["doctor", "--json", *args, *FAST])
    return rc, json.loads(capsys.readouterr().out)


def test_doctor_passes_here_with_every_probe_measured(config, monkeypatch, capsys):
    for var in ("NCCL_P2P_DISABLE", "NCCL_DEBUG", "CUDA_LAUNCH_BLOCKING"):
        monkeypatch.delenv(var, raising=False)
    rc, report = doctor_json(capsys, "--config", str(config))
    checks = {c["name"]: c for c in report["checks"]}
    assert rc == 0 and report["ok"], [c for c in report["checks"] if not c["ok"]]
    for name in (
        "python",
        "torch",
        "cuda",
        "language_id",
        "disk",
        "shm",
        "open_files",
        "env",
        "matmul",
        "loader",
        "allreduce",
    ):
        assert checks[name]["verdict"] == "ok", checks[name]
    assert checks["gpu"]["verdict"] == "skip"  # no NVML here
    assert "peak unknown" in checks["matmul"]["detail"]  # a CPU: measured, not judged against a guess
    assert "tokens/s from" in checks["loader"]["detail"]
    assert "gloo over 2 processes" in checks["allreduce"]["detail"]
    fp = report["fingerprint"]
    assert fp == {**fingerprint(), "ram_gb": fp["ram_gb"]} and fp["torch"].startswith("2.")


def test_doctor_fails_usefully_when_checks_are_broken_on_purpose(config, trained_run, monkeypatch, capsys):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")  # a leftover from debugging
    recorded = json.loads((trained_run / "env.json").read_text())  # as the trainer wrote it
    (trained_run / "env.json").write_text(json.dumps({**recorded, "torch": "2.0.0", "ram_gb": 1.0}))
    rc, report = doctor_json(capsys, "--config", str(config), "--against", str(trained_run),
                             "doctor.min_free_disk_gb=1e9")  # more than any disk here
    bad = {c["name"]: c for c in report["checks"] if not c["ok"]}
    assert rc == 1 and set(bad) == {"env", "disk", "against_run"}, bad
    assert (
        "NCCL_P2P_DISABLE=1" in bad["env"]["detail"]
        and bad["env"]["fix"] == "unset NCCL_P2P_DISABLE (set them only while debugging)"
    )
    assert "need 1e+09" in bad["disk"]["detail"] and "doctor.min_free_disk_gb" in bad["disk"]["fix"]
    assert "torch: 2.0.0 -> " in bad["against_run"]["detail"] and "(torch)" in bad["against_run"]["fix"]
    assert {d["key"]: d["pinned"] for d in report["against"]} == {"torch": True, "ram_gb": False}


def test_env_check_names_each_harmful_setting():
    assert check_env({"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}).ok
    c = check_env({"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Tree", "CUDA_LAUNCH_BLOCKING": "1"})
    assert not c.ok and c.fix.startswith("unset NCCL_DEBUG NCCL_ALGO CUDA_LAUNCH_BLOCKING")


def test_disk_check_measures_the_filesystem_the_out_dir_will_be_on(tmp_path):
    c = check_disk(tmp_path / "not" / "yet", need_gb=0.001)
    assert c.ok and f"at {tmp_path}" in c.detail


def test_against_reports_a_driver_change_in_the_env_json_the_trainer_wrote(trained_run, capsys):
    recorded = json.loads((trained_run / "env.json").read_text())
    assert set(env.PINNED) <= set(recorded) and recorded == {**fingerprint(), "ram_gb": recorded["ram_gb"]}
    (trained_run / "env.json").write_text(json.dumps({**recorded, "driver": "535.54.03"}))
    rc, report = doctor_json(capsys, "--against", str(trained_run.parent))  # an out_dir finds run/env.json
    bad = {c["name"]: c for c in report["checks"] if not c["ok"]}
    assert rc == 1 and "against_run" in bad and "(driver)" in bad["against_run"]["fix"]
    assert f"driver: 535.54.03 -> {recorded['driver']}" in bad["against_run"]["detail"]
    assert report["against"] == [{"key": "driver", "recorded": "535.54.03", "now": recorded["driver"], "pinned": True}]


def test_a_resume_judges_by_the_same_pinned_list_as_the_doctor():
    now = {**fingerprint(), "driver": "550.54.15"}
    recorded = {**now, "driver": "535.54.03", "os": "Linux-other", "layout": {"world_size": 2}}
    assert env.resume_mismatches(recorded, now) == {"driver": ("535.54.03", "550.54.15")}  # os, layout: reported only
    assert [d["key"] for d in compare(recorded, now) if d["pinned"]] == ["driver"]
    older = {k: v for k, v in now.items() if k != "driver"}  # a record from before the driver was recorded
    assert env.resume_mismatches(older, now) == {}


def test_against_compares_gpu_names_as_the_trainer_records_them():
    now = {"torch": "2.13.0", "gpus": [{"name": "NVIDIA H100", "memory_gb": 79.6}], "os": "Linux"}
    assert compare({"torch": "2.13.0", "gpus": ["NVIDIA H100"]}, now) == []
    assert compare({"gpus": ["NVIDIA A100"]}, now) == [
        {"key": "gpus", "recorded": ["NVIDIA A100"], "now": ["NVIDIA H100"], "pinned": True}]


# --- NVIDIA checks, with a fake NVML (no GPU on this machine) -------------------------------------

class FakeNVML:
    """The pynvml calls and constants gpu_checks uses; one healthy H100-like GPU unless changed."""
    NVMLError = type("NVMLError", (Exception,), {})
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
    NVML_TEMPERATURE_GPU, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, NVML_CLOCK_SM = 0, 1, 1
    NVML_NVLINK_MAX_LINKS, NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED = 18, 0, 1

    def __init__(self, **state):
        self.s = {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16, "pstate": 0, "ecc": (0, 3), "temp": 60,
                  "slowdown": 90, "reasons": 0, "sm": 1980, "links": [1] * 18} | state

    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return self.s["gen"]
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return self.s["max_gen"]
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return self.s["width"]
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return self.s["max_width"]
    def nvmlDeviceGetPerformanceState(self, h): return self.s["pstate"]
    def nvmlDeviceGetTemperature(self, h, sensor): return self.s["temp"]
    def nvmlDeviceGetTemperatureThreshold(self, h, kind): return self.s["slowdown"]
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return self.s["reasons"]
    def nvmlDeviceGetClockInfo(self, h, kind): return self.s["sm"]
    def nvmlDeviceGetMaxClockInfo(self, h, kind): return 1980

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self.s["ecc"][0] if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else self.s["ecc"][1]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.s["links"]):
            raise self.NVMLError("not supported")
        return self.s["links"][link]


def verdicts(nvml) -> dict[str, bool]:
    return {c.name.removeprefix("gpu0_"): c.ok for c in gpu_checks(nvml)}


@pytest.mark.parametrize("state, failing", [
    ({}, set()),
    ({"width": 8}, {"pcie"}),                       # trained at x8 in an x16 slot
    ({"gen": 3}, {"pcie"}),                         # busy (P0) but below its generation
    ({"gen": 1, "pstate": 8}, set()),               # idle GPUs lower the link to save power
    ({"ecc": (2, 0)}, {"ecc"}),
    ({"temp": 87}, {"temperature"}),                # within 5 °C of slowdown
    ({"reasons": 0x40, "sm": 1100}, {"clocks"}),    # HW thermal slowdown
    ({"reasons": 0x04}, set()),                     # software power cap: normal at full load
    ({"links": [1] * 17 + [0]}, {"nvlink"}),        # one NVLink down
    ({"links": []}, set()),                         # no NVLink at all (PCIe card)
])
def test_gpu_checks_fail_on_degraded_links_errors_heat_and_throttling(state, failing):
    v = verdicts(FakeNVML(**state))
    assert set(v) == {"pcie", "ecc", "temperature", "clocks", "nvlink"}
    assert {name for name, ok in v.items() if not ok} == failing


def test_gpu_check_details_and_fixes_say_what_to_do():
    checks = {c.name: c for c in gpu_checks(FakeNVML(width=8, reasons=0x08, sm=900))}
    assert checks["gpu0_pcie"].detail.startswith("gen 5/5, x8/x16") and "reseat" in checks["gpu0_pcie"].fix
    assert "SM clock 900/1980 MHz; throttled: HW slowdown" in checks["gpu0_clocks"].detail


def test_allreduce_is_skipped_not_failed_with_one_gpu(monkeypatch):
    # No GPU here: torch is told one is visible (mocked). One process has no peer, so its bandwidth would read 0.
    import torch

    from kiln.config import DoctorConfig
    from kiln.ops.doctor import check_allreduce

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    [check] = check_allreduce(DoctorConfig())
    assert check.skipped and check.ok and "needs at least 2" in check.detail


# --- the all-reduce probe across a torchrun group (nodes too) -----------------------------------

@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_allreduce_probe_across_the_torchrun_group_on_two_gloo_processes(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "kiln", "doctor", "--allreduce", "--json", *FAST],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # rank 0 alone prints
    [check] = report["checks"]
    assert report["ok"] and check["name"] == "allreduce_group" and check["verdict"] == "ok"
    assert check["detail"].startswith(f"gloo over 2 ranks on 1 host(s) ({os.uname().nodename}): ")
    assert "GB/s at 4,096 bytes" in check["detail"] and "GB/s at 1,048,576 bytes" in check["detail"]


def test_allreduce_probe_outside_torchrun_says_how_to_launch_it(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert kiln(["doctor", "--allreduce"]) != 0
    err = capsys.readouterr().err
    assert "torchrun --nnodes=N" in err and "-m kiln doctor --allreduce" in err
