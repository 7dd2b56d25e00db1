"""Which checkpoint the ranks resume from, agreed with the hashing split over the ranks
(train/checkpoint/agreement.py): each rank hashes its share of the files, a flipped byte in any file sends every
rank to the previous checkpoint with one line, and the ranks wait for a slow hasher on the checkpoint's own
timeout, not the step timeout. Real gloo ranks; a GPU run adds nothing here (the hashing is on the host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from conftest import ROOT, killed_by_a_signal
from kiln.errors import IntegrityError
from kiln.manifest import verify_folder, write_manifest
from kiln.train.checkpoint.agreement import hash_shares

SMALL = {"rng.pt", "state.json"}


def test_shares_give_each_rank_its_own_files_and_balance_the_rest_by_size():
    files = {"model-00000.safetensors": {"size": 100}, "optimizer-00000.safetensors": {"size": 200},
             "index-00000.json": {"size": 1}, "model-00001.safetensors": {"size": 100},
             "optimizer-00001.safetensors": {"size": 200}, "index-00001.json": {"size": 1},
             "rng.pt": {"size": 5}, "state.json": {"size": 5}, "index.json": {"size": 3},
             "tokenizer.json": {"size": 50}, "config.yaml": {"size": 2}}
    shares = hash_shares(files, ["a", "a"], sharded=True)
    assert shares == [["model-00000.safetensors", "optimizer-00000.safetensors", "index-00000.json", "tokenizer.json"],
                      ["model-00001.safetensors", "optimizer-00001.safetensors", "index-00001.json", "index.json",
                       "config.yaml"]]  # the rest, largest first, to the rank with fewer bytes so far
    # a 2-rank checkpoint resumed on 3 ranks: rank 2 wrote nothing, so it takes the rest
    assert hash_shares(files, ["a", "b", "c"], sharded=True)[2] == ["tokenizer.json", "index.json", "config.yaml"]


def test_full_checkpoints_are_hashed_by_the_ranks_that_see_rank_0s_folder():
    files = {"model.safetensors": {"size": 400}, "optimizer.pt": {"size": 800}, "rng.pt": {"size": 5},
             "state.json": {"size": 5}, "config.yaml": {"size": 2}, "tokenizer.json": {"size": 50}}
    # ranks 0, 1 see one folder (rank 0 reads the weights from it), ranks 2, 3 their own copies: they hash none
    assert hash_shares(files, ["a", "a", "b", "b"], sharded=False) == [
        ["optimizer.pt"], ["model.safetensors", "tokenizer.json", "config.yaml"], [], []]
    assert hash_shares(files, ["a"], sharded=False) == [["optimizer.pt", "model.safetensors", "tokenizer.json",
                                                         "config.yaml"]]


def test_threaded_verify_names_the_first_bad_file_in_manifest_order(tmp_path):
    for i in range(6):
        (tmp_path / f"part-{i}.bin").write_bytes(os.urandom(300_000))
    write_manifest(tmp_path, stage="test")
    assert set(verify_folder(tmp_path, workers=4)["files"]) == {f"part-{i}.bin" for i in range(6)}
    for i in (4, 1):
        path = tmp_path / f"part-{i}.bin"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    for workers in (1, 4):
        with pytest.raises(IntegrityError, match=r"part-1\.bin: sha256 .* in manifest\.json"):
            verify_folder(tmp_path, workers=workers)


_AGREE = r"""
import json, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
import torch.nn.functional as F
import kiln.manifest as manifest
from kiln.model.build import build_model
from kiln.model.config import ModelConfig
from kiln.train.checkpoint import agreement as consensus, sharded
from kiln.checkpoint import rng_state, write_checkpoint
from kiln.train.checkpoint import Saver
from kiln.train.parallel import Dist, set_step_timeout
from kiln.train.parallel.parallelize import FSDPModel, apply_fsdp

