"""Sharded checkpoints (checkpoint.format: sharded): each rank's own pieces, verified, signed, resumed on another
world size and mesh, read without pickle, exported one tensor at a time.

Every run here is real torch.distributed on gloo (2 CPU ranks under torchrun). A GPU run would add: NCCL as the
training group beside the checkpoint's gloo group, pinned-memory snapshots of CUDA shards for async saves, and
HSDP's replicated mesh dimension on several nodes (only the replica at coordinate 0 writes).
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.errors import IntegrityError
from kiln.manifest import read_manifest, write_manifest
from kiln.checkpoint import checkpoint_table, latest_valid, list_checkpoints, load_checkpoint, verify_checkpoint
from kiln.checkpoint.storage import Piece, PieceIndex, write_index, write_pieces, write_safetensors
from kiln.train.trainer import Trainer
from test_resilience import ENV, _keypair, clone, events, finish, launch, losses, write_config

QUIET = lambda *_: None  # noqa: E731


# --- the storage layer ---------------------------------------------------------------------------

def _split(folder: Path, full: torch.Tensor, rows: list[int], cols: list[int]) -> list[str]:
    """Write `full` as a grid of pieces (row and column boundaries), one file and index per piece."""
    names = []
    for i, (r0, r1) in enumerate(zip(rows, rows[1:])):
        for j, (c0, c1) in enumerate(zip(cols, cols[1:])):
            rank = i * (len(cols) - 1) + j
            file = f"model-{rank:05d}.safetensors"
            write_pieces(folder / file, {"w": full[r0:r1, c0:c1].clone()})
            write_index(folder / f"index-{rank:05d}.json",
                        {"model": {"w": Piece(file, (r0, c0), (r1 - r0, c1 - c0), tuple(full.shape), "float32")}})
            names.append(f"index-{rank:05d}.json")
    write_manifest(folder)  # PieceIndex reads only files a manifest lists (kiln.names)
    return names


def test_pieces_of_one_layout_assemble_any_other_box(tmp_path):
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    names = _split(tmp_path, full, rows=[0, 3, 5, 7], cols=[0, 4, 6])  # 3 x 2 uneven pieces
    with PieceIndex(tmp_path, names, "model") as p:
        p.check_complete()
        p.check_files()
        assert torch.equal(p.full("w"), full)
        for offsets, shape in [((0, 0), (4, 6)), ((4, 0), (3, 6)), ((2, 1), (4, 4)), ((6, 5), (1, 1))]:
            out = p.read_box("w", torch.empty(shape), offsets)  # another world size's shard
            assert torch.equal(out, full[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]])
        with pytest.raises(IntegrityError, match="another size"):
            p.read_box("w", torch.empty(8, 6))
    with PieceIndex(tmp_path, names[:-1], "model") as p:  # one piece's index missing: a gap
        with pytest.raises(IntegrityError, match="cover"):
            p.check_complete()
        with pytest.raises(IntegrityError, match="incomplete"):
            p.full("w")
    with PieceIndex(tmp_path, names + names[:1], "model") as p:  # one piece listed twice
        with pytest.raises(IntegrityError, match="exactly once"):
            p.check_complete()


def test_the_streaming_writer_writes_what_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int64), "c": torch.randn(2, 2).bfloat16(),
               "scalar": torch.tensor(3.0), "empty": torch.empty(0, 4)}
    served = []

    def tensor_for(name):
        served.append(name)
        return tensors[name]

    names = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", names, tensor_for, metadata={"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert served == list(tensors)  # each asked for once, in order: one tensor in memory at a time
    with pytest.raises(ValueError, match="header says"):
        write_safetensors(tmp_path / "y.safetensors", [("a", torch.float32, (5, 3))], tensors.__getitem__)


# --- one process -------------------------------------------------------------------------------

def _fresh_out(prepared, tmp_path_factory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "out"
    for part in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / part, out / part)
    return out


@pytest.fixture(scope="module")
def one_process_run(prepared, tmp_path_factory):
    """A single-process run with checkpoint.format=sharded, signed, checkpoints every 4 steps to 12 with
    keep_last=2 (tests restore what they change). Returns (out_dir, the trainer, the public key)."""
    out = _fresh_out(prepared, tmp_path_factory, "one")
    priv, pub = _keypair(out.parent)
    cfg = tiny_config(out, train={"max_steps": 12, "eval_every": 0},
                      checkpoint={"format": "sharded", "every": 4, "keep_last": 2, "keep_best": False,
                                  "signing_key": priv})
    trainer = Trainer(cfg, log=QUIET)
    trainer.run()
    return out, trainer, pub


def _corrupt_each_file(folder: Path, extra: tuple[str, ...] = ()):
    """Yield each file's name after flipping one byte in its middle (the files the manifest lists, and `extra`),
    restoring it after."""
    for name in [*read_manifest(folder)["files"], *extra]:
        path = folder / name
        data = bytearray(path.read_bytes())
        original = bytes(data)
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        try:
            yield name
        finally:
            path.write_bytes(original)


def test_one_process_sharded_checkpoint_verifies_and_every_flipped_byte_is_caught(one_process_run, capsys):
    out, _, pub = one_process_run
    root = out / "run" / "checkpoints"
    older, newest = list_checkpoints(root)  # retention (keep_last=2) removed step 4 after step 12 committed
    assert [older.name, newest.name] == ["step-00000008", "step-00000012"]
    assert all(r["valid"] for r in checkpoint_table(root, pub))  # signed by rank 0 over every rank's hashes
    verify_checkpoint(newest, pub)
    assert kiln(["ckpt", "list", str(out / "run")]) == 0 and "step-00000012  valid" in capsys.readouterr().out
    files = set(read_manifest(newest)["files"])
    assert {"index.json", "model-00000.safetensors", "optimizer-00000.safetensors", "index-00000.json",
            "rng.pt", "state.json"} <= files and "model.safetensors" not in files
    assert read_manifest(newest)["checkpoint_format"] == "sharded"
    assert kiln(["ckpt", "verify", str(newest)]) == 0
    caught = []
    for name in _corrupt_each_file(newest, extra=("manifest.json", "manifest.sig")):
        with pytest.raises(IntegrityError) as err:
            verify_checkpoint(newest, pub)
        assert name in str(err.value)
        caught.append(name)
        assert latest_valid(root, log=QUIET, public_key=pub) == older  # the fallback: the previous valid one
    assert set(caught) == files | {"manifest.json", "manifest.sig"}
    assert latest_valid(root, log=QUIET) == newest
    manifest = newest / "manifest.json"  # a manifest edited by someone without the key: refused, older used
    original = manifest.read_bytes()
    manifest.write_bytes(original.replace(b'"step": 12', b'"step": 12, "tampered": 1'))
    try:
        with pytest.raises(IntegrityError, match="signature"):
            verify_checkpoint(newest, pub)
        assert latest_valid(root, log=QUIET, public_key=pub) == older
    finally:
        manifest.write_bytes(original)


def test_a_flipped_byte_in_a_manifest_key_is_an_integrity_error(tmp_path):
    """The flip of the test above can land in a key of manifest.json ("sha256" -> "sha257"): verify_folder
    said KeyError (a traceback) before; it must be the corrupt-folder IntegrityError naming manifest.json."""
    from kiln.manifest import verify_folder, write_manifest

    (tmp_path / "a.bin").write_bytes(b"abc")
    write_manifest(tmp_path, stage="test")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"sha256"', '"sha257"'))
    with pytest.raises(IntegrityError, match="manifest.json: the entry of a.bin"):
        verify_folder(tmp_path)


def test_a_sharded_checkpoint_with_non_finite_weights_is_never_written(one_process_run):
    out, trainer, _ = one_process_run
    saved = trainer.model.norm.weight[0].item()
    with torch.no_grad():
        trainer.model.norm.weight[0] = float("nan")
    trainer.state.step = 13
    try:
        trainer.save()
    finally:
        with torch.no_grad():
            trainer.model.norm.weight[0] = saved
        trainer.state.step = 12
    assert list_checkpoints(out / "run" / "checkpoints")[-1].name == "step-00000012"
    assert not list((out / "run" / "checkpoints").glob("step-00000013*"))


def test_loading_a_sharded_checkpoint_runs_no_pickle(one_process_run, monkeypatch):
    """Every unpickler and torch.load(weights_only=False) is disabled: weights and optimizer state still load
    (rng.pt is read by torch's weights_only loader, which never imports a class)."""
    out = one_process_run[0]
    folder = list_checkpoints(out / "run" / "checkpoints")[-1]
    cfg = tiny_config(out, train={"max_steps": 12})
    fresh = Trainer(cfg, log=QUIET)

    def refuse(*_, **__):
        raise AssertionError("pickle used while loading")

    class RefusingUnpickler(pickle.Unpickler):  # what torch.load(weights_only=False) would unpickle with
        find_class = refuse

    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: refuse() if not k.get("weights_only") else real_load(*a, **k))
    verify_checkpoint(folder)
    weights = load_checkpoint(folder)["model"]
    fresh.checkpointer.load(folder)
    monkeypatch.undo()
    model_state = {k: v for k, v in fresh.model.state_dict().items()}
    assert weights.keys() == model_state.keys() and all(torch.equal(weights[k], model_state[k]) for k in weights)
    assert fresh.step == 12 and fresh.engine.optimizer.state  # the AdamW moments came back too
    for name in read_manifest(folder)["files"]:  # and nothing but rng.pt is a pickle or a zip of one
        head = (folder / name).read_bytes()[:2]
        assert name == "rng.pt" or head not in (b"PK", b"\x80\x02", b"\x80\x04"), name
    assert not list(folder.glob("*.metadata"))


