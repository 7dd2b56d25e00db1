"""Resume is exact for every checkpoint format x data-parallel mode x world-size change (issue 45, item 1).

A multi-rank resume from a full checkpoint used to drop the AdamW state: `optimizer.state_dict()` (keyed by
number) went into `set_optimizer_state_dict`, which expects names, so the saved moments attached to no parameter
and AdamW started again from step 1. The losses of the first resumed step still matched; the next did not.

Each case: an uninterrupted 6-step run on W_a ranks saves at steps 3 and 6; a copy with only step 3 resumes on
W_b ranks. Right after the load the optimizer state (gathered whole by name) must equal the saved one bitwise,
entry for entry (every parameter's step, exp_avg, exp_avg_sq), and steps 4-6 must give the uninterrupted run's
losses: bitwise where W_b = W_a, within float noise where the world size changes (the same maths, summed in
another order). Real torch.distributed processes (gloo) under torchrun.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, torchrun_script
from kiln.checkpoint.sharded import is_sharded, pieces
from test_resilience import ENV, clone, events, write_config

STEPS = 6
# (format, mode saved under, mode resumed under, ranks saved on, ranks resumed on); `auto` is one plain process
# on 1 rank (whose full checkpoints hold `optimizer.state_dict()`) and DDP on 2.
MATRIX = [(fmt, mode, mode, a, b) for fmt in ("full", "sharded") for mode in ("ddp", "fsdp")
          for a, b in ((1, 1), (2, 2), (1, 2), (2, 1))]
MATRIX += [("full", "auto", "fsdp", 1, 2), ("full", "fsdp", "ddp", 2, 2), ("sharded", "auto", "fsdp", 1, 2)]
# In the default suite: the two cases that lost the AdamW state before the fix (full format: DDP 2 -> 2, one
# process -> FSDP2 on 2); the rest of the matrix is slow (`pytest tests/test_resume_matrix.py -m "slow or not slow"`).
DEFAULT = {("full", "ddp", "ddp", 2, 2), ("full", "auto", "fsdp", 1, 2)}

_DRIVE = '''
import sys
import torch
import torch.distributed as dist
from kiln.config import load_config
from kiln.train.parallel import init_distributed, shutdown
from kiln.train.trainer import Trainer

cfg = load_config(sys.argv[1])
d = init_distributed(cfg.parallel.startup_timeout_s, cfg.out / "run")
try:
    trainer = Trainer(cfg, d, log=lambda *_: None)
    trainer.resume()
    model_sd, optim_sd = trainer.engine.parallel.full_states(trainer.engine.optimizer)  # every rank takes part
    if d.is_main:
        torch.save({"step": trainer.step, "optimizer": optim_sd}, sys.argv[2])
    trainer.run()  # resumes the same checkpoint again, and trains to max_steps
finally:
    shutdown()
'''


def _config(path: Path, out: Path, fmt: str, mode: str) -> Path:
    return write_config(path, out, train={"max_steps": STEPS, "eval_every": 0, "log_every": 1},
                        checkpoint={"every": 3, "keep_last": 10, "format": fmt}, parallel={"mode": mode})


def _train(cfg: Path, nproc: int, script: Path | None = None, *args) -> None:
    env = {**ENV, "PYTHONPATH": str(ROOT / "src")}
    if script is None:
        proc = torchrun_script(ROOT / "src" / "kiln" / "__main__.py", "train", cfg, nproc=nproc, env=env)
    else:
        proc = torchrun_script(script, cfg, *args, nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in events(out, "step")}


def saved_optimizer(folder: Path) -> dict[str, torch.Tensor]:
    """{"<parameter>/<entry>": tensor} of a checkpoint's optimizer state, read from its files as they are."""
    if is_sharded(folder):
        with pieces(folder, "optimizer") as p:
            return {k: p.full(k) for k in p.keys()}
    state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)["state"]
    return {f"{name}/{k}": v for name, entries in state.items() for k, v in entries.items()}


