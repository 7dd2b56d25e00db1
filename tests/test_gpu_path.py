"""The GPU and multi-node path, shown where a CPU can show it: real 2-rank gloo groups (torchrun) for the
budget stop, the checkpoint the ranks resume from, the data they train on and fp16 under FSDP2; the CUDA
calls that cannot run here (device choice, CUDA RNG) against fakes of torch.cuda, said so in each test.
What only a GPU run confirms is named in a comment at each fix (src/kiln/train/*)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_config
from kiln.errors import KilnError
from kiln.manifest import read_manifest, write_manifest
from kiln import checkpoint as ckpt
from kiln.train.parallel import dist as parallel  # the process group: Dist, init_distributed, torch's dist
from kiln.train.parallel.parallelize import apply_activation_checkpointing
from kiln.train.metrics import read_metrics
from kiln.train.trainer import Trainer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# Each rank writes its result to a file of its own: two ranks printing to one pipe can interleave a line.
EMIT = r"""
import json as _json, os as _os
def emit(record):
    with open(_os.path.join(_os.environ["KILN_TEST_OUT"], f"rank{_os.environ['RANK']}.json"), "w") as f:
        f.write(_json.dumps(record))
"""


def torchrun(script: str, tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    path, results = tmp_path / "script.py", tmp_path / "ranks"
    path.write_text(EMIT + script)
    results.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(path), *args], env={**ENV, "KILN_TEST_OUT": str(results)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def rank_lines(proc: subprocess.CompletedProcess) -> dict[int, dict]:
    """What each rank emitted, by rank."""
    results = Path(proc.args[proc.args.index("--nproc_per_node=2") + 1]).parent / "ranks"
    return {int(f.stem.removeprefix("rank")): json.loads(f.read_text()) for f in sorted(results.glob("rank*.json"))}


def steps(out: Path) -> list[dict]:
    return [m for m in read_metrics(out / "run" / "metrics.jsonl") if m["event"] == "step"]


# --- 1. the budget stop is agreed ---------------------------------------------------------------

_BUDGET = r"""
import json, os, sys
from kiln.config import load_config
from kiln.train.trainer import Trainer

trainer = Trainer(load_config(sys.argv[1]), log=print)
if trainer.d.rank == 1:  # this rank's clock says the budget is all but spent; rank 0's has hours left
    trainer.budget.device_hours = trainer.budget.cfg.device_hours * (1 - 1e-9)
summary = trainer.run()
emit({"rank": trainer.d.rank, "steps": summary["steps"], "stopped": summary["stopped"]})
"""


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_budget_that_runs_out_on_one_rank_first_stops_both_at_the_same_step(workdir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_config(workdir, train={"max_steps": 40, "eval_every": 0},
                               budget={"device_hours": 10.0}).to_yaml())
    proc = torchrun(_BUDGET, tmp_path, str(cfg), timeout=180)  # before the fix: a hang (save vs next step)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = rank_lines(proc)
    assert ranks[0] == {"rank": 0, "steps": ranks[1]["steps"], "stopped": "budget exhausted"}
    assert ranks[1]["stopped"] == "budget exhausted" and 1 < ranks[0]["steps"] < 40
    assert ckpt.list_checkpoints(workdir / "run" / "checkpoints")[-1].name == f"step-{ranks[0]['steps']:08d}"


# --- 2. the ranks agree on the checkpoint and on their inputs -----------------------------------

_PER_RANK = r"""
import json, os, sys
from kiln.config import load_config
from kiln.errors import KilnError
from kiln.train.trainer import Trainer

# Each rank reads its own out_dir, as node-local disks would give it.
rank = int(os.environ["RANK"])
try:
    trainer = Trainer(load_config(sys.argv[1 + rank]), log=print)
    resume, resumed = trainer.resume, []
    trainer.resume = lambda: (resume(), resumed.append(trainer.step))[0]
    summary = trainer.run()
    emit({"rank": rank, "steps": summary["steps"], "resumed_at": resumed[0]})
except KilnError as exc:
    emit({"rank": rank, "error": str(exc)})
    sys.exit(2)
