"""`kiln train` with `out_dir: s3://...` (train/remote_run.py), against moto's S3 server (test_remote_checkpoint's)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.checkpoint.remote import MARKER, RemoteCheckpoints
from kiln.train.remote_run import local_folder
from kiln.train.trainer import Trainer
from test_remote_checkpoint import BUCKET, KILLED_UPLOAD, s3  # noqa: F401  (s3: the moto server fixture)
from test_resilience import ENV, clone, final_weights, losses, same_weights, write_config


def upload(s3fs, local, url: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.relative_to(local).as_posix()}")


def test_a_run_with_an_s3_out_dir_is_killed_mid_upload_and_resumes_bitwise_elsewhere(workdir, tmp_path, s3,  # noqa: F811
                                                                                      monkeypatch, capsys):
    opts, env = s3
    url = f"s3://{BUCKET}/outrun"
    remote = RemoteCheckpoints(f"{url}/run/checkpoints", opts)
    for name in ("tokenizer", "shards"):  # packed locally, copied up
        upload(remote.fs, workdir / name, f"{url}/{name}")
    reference = clone(workdir, tmp_path / "ref")
    Trainer(tiny_config(reference, train={"max_steps": 8}, checkpoint={"every": 2}), log=lambda *_: None).run()
    cfg = write_config(tmp_path / "c.yaml", url, train={"max_steps": 8},  # type: ignore[arg-type]
                       checkpoint={"every": 2, "keep_last": 3, "keep_best": False, "storage_options": opts})
    run_env = {**ENV, **env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    killed = subprocess.run([sys.executable, "-c", KILLED_UPLOAD, str(cfg)], env=run_env, cwd=ROOT,
                            capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert remote.steps() == [2, 4, 6] and remote.committed(6)[1].startswith("its upload did not finish")
    uploaded = remote.fs.cat_file(f"{BUCKET}/outrun/run/metrics.jsonl").decode().splitlines()
    assert max(r["step"] for r in read_metrics_lines(uploaded) if r["event"] == "step") == 4  # with step 4's save
    assert remote.fs.exists(f"{BUCKET}/outrun/run/config.yaml") and remote.fs.exists(f"{BUCKET}/outrun/run/env.json")

    shutil.rmtree(tmp_path / "cache")  # another machine: no run folder, no tokenizer, no shard cache
    resumed = subprocess.run([sys.executable, "-m", "kiln", "train", str(cfg)], env=run_env, cwd=ROOT,
                             capture_output=True, text=True, timeout=240)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"metrics.jsonl from {url}/run/metrics.jsonl" in out
    assert f"skipping {url}/run/checkpoints/step-00000006: its upload did not finish (no {MARKER} marker)" in out
    assert "resumed from" in out and "step-00000004 (step 4)" in out
    with monkeypatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        local = local_folder(url)
    tokenizer = "tokenizer/tokenizer.json"
    assert (local / tokenizer).read_bytes() == (workdir / tokenizer).read_bytes()  # downloaded, verified
    assert losses(local) == losses(reference)  # steps 1-4 from the URL's metrics.jsonl, 5-8 trained here
    assert same_weights(final_weights(local), final_weights(reference))
    assert remote.steps() == [4, 6, 8] and remote.committed(6)[1] is None
    up, here = remote.fs.cat_file(f"{BUCKET}/outrun/run/metrics.jsonl"), (local / "run" / "metrics.jsonl").read_bytes()
    assert here.startswith(up) and [r["event"] for r in read_metrics_lines(here[len(up):].decode().splitlines())] \
        == ["save"]  # uploaded by step 8's save, before its own record

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert kiln(["ckpt", "verify", f"{url}/run/checkpoints/step-00000008"]) == 0
    assert f"ok: {url}/run/checkpoints/step-00000008 (step 8," in capsys.readouterr().out


def read_metrics_lines(lines: list[str]) -> list[dict]:
    import json

    return [json.loads(ln) for ln in lines if ln.strip()]


def test_an_s3_out_dir_without_its_tokenizer_is_one_line(tmp_path, s3, monkeypatch, capsys):  # noqa: F811
    opts, env = s3
    for k, v in {**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    cfg = write_config(tmp_path / "c.yaml", f"s3://{BUCKET}/empty", checkpoint={"storage_options": opts})
    assert kiln(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kiln: error: s3://{BUCKET}/empty/tokenizer/manifest.json: not found; out_dir is a URL")
    assert "copy it up" in err and "\n" not in err


@pytest.mark.parametrize("command", ["run", "preflight"])
def test_the_data_stages_refuse_a_url_out_dir_in_one_line(tmp_path, command, capsys):
    cfg = write_config(tmp_path / "c.yaml", "s3://bucket/run")
    assert kiln([command, str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "out_dir 's3://bucket/run' is a URL, which only `kiln train` reads" in err and "\n" not in err
    assert not (tmp_path / "s3:").exists() and not (ROOT / "s3:").exists()