def test_export_of_a_sharded_checkpoint_writes_the_same_weights(one_process_run, tmp_path):
    from kiln.ops.export import to_hf

    folder = list_checkpoints(one_process_run[0] / "run" / "checkpoints")[-1]
    assert kiln(["export", "--hf", str(folder), str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expected = to_hf(load_checkpoint(folder)["model"], folder)
    if json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    assert hf.keys() == expected.keys() and all(torch.equal(hf[k], expected[k]) for k in hf)


# --- the watchdog and the collective timeouts during a save ------------------------------------

WATCHDOG_SCRIPT = """
import sys, time
from pathlib import Path
from kiln.config import WatchdogConfig
from kiln.train.checkpoint import Saver
from kiln.train.parallel import Dist
from kiln.train.parts.watchdog import Watchdog
import functools
dog = Watchdog(Dist(), WatchdogConfig(stall_timeout_s=1.0, heartbeat_s=0.1), Path(sys.argv[1]), print)
dog.step = dog.first_step = 0
dog.beat(1)
dog.start()
saver = Saver(async_save=False)
if sys.argv[2] == "saving":
    saver.busy = functools.partial(dog.saving, 30)
saver.save(lambda: time.sleep(2.5))  # a save longer than stall_timeout_s
dog.stop()
print("finished")
"""


@pytest.mark.parametrize("told", [True, False])
def test_a_save_longer_than_the_stall_timeout_is_not_a_stall(tmp_path, told):
    """The watchdog is real (its own thread and os._exit); only the save is a sleep. Told of the save
    (Saver.busy = Watchdog.saving, as the trainer sets it) it waits; not told, it reports a stall (exit 3)."""
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT, str(tmp_path), "saving" if told else "no"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    if told:
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 3 and "has not advanced" in proc.stdout, proc.stdout + proc.stderr


BARRIER_SCRIPT = """
import os, time
from datetime import timedelta
import torch.distributed as dist
from kiln.train.parallel import Dist
from kiln.train.checkpoint.sharded import save_barrier
dist.init_process_group("gloo", timeout=timedelta(seconds=2))  # parallel.step_timeout_s, shortened
d = Dist(rank=dist.get_rank(), world=dist.get_world_size())
if d.rank == 0:
    time.sleep(5)  # rank 0 still writing a checkpoint while rank 1 waits
save_barrier(d, None, timeout_s=60)
print(f"rank {d.rank} passed")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_end_of_save_barrier_waits_longer_than_the_step_timeout(tmp_path):
    script = tmp_path / "barrier.py"
    script.write_text(BARRIER_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank 0 passed" in proc.stdout and "rank 1 passed" in proc.stdout


# --- two ranks ---------------------------------------------------------------------------------

STEPS = {"max_steps": 10, "eval_every": 0}


@pytest.fixture(scope="module")
def fsdp_run(prepared, tmp_path_factory):
    """FSDP2 on 2 gloo ranks to step 10, checkpoint.format left to its default (sharded under FSDP)."""
    out = _fresh_out(prepared, tmp_path_factory, "fsdp")
    cfg = write_config(out.parent / "c.yaml", out, train=STEPS, parallel={"mode": "fsdp"}, checkpoint={"every": 5})
    finish(launch(cfg, nproc=2))
    return out


def _resume_from_step_5(run: Path, dst: Path, cfg_path: Path, nproc: int, **sections) -> Path:
    """A copy of `run` with its step-10 checkpoint removed, continued from step 5 on `nproc` processes."""
    out = clone(run, dst)
    shutil.rmtree(out / "run" / "checkpoints" / "step-00000010")
    finish(launch(write_config(cfg_path, out, train=STEPS, **sections), nproc=nproc))
    return out


def _step_losses(out: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(out, "step")}


def _close(a: dict[int, float], b: dict[int, float], steps: range, rel: float = 1e-3) -> bool:
    return all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in steps)


@pytest.mark.slow
def test_fsdp_two_ranks_each_write_their_own_pieces_and_verify(fsdp_run):
    folder = list_checkpoints(fsdp_run / "run" / "checkpoints")[-1]
    manifest = read_manifest(folder)
    assert manifest["world_size"] == 2 and manifest["checkpoint_format"] == "sharded"
    for rank in (0, 1):
        index = json.loads((folder / f"index-{rank:05d}.json").read_text())["pieces"]
        files = {p["file"] for kind in index.values() for p in kind.values()}
        assert files == {f"model-{rank:05d}.safetensors", f"optimizer-{rank:05d}.safetensors"}
        # FSDP2 shards dim 0: rank r holds rows [r * n/2, (r+1) * n/2) of the embeddings, and only those
        emb = index["model"]["tok_embeddings.weight"]
        assert emb["offsets"] == [rank * 512, 0] and emb["shape"] == [512, 64] and emb["global_shape"] == [1024, 64]
        assert load_file(str(folder / f"model-{rank:05d}.safetensors"))["tok_embeddings.weight"].shape == (512, 64)
    assert kiln(["ckpt", "verify", str(folder)]) == 0
    assert kiln(["ckpt", "list", str(fsdp_run / "run")]) == 0
    for name in _corrupt_each_file(folder):
        with pytest.raises(IntegrityError, match=name.replace(".", r"\.")):
            verify_checkpoint(folder)
    # The whole weights, assembled, are what the 2-rank run trained: the exported model's too.
    whole = load_checkpoint(folder)["model"]
    assert whole["tok_embeddings.weight"].shape == (1024, 64)


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_resumes_on_one_process(fsdp_run, tmp_path):
    one = _resume_from_step_5(fsdp_run, tmp_path / "one", tmp_path / "one.yaml", nproc=1)
    assert _close(_step_losses(one), _step_losses(fsdp_run), range(6, 11))
    assert events(one, "save")[-1]["step"] == 10  # one process writes the full format by default
    assert (list_checkpoints(one / "run" / "checkpoints")[-1] / "model.safetensors").is_file()


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_resumes_bitwise_on_the_same_layout(fsdp_run, tmp_path):
    same = _resume_from_step_5(fsdp_run, tmp_path / "same", tmp_path / "same.yaml", nproc=2,
                               parallel={"mode": "fsdp"})
    assert _step_losses(same) == _step_losses(fsdp_run)
    a = load_checkpoint(list_checkpoints(same / "run" / "checkpoints")[-1])["model"]
    b = load_checkpoint(list_checkpoints(fsdp_run / "run" / "checkpoints")[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_resumes_under_ddp(fsdp_run, tmp_path):
    ddp = _resume_from_step_5(fsdp_run, tmp_path / "ddp", tmp_path / "ddp.yaml", nproc=2,
                              parallel={"mode": "ddp"}, checkpoint={"format": "sharded"})
    assert _close(_step_losses(ddp), _step_losses(fsdp_run), range(6, 11))
    # DDP's replicated weights are written once, spread over both ranks by size
    folder = list_checkpoints(ddp / "run" / "checkpoints")[-1]
    sizes = [(folder / f"model-{r:05d}.safetensors").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.3 * max(sizes)


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two_fsdp_ranks(prepared, tmp_path):
    single = tmp_path / "single"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, single / name)
    finish(launch(write_config(tmp_path / "s.yaml", single, train=STEPS, checkpoint={"every": 5,
                                                                                     "format": "sharded"})))
    two = _resume_from_step_5(single, tmp_path / "two", tmp_path / "two.yaml", nproc=2, parallel={"mode": "fsdp"})
    assert _close(_step_losses(two), _step_losses(single), range(6, 11))
    assert read_manifest(list_checkpoints(two / "run" / "checkpoints")[-1])["world_size"] == 2


@pytest.mark.slow
def test_async_sharded_save_on_two_ranks_writes_the_same_checkpoints(fsdp_run, tmp_path):
    out = tmp_path / "async"
    for name in ("tokenizer", "shards"):
        shutil.copytree(fsdp_run / name, out / name)
    cfg = write_config(tmp_path / "a.yaml", out, train=STEPS, parallel={"mode": "fsdp"},
                       checkpoint={"every": 5, "async_save": True})
    finish(launch(cfg, nproc=2))
    assert losses(out) == losses(fsdp_run)
    saves = events(out, "save")
    assert [s["step"] for s in saves] == [5, 10] and all(s["async"] and s["format"] == "sharded" for s in saves)
    for a, b in zip(list_checkpoints(out / "run" / "checkpoints"), list_checkpoints(fsdp_run / "run" / "checkpoints")):
        verify_checkpoint(a)
        for name in ("model-00000.safetensors", "model-00001.safetensors", "optimizer-00001.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_under_hsdp_whose_replicas_write_once(fsdp_run, tmp_path):
    """HSDP with mesh [2, 1]: 2 replicas of a 1-way shard, so every piece has two holders and only the replica at
    coordinate 0 writes it. A GPU run would add a shard dimension > 1 within each node."""
    hsdp = _resume_from_step_5(fsdp_run, tmp_path / "hsdp", tmp_path / "hsdp.yaml", nproc=2,
                               parallel={"mode": "fsdp", "mesh": [2, 1]})
    assert _close(_step_losses(hsdp), _step_losses(fsdp_run), range(6, 11))
    folder = list_checkpoints(hsdp / "run" / "checkpoints")[-1]
    verify_checkpoint(folder)
    index = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    assert len(index[0]["model"]) == len(load_checkpoint(folder)["model"]) and not index[1]["model"]
    a = load_checkpoint(folder)["model"]
    b = load_checkpoint(list_checkpoints(fsdp_run / "run" / "checkpoints")[-1])["model"]
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in b)



@pytest.mark.slow
def test_fsdp_checkpoint_resumes_under_tensor_parallel(fsdp_run, tmp_path):
    """FSDP2's row shards read into tensor parallel's column and row shards (and its vocabulary-parallel
    head): each rank reads the boxes of its own share from both ranks' pieces. A GPU run would add NCCL."""
    tp = _resume_from_step_5(fsdp_run, tmp_path / "tp", tmp_path / "tp.yaml", nproc=2, parallel={"tp": 2})
    assert _close(_step_losses(tp), _step_losses(fsdp_run), range(6, 11))
    folder = list_checkpoints(tp / "run" / "checkpoints")[-1]
    verify_checkpoint(folder)
    assert json.loads((folder / "index-00001.json").read_text())["pieces"]["model"][
        "layers.0.attention.wo.weight"]["offsets"] == [0, 32]  # tp's column half, not FSDP2's rows


# Two gloo ranks, an FSDP2 model and its optimizer, about to save into sys.argv[1]: what the scripts below share.
TWO_RANK_SAVE = """
import errno, os, signal, sys
from pathlib import Path
import torch
import torch.distributed as dist
from kiln.errors import KilnError
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.train import parallel
from kiln.train.parallel.parallelize import FSDPModel, apply_fsdp
from kiln.train.checkpoint import sharded
from kiln.checkpoint import rng_state
from kiln.train.checkpoint import Saver

dist.init_process_group("gloo")
d = parallel.Dist(rank=dist.get_rank(), world=dist.get_world_size())
model = build_model(ModelConfig(dim=16, n_layers=1, n_heads=2), vocab_size=64, max_seq_len=8)
apply_fsdp(model, d, None, None)
opt = torch.optim.AdamW(model.parameters())
root, tok = Path(sys.argv[1]), Path(sys.argv[1]).parent / "tokenizer.json"
"""

FAILING_RANK_SCRIPT = TWO_RANK_SAVE + """
if d.rank == 1:  # this rank's disk fills up while it writes its pieces
    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")
    sharded.write_pieces = full
saver = Saver(sys.argv[2] == "async")
try:
    sharded.save(root, 3, model, opt, d, saver, state={"step": 3}, rng=rng_state(), config_yaml="",
                 tokenizer_file=tok, manifest_fields={}, signing_key=None, timeout_s=60)
    saver.wait()  # an async save's failure is raised here
except KilnError as exc:
    print(f"rank {d.rank} refused: {exc}")
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rank_that_fails_mid_save_stops_every_rank_and_leaves_nothing(tmp_path, mode):
    """Rank 1's write raises (a full disk, simulated: the one thing mocked); rank 0 must not hang waiting for its
    hashes, both ranks raise one KilnError naming rank 1, and neither the checkpoint nor its staging folder stays."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK_SCRIPT)
    (tmp_path / "tokenizer.json").write_text("{}")
    root = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(root), mode], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank} refused: " in proc.stdout and "rank 1 on host" in proc.stdout
    assert "no space left on the device" in proc.stdout
    assert not list(root.iterdir())  # no step-00000003, no step-00000003.tmp-*