"""


@pytest.fixture(scope="module")
def ten_steps(prepared, tmp_path_factory) -> Path:
    """An out_dir holding a run of 10 steps with checkpoints at 5 and 10 (read-only: tests copy it)."""
    out = tmp_path_factory.mktemp("ten") / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    Trainer(tiny_config(out, train={"max_steps": 10, "eval_every": 0}), log=lambda *_: None).run()
    return out


def _two_views(run: Path, tmp_path: Path, **train) -> tuple[Path, Path, Path, Path]:
    """Out dirs for rank 0 and rank 1, each a copy of the same run (`ten_steps`), and their configs."""
    view0, view1 = tmp_path / "node0", tmp_path / "node1"
    shutil.copytree(run, view0)
    shutil.copytree(run, view1)
    configs = []
    for view in (view0, view1):
        path = tmp_path / f"{view.name}.yaml"
        path.write_text(tiny_config(view, train={"max_steps": 12, "eval_every": 0, **train}).to_yaml())
        configs.append(path)
    return view0, view1, *configs


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_ranks_resume_from_the_checkpoint_every_rank_can_read(ten_steps, tmp_path):
    view0, view1, cfg0, cfg1 = _two_views(ten_steps, tmp_path)
    newest = view1 / "run" / "checkpoints" / "step-00000010"
    (newest / "rng.pt").write_bytes(b"truncated by a lagging copy")  # corrupt on rank 1's view only
    proc = torchrun(_PER_RANK, tmp_path, str(cfg0), str(cfg1))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "skipping step-00000010: rank 1 on host" in proc.stdout and "rng.pt" in proc.stdout
    # Both from step 5 (rank 0 alone would have taken 10, rank 1 alone 5): the run re-did steps 6-12.
    assert rank_lines(proc) == {r: {"rank": r, "steps": 12, "resumed_at": 5} for r in (0, 1)}
    assert [s["step"] for s in steps(view0)] == list(range(1, 13))


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_a_rank_that_cannot_read_the_weights_still_resumes_from_the_newest(ten_steps, tmp_path):
    _, view1, cfg0, cfg1 = _two_views(ten_steps, tmp_path)
    # Rank 0 alone reads the weights and broadcasts them: rank 1's copy is never read.
    (view1 / "run" / "checkpoints" / "step-00000010" / "model.safetensors").write_bytes(b"not weights")
    proc = torchrun(_PER_RANK, tmp_path, str(cfg0), str(cfg1))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert rank_lines(proc) == {r: {"rank": r, "steps": 12, "resumed_at": 10} for r in (0, 1)}


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_ranks_with_different_shards_stop_naming_the_rank(ten_steps, tmp_path):
    _, view1, cfg0, cfg1 = _two_views(ten_steps, tmp_path)
    manifest = view1 / "shards" / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=4))  # same shards, other bytes
    proc = torchrun(_PER_RANK, tmp_path, str(cfg0), str(cfg1))
    assert proc.returncode != 0
    ranks = rank_lines(proc)
    assert set(ranks) == {0, 1}, proc.stderr[-3000:]  # every rank stops with the message, none hangs
    for rec in ranks.values():
        assert "rank 1 on host" in rec["error"] and "another data" in rec["error"], rec
        assert "tokenizer" not in rec["error"].split(";")[0]


# --- 3. the watchdog gives the first step the start-up timeout ----------------------------------

def test_watchdog_judges_a_rank_by_the_startup_timeout_until_its_first_step(tmp_path):
    from kiln.config import WatchdogConfig
    from kiln.train.parts.watchdog import Watchdog

    dog = Watchdog(parallel.Dist(), WatchdogConfig(stall_timeout_s=300), tmp_path, startup_timeout_s=1800)
    dog.beat(7)  # resumed at step 7; the resume's eval and save beat at the same step
    dog.first_step = 7
    assert not dog.warm and dog.timeout_for({"warm": dog.warm}) == 1800
    dog.beat(8)
    assert dog.warm and dog.timeout_for({"warm": dog.warm}) == 300


# --- 4. CUDA RNG: this rank's device only -------------------------------------------------------

class FakeCudaRng:
    """torch.cuda's RNG calls for a machine with `visible` GPUs (there is no GPU here)."""

    def __init__(self, visible: int) -> None:
        self.visible, self.states, self.set_calls = visible, {}, []

    def get_rng_state(self, device):
        assert device.index < self.visible
        return torch.tensor([device.index, 42], dtype=torch.uint8)

    def set_rng_state(self, state, device):
        if device.index >= self.visible:
            raise IndexError(f"device {device.index} of {self.visible}")
        self.set_calls.append((device.index, state.tolist()))


def test_rng_state_holds_this_ranks_device_and_restores_where_fewer_gpus_are_visible(monkeypatch):
    saved_on = FakeCudaRng(visible=8)  # rank 3 of a node that showed every process all 8 GPUs
    monkeypatch.setattr(torch.cuda, "get_rng_state", saved_on.get_rng_state)
    state = ckpt.rng_state(torch.device("cuda", 3))
    assert state["cuda"].tolist() == [3, 42]  # one device's state, not eight
    resumed_on = FakeCudaRng(visible=1)  # the launcher now shows each process only its own GPU
    monkeypatch.setattr(torch.cuda, "set_rng_state", resumed_on.set_rng_state)
    ckpt.restore_rng(state, torch.device("cuda", 0))
    assert resumed_on.set_calls == [(0, [3, 42])]
    old_format = {**state, "cuda": [torch.tensor([i, 1], dtype=torch.uint8) for i in range(8)]}
    ckpt.restore_rng(old_format, torch.device("cuda", 0))  # checkpoints written before: every device's
    assert resumed_on.set_calls[-1] == (0, [0, 1])


