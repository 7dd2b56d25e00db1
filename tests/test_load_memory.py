"""Loading and export at real size (#39 items 2 and 5), measured: `kiln import --hf`, train.init_from of a sharded
checkpoint and `kiln export --hf` of one hold one tensor at a time, never the model.

The model: 8 layers of dim 1024 (~95 M parameters, ~380 MB in fp32; its largest tensor 11.5 MB). Each command
runs in a fresh process; what it adds to the process's anonymous resident memory (RssAnon's peak, sampled every
2 ms, less RssAnon just before the command, torch and Kiln already imported, for init_from the run's model already
built) must stay under half the model (it was more than the whole model for import --hf, which built and loaded
the model on the host). VmHWM counts more: safetensors reads through a memory map, so the pages of the files read
count as resident (clean page cache the kernel reclaims) until a file is closed; the tests print both.
A ~1 B checkpoint (~4 GB of weights) is not written here: with the AdamW state the run that saves it needs
~16 GB; `python -m benchmarks export_size` writes one on 2 FSDP ranks and measures its export (BENCHMARKS.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from kiln.checkpoint import list_checkpoints
from kiln.checkpoint.sharded import pieces

pytestmark = pytest.mark.slow

BIG = {"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8}
MEASURE = """
import json, sys
from pathlib import Path
import torch, kiln.ops.export, kiln.train.trainer
from kiln.config import load_config

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

import threading
peak = [0]
def sample():  # the anonymous memory's peak (no kernel high-water mark for it): every 2 ms
    while True:
        peak[0] = max(peak[0], status("RssAnon:"))
        threading.Event().wait(0.002)
threading.Thread(target=sample, daemon=True).start()

what, config, *paths = sys.argv[1:]
cfg = load_config(config, [])
if what == "init_from":
    trainer = kiln.train.trainer.Trainer(cfg, log=lambda *_: None)
    before, file_before = status("RssAnon:"), status("VmRSS:")
    trainer.resume()
    params = sum(p.numel() for p in trainer.model.parameters())
else:
    before, file_before = status("RssAnon:"), status("VmRSS:")
    if what == "import":
        kiln.ops.export.import_hf(Path(paths[0]), cfg)
    else:
        kiln.ops.export.export_hf(Path(paths[0]), Path(paths[1]))
threading.Event().wait(0.01)
print(json.dumps({"added": max(peak[0], status("RssAnon:")) - before, "hwm_added": status("VmHWM:") - file_before}))
"""


def measure(what: str, config: Path, *paths: Path, with_hwm: bool = False):
    out = subprocess.run([sys.executable, "-c", MEASURE, what, str(config), *map(str, paths)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{what}: VmHWM - VmRSS before: +{got['hwm_added'] / 1e6:.0f} MB (with the mapped files' pages)")
    return (got["added"], got["hwm_added"]) if with_hwm else got["added"]


def config_file(prepared, root: Path, **sections) -> tuple[Path, object]:
    out = root / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    cfg = tiny_config(out, model=BIG, **sections)
    path = root / "run.yaml"
    path.write_text(cfg.to_yaml())
    return path, cfg


@pytest.fixture(scope="module")
def big_sharded(prepared, tmp_path_factory) -> tuple[Path, int]:
    """One step of the BIG model with checkpoint.format=sharded (the real save code): its checkpoint, parameters."""
    root = tmp_path_factory.mktemp("big")
    config, cfg = config_file(prepared, root, train={"max_steps": 1, "batch_size": 1, "micro_batch_size": 1,
                                                     "eval_every": 0},
                              checkpoint={"every": 1, "format": "sharded"})
    subprocess.run([sys.executable, "-m", "kiln", "train", str(config)], check=True, capture_output=True, timeout=900)
    ckpt = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    return ckpt, sum(_numel(v) for p in ckpt.glob("index-*.json")
                     for v in json.loads(p.read_text())["pieces"]["model"].values())


def _numel(entry) -> int:
    return torch.Size(entry["shape"]).numel() if isinstance(entry, dict) else sum(_numel(e) for e in entry)


def test_init_from_a_sharded_checkpoint_reads_one_tensor_at_a_time(big_sharded, prepared, tmp_path):
    ckpt, params = big_sharded
    config, _ = config_file(prepared, tmp_path, train={"init_from": str(ckpt), "max_steps": 2, "batch_size": 1,
                                                       "micro_batch_size": 1})
    added = measure("init_from", config)
    print(f"init_from: +{added / 1e6:.0f} MB over the built model; the model is {4 * params / 1e6:.0f} MB")
    assert params > 90e6 and added < 0.5 * 4 * params


def test_export_of_a_sharded_checkpoint_holds_one_tensor(big_sharded, prepared, tmp_path):
    ckpt, params = big_sharded
    config, _ = config_file(prepared, tmp_path)
    added, hwm_added = measure("export", config, ckpt, tmp_path / "hf", with_hwm=True)
    print(f"export --hf: +{added / 1e6:.0f} MB; the model is {4 * params / 1e6:.0f} MB")
    assert added < 0.5 * 4 * params
    # Peak RSS too: each tensor's file pages are unmapped after it (PieceIndex.full), so the mapped pages of the
    # files read do not pile up (they were +431 MB, the whole model, before).
    assert hwm_added < 0.5 * 4 * params
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 4 * params


def test_import_hf_streams_the_weights_into_the_checkpoint(big_sharded, prepared, tmp_path):
    """The HF folder is the BIG checkpoint's export; the import's checkpoint holds its weights bitwise."""
    from safetensors import safe_open

    from kiln.ops.export import export_hf

    ckpt, params = big_sharded
    export_hf(ckpt, tmp_path / "hf", max_shard_size=100 * 10**6)  # four or five files and the index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    config, cfg = config_file(prepared, tmp_path / "run")
    added = measure("import", config, tmp_path / "hf")
    print(f"import --hf: +{added / 1e6:.0f} MB; the model is {4 * params / 1e6:.0f} MB")
    assert added < 0.5 * 4 * params
    step0 = list_checkpoints(cfg.out / "run" / "checkpoints")[-1]
    with safe_open(str(step0 / "model.safetensors"), framework="pt") as f:
        got = f.get_tensor("layers.7.feed_forward.w2.weight")
    with pieces(ckpt) as p:
        assert torch.equal(got, p.full("layers.7.feed_forward.w2.weight"))