UNEVEN_SCRIPT = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.train import parallel
from kiln.train.parallel.parallelize import FSDPModel, apply_fsdp
from kiln.train.checkpoint import sharded
from kiln.checkpoint import load_checkpoint, rng_state
from kiln.train.checkpoint import Saver

dist.init_process_group("gloo")
d = parallel.Dist(rank=dist.get_rank(), world=dist.get_world_size())
args = ModelConfig(dim=24, n_layers=1, n_heads=3, n_kv_heads=1)  # with 67 rows: odd rows everywhere


def trained(seed):
    torch.manual_seed(seed)
    model = build_model(args, vocab_size=67, max_seq_len=8)
    apply_fsdp(model, d, None, None)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 67, (1, 8))).sum().backward()
    opt.step()
    return model, opt


root, tok = Path(sys.argv[1]), Path(sys.argv[1]).parent / "tokenizer.json"
model, opt = trained(0)
sharded.save(root, 1, model, opt, d, Saver(False), state={"step": 1}, rng=rng_state(), config_yaml="",
             tokenizer_file=tok, manifest_fields={}, signing_key=None, timeout_s=60)
other, other_opt = trained(1)  # different weights and moments, overwritten by the load
sharded.load(root / "step-00000001", other, other_opt, d)
local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
pairs = list(zip(model.parameters(), other.parameters()))
same = all(torch.equal(local(a), local(b)) for a, b in pairs) and all(
    torch.equal(local(opt.state[a][k]), local(other_opt.state[b][k])) for a, b in pairs for k in opt.state[a])