def test_cpu_rng_state_round_trips_exactly():
    import random

    import numpy as np

    torch.manual_seed(3)
    state = ckpt.rng_state(torch.device("cpu"))
    assert state["cuda"] is None
    drawn = (random.random(), float(np.random.rand()), torch.rand(4).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.restore_rng(state, torch.device("cpu"))
    assert (random.random(), float(np.random.rand()), torch.rand(4).tolist()) == drawn


# --- 5. fp16 under FSDP2: an overflow on one rank's shard skips the step on every rank -------------

_FP16 = r"""
import json, sys
import torch
from kiln.config import load_config
from kiln.train.trainer import Trainer

trainer = Trainer(load_config(sys.argv[1]), log=lambda *_: None)
measured = trainer.engine.train_step(trainer.loader.next_batch())
params = [p for p in trainer.model.parameters() if p.grad is not None and p.grad.to_local().numel()]
if trainer.d.rank == 1:  # an overflow in one element of rank 1's shard only
    params[0].grad.to_local().view(-1)[0] = float("inf")
before = [p.detach().to_local().clone() for p in trainer.model.parameters()]
scaler = trainer.engine.scaling.scaler
scale = scaler.get_scale()
result = trainer.engine.optimizer_step(1, 1e-3, measured["loss"])
moved = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, trainer.model.parameters()))
emit({"rank": trainer.d.rank, "moved": moved, "scale": [scale, scaler.get_scale()],
      "reason": result["skip_reason"]})
"""


@pytest.mark.slow  # two gloo ranks, 6-10 s: the default suite stays under 10 minutes on 2 cores
def test_fp16_overflow_on_one_ranks_shard_skips_the_step_on_every_rank(workdir, tmp_path):
    cfg = tmp_path / "fp16.yaml"
    cfg.write_text(tiny_config(workdir, train={"dtype": "fp16"}, parallel={"mode": "fsdp"}).to_yaml())
    proc = torchrun(_FP16, tmp_path, str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = rank_lines(proc)
    # Rank 0's shard is finite: it must skip because rank 1 overflowed (DTensor dispatch reduces found_inf).
    for rank in (0, 1):
        assert ranks[rank]["moved"] is False and ranks[rank]["reason"] == "fp16_overflow", ranks
        assert ranks[rank]["scale"] == [65536.0, 32768.0]


# --- 6. masked GPUs: the device a process uses ----------------------------------------------------

def test_each_process_sees_only_its_own_gpu_uses_device_0():
    assert parallel.local_device_index(3, visible=1) == 0  # srun --gpus-per-task=1, Kubernetes
    assert parallel.local_device_index(3, visible=8) == 3  # every GPU of the node visible
    with pytest.raises(KilnError, match="LOCAL_RANK=8 but this process sees 8 GPUs"):
        parallel.local_device_index(8, visible=8)


def test_init_distributed_binds_the_process_group_to_the_chosen_gpu(monkeypatch, tmp_path):
    # No GPU here: torch.cuda and the process group are fakes; the code under test is init_distributed.
    calls = {}
    launcher = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel, "attempt_store", lambda *a: "store")
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    d = parallel.init_distributed(60, tmp_path / "run")
    assert d.device == torch.device("cuda", 0) and calls["set_device"] == torch.device("cuda", 0)
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 0) and d.rank == 3
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "run" / "nccl-trace-rank")


# --- 8. MoE + activation checkpointing compiles in one graph ------------------------------------

@pytest.mark.slow  # compiles a model, ~6 s: the default suite stays under 10 minutes on 2 cores
def test_compiled_moe_model_under_activation_checkpointing_has_no_graph_break(monkeypatch):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from kiln.model.config import ModelConfig, MoEConfig
    from kiln.model.llama import Llama
    from kiln.model.loss import next_token_loss

    monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", False)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, moe=MoEConfig(n_experts=4, top_k=2)),
                  vocab_size=128, max_seq_len=16)
    apply_activation_checkpointing(model)
    backend = CompileCounterWithBackend("aot_eager")
    loss = torch.compile(next_token_loss, backend=backend)(model, torch.randint(0, 128, (2, 17)), None, None)
    loss.backward()
    assert backend.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert model.moe_losses()["routed_tokens"] == 2 * 16 * 2 * 2  # the stats still reach the trainer
    torch._dynamo.reset()


# --- 14. one host sync a step ---------------------------------------------------------------------