out = Path(sys.argv[1])
dist.init_process_group("gloo")
d = Dist(rank=dist.get_rank(), world=dist.get_world_size())
torch.manual_seed(0)
model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4), vocab_size=256, max_seq_len=32)
apply_fsdp(model, d)
fsdp = FSDPModel(model, d, None, None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokenizer = out / "tokenizer.json"
if d.is_main:
    tokenizer.write_text('{"a tokenizer": 1}')
dist.barrier()
roots = {"sharded": out / "sharded", "full": out / "full"}
for step in (1, 2):
    tokens = torch.randint(0, 256, (2, 33))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    meta = {"step": step, "tokens_seen": step}
    sharded.save(roots["sharded"], step, model, opt, d, Saver(False), state=meta, rng=rng_state(),
                 config_yaml="seed: 0\n", tokenizer_file=tokenizer, manifest_fields={}, signing_key=None,
                 timeout_s=60)
    weights, moments = fsdp.full_states(opt)
    if d.is_main:
        write_checkpoint(roots["full"], step, weights, moments, [rng_state()] * 2, meta, "seed: 0\n", tokenizer, {})
    dist.barrier()

hashed, slow = [], {}
real = manifest.sha256_file
def recording(path, *args):
    hashed.append(Path(path).name)
    time.sleep(slow.pop("s", 0.0))  # the first file hashed after `slow` is set, once
    return real(path, *args)
manifest.sha256_file = recording

def agree(root, timeout_s=60):
    hashed.clear()
    lines = []
    folder = consensus.agreed_checkpoint(d, root, lines.append, timeout_s=timeout_s)
    return {"folder": folder.name if folder else None, "lines": lines, "hashed": sorted(hashed)}

report = {}
for kind, root in roots.items():
    newest = root / "step-00000002"
    mine = {"clean": agree(root), "flips": {}}
    for name in sorted(json.loads((newest / "manifest.json").read_text())["files"]):
        path = newest / name
        if d.is_main:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        dist.barrier()
        mine["flips"][name] = agree(root)
        dist.barrier()
        if d.is_main:
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        dist.barrier()
    report[kind] = mine
# Rank 1's first file takes 3 s to hash, the step timeout is 1 s: rank 0 waits 3 s in the agreement's
# collectives, which go over the checkpoint group with its timeout (the default group would time out).
set_step_timeout(d, 1.0)
if d.rank == 1:
    slow["s"] = 3.0
report["slow"] = agree(roots["full"])
set_step_timeout(d, 600.0)  # the report's gather and the teardown are no part of the test: no 1 s window there
seen = [None] * d.world
dist.all_gather_object(seen, report)
if d.is_main:
    print(json.dumps(seen))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def agreements(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    script = tmp / "agree.py"
    script.write_text(_AGREE)
    # faulthandler: a rank that dies in native code prints its Python stack (CI once saw rank 1 end in SIGABRT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    for attempt in (1, 2):
        run = tmp / f"attempt-{attempt}"
        run.mkdir()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script), str(run)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        ranks_output = proc.stderr[:3000]  # the ranks' own lines come before torchrun's summary
        if proc.returncode == 0 or attempt == 2 or not killed_by_a_signal(proc.stderr):
            break
        # Only a rank killed by a signal (a crash in native code, no Python error) is run once more, loudly: a
        # wrong verdict, an exception or a hang fails at once.
        warnings.warn(f"agreement script: a rank was killed by a signal, running it once more:\n{ranks_output}")
    assert proc.returncode == 0, proc.stdout[-2000:] + ranks_output + "\n...\n" + proc.stderr[-1500:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), run


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_each_rank_hashes_its_share_and_together_every_file(agreements, kind):
    seen, tmp = agreements
    files = set(json.loads((tmp / kind / "step-00000002" / "manifest.json").read_text())["files"])
    clean = [rank[kind]["clean"] for rank in seen]
    assert [c["folder"] for c in clean] == ["step-00000002"] * 2 and clean[0]["lines"] == []
    shares = [set(c["hashed"]) for c in clean]
    assert shares[0] | shares[1] == files  # every file hashed ...
    assert shares[0] & shares[1] == SMALL  # ... once, but the small files each rank reads itself
    if kind == "sharded":  # the files each rank wrote
        assert {"model-00000.safetensors", "optimizer-00000.safetensors", "index-00000.json"} <= shares[0]
        assert {"model-00001.safetensors", "optimizer-00001.safetensors", "index-00001.json"} <= shares[1]
    else:  # the two large files, one each
        assert len({"model.safetensors", "optimizer.pt"} & shares[0]) == 1
        assert len({"model.safetensors", "optimizer.pt"} & shares[1]) == 1


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_flipped_byte_in_any_file_sends_every_rank_back_with_one_line(agreements, kind):
    seen, tmp = agreements
    flips = [rank[kind]["flips"] for rank in seen]
    files = set(json.loads((tmp / kind / "step-00000002" / "manifest.json").read_text())["files"])
    assert set(flips[0]) == files
    for name in files:
        assert [f[name]["folder"] for f in flips] == ["step-00000001"] * 2, name
        lines = flips[0][name]["lines"]
        assert len(lines) == 1 and lines[0].startswith("skipping corrupt checkpoint: "), (name, lines)
        assert f"step-00000002/{name}: sha256 " in lines[0], (name, lines)
        assert flips[1][name]["lines"] == []  # rank 0 says it, once


def test_ranks_wait_for_a_slow_hasher_on_the_checkpoint_timeout_not_the_step_timeout(agreements):
    seen, _ = agreements
    assert [rank["slow"]["folder"] for rank in seen] == ["step-00000002"] * 2


def test_the_checkpointer_agrees_under_the_watchdogs_saving_and_the_save_timeout(tmp_path, monkeypatch):
    """A rollback's agreement runs while the watchdog is up: the ranks hash under Watchdog.saving (judged against
    checkpoint.save_timeout_s, not stall_timeout_s), and the collectives get the same timeout. (agreed_checkpoint
    is replaced by a probe; the real one runs on gloo ranks above.)"""
    from kiln.config import CheckpointConfig, WatchdogConfig
    from kiln.train.checkpoint import agreement as consensus
    from kiln.train.parallel import Dist
    from kiln.train.parts.watchdog import Watchdog
    from kiln.train.checkpoint import Checkpointer, FullCheckpoint, TrainState

    dog = Watchdog(Dist(), WatchdogConfig(stall_timeout_s=30), tmp_path)
    seen = {}

    def probe(d, root, log, public_key=None, before=None, timeout_s=None):
        seen.update(saving=dog.save_timeout_s, timeout_s=timeout_s, before=before)
        return None

    monkeypatch.setattr(consensus, "agreed_checkpoint", probe)
    checkpointer = Checkpointer(CheckpointConfig(save_timeout_s=900), tmp_path, TrainState([], 1, "0"), None, Dist(),
                                None, "", lambda: None, lambda _: None, lambda _: None, dog, fmt=FullCheckpoint())
    progress = dog.progress
    assert checkpointer.agreed(before=7) is None
    assert seen == {"saving": 900, "timeout_s": 900, "before": 7}
    assert dog.save_timeout_s is None and dog.progress == progress + 1  # the end of the hashing is progress