want = FSDPModel(model, d, None, None).state_dict()  # gathered on every rank (rank 0 keeps it)
whole = load_checkpoint(root / "step-00000001")["model"]
print(f"rank {d.rank} same={same} whole={d.rank != 0 or all(torch.equal(whole[k], want[k]) for k in want)}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_uneven_fsdp_shards_round_trip_exactly(tmp_path):
    """Sizes that 2 ranks cannot split evenly (67 rows of embeddings, 3 heads): FSDP2 gives rank 0 the larger
    piece; the pieces tile, and a load into another model on 2 ranks restores weights and moments bitwise."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_SCRIPT)
    (tmp_path / "tokenizer.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path / "checkpoints")], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank 0 same=True whole=True" in proc.stdout and "rank 1 same=True whole=True" in proc.stdout
    folder = tmp_path / "checkpoints" / "step-00000001"
    verify_checkpoint(folder)
    emb = [json.loads((folder / f"index-{r:05d}.json").read_text())["pieces"]["model"]["tok_embeddings.weight"]
           for r in (0, 1)]
    assert [e["shape"][0] for e in emb] == [34, 33] and emb[1]["offsets"] == [34, 0]


KILLED_RANK_SCRIPT = TWO_RANK_SAVE + """
if d.rank == 1:  # this rank is killed while it writes its pieces
    sharded.write_pieces = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
try:
    sharded.save(root, 3, model, opt, d, Saver(False), state={"step": 3}, rng=rng_state(), config_yaml="",
                 tokenizer_file=tok, manifest_fields={}, signing_key=None, timeout_s=60)
except KilnError as exc:
    print(f"kiln: error: {exc}")
"""


def test_a_rank_killed_during_a_sharded_save_is_named_in_one_line(tmp_path):
    """SIGKILL to rank 1 while it writes its pieces: rank 0 (launched on its own, so no launcher ends it first, as
    torchrun would race to) says which rank was lost and that nothing was committed, instead of gloo's
    "Connection closed by peer" traceback; no checkpoint and no staging folder stay."""
    import socket

    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK_SCRIPT)
    (tmp_path / "tokenizer.json").write_text("{}")
    root = tmp_path / "checkpoints"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script), str(root)], env={**env, "RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    out, err = procs[0].communicate(timeout=180)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == -9
    assert "Traceback" not in err, err[-3000:]
    [line] = [ln for ln in out.splitlines() if ln.startswith("kiln: error: ")]
    assert line.startswith(f"kiln: error: {root / 'step-00000003'}: rank 1 stopped answering during the sharded save "
                           "(rank 0 saw: ")
    assert line.endswith("the checkpoint was not committed (nothing of it is kept): run the same command again, it "
                         "resumes from the newest committed checkpoint")
    assert not list(root.iterdir())  # no step-00000003, no step-00000003.tmp-*