def _count_host_syncs(monkeypatch) -> list[str]:
    """Every Tensor -> Python number conversion (a device->host sync on a GPU), by kind."""
    seen: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            seen.append(_name)
            return _original(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_training_step_syncs_the_host_once_whatever_the_micro_batches(workdir, monkeypatch, moe):
    model = {"moe": {"n_experts": 4, "top_k": 2}} if moe else {}
    trainer = Trainer(tiny_config(workdir, train={"micro_batch_size": 2}, **({"model": model} if moe else {})),
                      log=lambda *_: None)
    trainer.loader.next_batch()  # the loader's first batch outside the count (start-up)
    seen = _count_host_syncs(monkeypatch)
    measured = trainer.engine.train_step(trainer.loader.next_batch())  # 4 micro-batches of 2
    assert seen == ["tolist"], seen
    if moe:
        assert measured["moe/routed_tokens"] == 4 * 2 * 64 * 2 * 2  # micro-batches x rows x tokens x top_k x layers
        assert isinstance(measured["moe/dropped_tokens"], int)
    seen.clear()
    result = trainer.engine.optimizer_step(1, 1e-3, measured["loss"], measure_update=True)
    with_ratio = len(seen)
    trainer.engine.train_step(trainer.loader.next_batch())
    seen.clear()
    trainer.engine.optimizer_step(2, 1e-3, measured["loss"], measure_update=False)
    assert with_ratio - len(seen) == 1  # the update ratio: one sync for every parameter tensor together
    assert result["update_to_weight"] > 0


def test_update_ratio_equals_its_definition():
    from kiln.train.engine import update_ratio

    before = [torch.randn(3, 4), torch.randn(5)]
    after = [b + 0.01 * torch.randn_like(b) for b in before]
    want = (sum(float((a - b).pow(2).sum()) for a, b in zip(after, before))
            / sum(float(b.pow(2).sum()) for b in before)) ** 0.5
    assert update_ratio(before, after, sum_shards_=lambda sums: sums) == pytest.approx(want, rel=1e-6)


# --- 17. deterministic mode and the layout it records ---------------------------------------------

@pytest.fixture
def restore_determinism(monkeypatch):
    import torch._inductor.config as inductor

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, inductor.deterministic)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, inductor.deterministic = before[1:]


def test_deterministic_flag_sets_the_kernels_and_records_the_layout(workdir, restore_determinism):
    import torch._inductor.config as inductor

    trainer = Trainer(tiny_config(workdir, train={"max_steps": 5, "deterministic": True}), log=lambda *_: None)
    assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.deterministic
    trainer.run()
    folder = ckpt.list_checkpoints(workdir / "run" / "checkpoints")[-1]
    manifest = read_manifest(folder)
    assert manifest["env"]["layout"] == {"deterministic": True, "world_size": 1, "local_world_size": 1, "device": "cpu"}
    manifest["env"]["layout"]["world_size"] = 8  # as if written by 8 ranks
    write_manifest(folder, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")})
    messages: list[str] = []
    Trainer(tiny_config(workdir, train={"max_steps": 6, "deterministic": True}), log=messages.append).run()
    warned = [m for m in messages if "another layout" in m]
    assert len(warned) == 1 and "world_size: 8 -> 1" in warned[0] and "not be bitwise" in warned[0]


def test_a_run_that_was_not_deterministic_resumes_on_another_layout_without_a_warning(workdir):
    Trainer(tiny_config(workdir, train={"max_steps": 5}), log=lambda *_: None).run()
    folder = ckpt.list_checkpoints(workdir / "run" / "checkpoints")[-1]
    manifest = read_manifest(folder)
    assert manifest["env"]["layout"]["deterministic"] is False
    manifest["env"]["layout"]["world_size"] = 8
    write_manifest(folder, **{k: v for k, v in manifest.items() if k not in ("files", "kiln_version")})
    messages: list[str] = []
    Trainer(tiny_config(workdir, train={"max_steps": 6}), log=messages.append).run()
    assert not [m for m in messages if "another layout" in m]


# --- 15. Python's collector: off in the loop, collected at the same steps on every rank -----------

def test_garbage_collector_is_off_in_the_loop_and_collects_every_n_steps(workdir, monkeypatch):
    import gc

    trainer = Trainer(tiny_config(workdir, train={"max_steps": 6, "gc_every": 3}), log=lambda *_: None)
    enabled, collected = [], []
    step = trainer.engine.optimizer_step
    monkeypatch.setattr(trainer.engine, "optimizer_step", lambda *a: (enabled.append(gc.isenabled()), step(*a))[1])
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: (collected.append((trainer.step, generation)),
                                                             collect(generation))[1])
    assert gc.isenabled()
    trainer.run()
    assert enabled == [False] * 6 and gc.isenabled()  # back on after the loop
    assert collected == [(3, 1), (6, 1)]