@pytest.fixture(scope="module")
def uninterrupted(prepared, tmp_path_factory):
    """(format, mode, world) -> the out_dir of an uninterrupted 6-step run, made when first asked for."""
    made: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("uninterrupted")

    def get(fmt: str, mode: str, world: int) -> Path:
        key = (fmt, mode, world)
        if key not in made:
            out = root / "-".join(map(str, key))
            for name in ("tokenizer", "shards"):
                shutil.copytree(prepared.out / name, out / name)
            _train(_config(root / f"{'-'.join(map(str, key))}.yaml", out, fmt, mode), world)
            made[key] = out
        return made[key]

    return get


def _marks(case):
    return () if case in DEFAULT else (pytest.mark.slow,)


def _id(case) -> str:
    fmt, saved, resumed, a, b = case
    return f"{fmt}-{saved}{a}-to-{resumed}{b}"


@pytest.mark.parametrize("fmt,saved_mode,mode,before,after",
                         [pytest.param(*c, marks=_marks(c), id=_id(c)) for c in MATRIX])
def test_resume_keeps_the_optimizer_state_and_the_losses(uninterrupted, tmp_path, fmt, saved_mode, mode, before,
                                                          after):
    reference = uninterrupted(fmt, saved_mode, before)
    out = clone(reference, tmp_path / "out")
    shutil.rmtree(out / "run" / "checkpoints" / f"step-{STEPS:08d}")
    folder = out / "run" / "checkpoints" / "step-00000003"
    assert is_sharded(folder) == (fmt == "sharded")
    script = tmp_path / "drive.py"
    script.write_text(_DRIVE)
    _train(_config(tmp_path / "c.yaml", out, fmt, mode), after, script, tmp_path / "loaded.pt")

    # The optimizer state right after the load is the saved one: every entry, bitwise, and nothing else.
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["step"] == 3
    flat = {f"{name}/{k}": v for name, entries in loaded["optimizer"]["state"].items() for k, v in entries.items()}
    saved = saved_optimizer(folder)
    assert sorted(flat) == sorted(saved)
    assert len(loaded["optimizer"]["state"]) == len({k.rsplit("/", 1)[0] for k in saved})
    for key, value in saved.items():
        assert torch.equal(flat[key].float(), value.float()), key
    assert all(float(v) == 3 for k, v in flat.items() if k.endswith("/step"))

    # Steps 4-6 continue the uninterrupted run: bitwise on the same world size, within float noise on another.
    mine, theirs = _losses(out), _losses(reference)
    assert [s for s in mine if s > 3] == [4, 5, 6]
    for step in (4, 5, 6):
        if (saved_mode, before) == (mode, after):
            assert mine[step] == theirs[step], (step, mine[step], theirs[step])
        else:
            assert mine[step] == pytest.approx(theirs[step], rel=2e-5, abs=2e-5), step


def test_a_checkpoint_keyed_by_number_from_an_older_kiln_resumes_by_name(workdir):
    """Full checkpoints written before the fix hold `optimizer.state_dict()` (keyed by number): loading one on a
    layout that loads by name converts it, and the AdamW state is the saved one."""
    from kiln.model.build import build_model
    from kiln.train.engine import build_optimizer
    from kiln.train.parallel.optimizer_state import by_name, by_number, optimizer_names
    from conftest import tiny_config

    cfg = tiny_config(workdir)
    model = build_model(cfg.model, 1024, cfg.pack.seq_len, None)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    model(torch.randint(0, 1024, (2, 8))).float().pow(2).mean().backward()
    optimizer.step()
    numbered = optimizer.state_dict()
    named = by_name(numbered, model, optimizer)

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    torchs = get_optimizer_state_dict(model, optimizer)
    assert [g["params"] for g in named["param_groups"]] == [g["params"] for g in torchs["param_groups"]]
    assert sorted(named["state"]) == sorted(torchs["state"]) == sorted(optimizer_names(model, optimizer))
    back = by_number(named, model, optimizer)
    assert back["param_groups"] == numbered["param_groups"]
    for i, entries in numbered["state"].items():
        assert all(torch.equal(back["state"][i][k], v) for k, v in entries.items())

    fresh_model = build_model(cfg.model, 1024, cfg.pack.seq_len, None)
    fresh = build_optimizer(fresh_model, cfg.train, torch.device("cpu"))
    with pytest.raises(Exception, match="another model"):
        by_number({**named, "state": {"nope": {}, **named["state"]}}, fresh_model, fresh)

