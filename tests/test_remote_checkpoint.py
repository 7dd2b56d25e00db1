"""checkpoint.dir on object storage (train/checkpoint/remote.py), against a real S3 endpoint: moto's server on
127.0.0.1, in this process (ThreadedMotoServer), which the training subprocesses reach over HTTP."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, tiny_config
from kiln.cli import main as kiln
from kiln.errors import KilnError
from kiln.checkpoint import list_checkpoints
from kiln.checkpoint.remote import MARKER, RemoteCheckpoints
from kiln.train.trainer import Trainer
from test_resilience import ENV, clone, final_weights, finish, launch, losses, same_weights, write_config

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3():
    """(storage_options for moto's S3 server, the environment the CLI reads them from); the bucket `ckpts`."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    import s3fs

    # fsspec caches a filesystem per set of arguments, not per environment: a client made for another module's
    # server (the CLI reads the endpoint from AWS_ENDPOINT_URL) would otherwise be reused here, and after
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield opts, env
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def remote_sha(remote: RemoteCheckpoints, step: int, name: str) -> str:
    return hashlib.sha256(remote.fs.cat_file(remote._path(step, name))).hexdigest()


def test_checkpoints_go_to_the_url_committed_by_a_marker_and_verify_from_there(workdir, s3, monkeypatch, capsys):
    opts, env = s3
    url = f"s3://{BUCKET}/unit/checkpoints"
    cfg = tiny_config(workdir, train={"max_steps": 6}, checkpoint={"every": 2, "keep_last": 2, "keep_best": False,
                                                                  "dir": url, "storage_options": opts})
    Trainer(cfg, log=lambda *_: None).run()
    remote = RemoteCheckpoints(url, opts)
    assert remote.steps() == [4, 6]  # retention at the URL: keep_last 2 (step 2 went, marker first)
    for step in (4, 6):  # COMMITTED holds manifest.json's sha256
        assert remote.fs.cat_file(remote._path(step, MARKER)).decode() == remote_sha(remote, step, "manifest.json")
    local = list_checkpoints(workdir / "run" / "checkpoints")
    assert [p.name for p in local] == ["step-00000006"]  # the local cache: the newest only
    assert remote_sha(remote, 6, "model.safetensors") == hashlib.sha256(
        (local[0] / "model.safetensors").read_bytes()).hexdigest()

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert kiln(["ckpt", "verify", f"{url}/step-00000006"]) == 0
    assert "ok: s3://ckpts/unit/checkpoints/step-00000006 (step 6," in capsys.readouterr().out
    # a file changed at the URL after the commit: named, never loaded
    remote.fs.pipe_file(remote._path(4, "optimizer.pt"), b"not the optimizer")
    assert kiln(["ckpt", "verify", f"{url}/step-00000004"]) == 1
    assert "step-00000004/optimizer.pt" in capsys.readouterr().err
    assert kiln(["ckpt", "list", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step-00000004  INVALID") and "the remote copy is corrupt" in out[0]
    assert out[1].startswith("step-00000006  valid    step 6")


# A training run whose upload of step 6 is killed (SIGKILL, by itself) after its other files and before its
# manifest.json: the files are at the URL, the marker is not.
KILLED_UPLOAD = textwrap.dedent("""
    import os, signal, sys
    import s3fs
    put = s3fs.S3FileSystem._put_file
    async def killing_put(self, lpath, rpath, *args, **kwargs):
        if rpath.endswith("step-00000006/manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return await put(self, lpath, rpath, *args, **kwargs)
    s3fs.S3FileSystem._put_file = killing_put
    from kiln.cli import main
    sys.exit(main(["train", sys.argv[1]]))
""")


def test_a_run_killed_mid_upload_resumes_bitwise_from_the_url(workdir, tmp_path, s3, capsys, monkeypatch):
    opts, env = s3
    url = f"s3://{BUCKET}/killed/checkpoints"
    reference = clone(workdir, tmp_path / "ref")
    Trainer(tiny_config(reference, train={"max_steps": 8}, checkpoint={"every": 2}), log=lambda *_: None).run()
    cfg = write_config(tmp_path / "c.yaml", workdir, train={"max_steps": 8},
                       checkpoint={"every": 2, "keep_last": 3, "keep_best": False, "dir": url,
                                   "storage_options": opts})
    killed = subprocess.run([sys.executable, "-c", KILLED_UPLOAD, str(cfg)], env=ENV, cwd=ROOT, capture_output=True,
                            text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    remote = RemoteCheckpoints(url, opts)
    assert remote.steps() == [2, 4, 6]
    assert remote.committed(6) == (None, f"its upload did not finish (no {MARKER} marker): never loaded")
    assert remote.fs.exists(remote._path(6, "model.safetensors"))  # half-written: files, no manifest, no marker

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert kiln(["ckpt", "list", url]) == 0
    listed = capsys.readouterr().out
    assert "step-00000006  INVALID  s3://ckpts/killed/checkpoints/step-00000006: its upload did not finish" in listed

    import shutil

    shutil.rmtree(workdir / "run" / "checkpoints")  # the node's disk is gone: the resume downloads from the URL
    out = finish(launch(cfg))
    assert "skipping s3://ckpts/killed/checkpoints/step-00000006: its upload did not finish" in out
    assert "resumed from" in out and "step-00000004 (step 4)" in out
    assert losses(workdir) == losses(reference)
    assert same_weights(final_weights(workdir), final_weights(reference))
    assert remote.steps() == [4, 6, 8]  # keep_last 3; step 6 uploaded again, this time committed
    assert remote.committed(6)[1] is None
    assert kiln(["ckpt", "verify", f"{url}/step-00000008"]) == 0


def test_an_unreachable_checkpoint_url_is_one_line():
    opts = {"key": "testing", "secret": "testing",  # nothing listens on the discard port
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}
    with pytest.raises(KilnError) as err:
        RemoteCheckpoints("s3://nowhere/checkpoints", opts).steps()
    assert str(err.value).startswith("s3://nowhere/checkpoints: could not reach the storage server "
                                     "(EndpointConnectionError: ")
    assert "checkpoint.storage_options" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow  # ~80 s: four two-rank runs
def test_a_sharded_two_rank_run_checkpoints_to_the_url_and_resumes_from_it_bitwise(workdir, tmp_path, s3):
    """FSDP2 on 2 gloo ranks with checkpoint.format sharded: every rank's pieces reach the URL under the marker, and
    after the local checkpoints are lost the same two ranks resume from the download with bitwise the losses of
    the same run resumed from its local disk (each run: steps 1-4, then the same command to step 6)."""
    opts, _ = s3
    url = f"s3://{BUCKET}/sharded/checkpoints"
    sharded = {"every": 2, "keep_last": 3, "keep_best": False, "format": "sharded"}
    remote_ckpt = {**sharded, "dir": url, "storage_options": opts}

    def two_runs(out, checkpoint, between=lambda: None) -> str:
        for steps in (4, 6):
            if steps == 6:
                between()
            cfg = write_config(tmp_path / f"{out.name}-{steps}.yaml", out, parallel={"mode": "fsdp"},
                               train={"max_steps": steps}, checkpoint=checkpoint)
            said = finish(launch(cfg, nproc=2))
        return said

    reference = clone(workdir, tmp_path / "ref")
    two_runs(reference, sharded)
    remote = RemoteCheckpoints(url, opts)

    def lose_the_disk():  # the nodes' disks are gone: the resume downloads step 4 from the URL
        assert remote.steps() == [2, 4] and all(remote.committed(s)[1] is None for s in (2, 4))
        names = {p.rsplit("/", 1)[-1] for p in remote.fs.ls(f"{url}/step-00000004".removeprefix("s3://"))}
        assert {"model-00000.safetensors", "model-00001.safetensors", "optimizer-00000.safetensors",
                "optimizer-00001.safetensors", MARKER, "manifest.json"} <= names
        import shutil

        shutil.rmtree(workdir / "run" / "checkpoints")

    out = two_runs(workdir, remote_ckpt, lose_the_disk)
    assert "resumed from" in out and "step-00000004 (step 4)" in out
    assert len(losses(workdir)) == 6 and losses(workdir) == losses(reference)
    assert remote.steps() == [2, 4, 6]
