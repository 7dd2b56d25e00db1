"""Shared fixtures: the bundled sample crawl, small synthetic WARCs, and one prepared corpus per session."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest

from kiln.config import build_config

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_WARC = ROOT / "examples" / "data" / "sample.warc.gz"

# Small enough for a 2-core CI machine, big enough that the loss can fall.
TINY = {
    "seed": 7,
    "data": {"min_chars": 200, "workers": 1},
    "tokenizer": {"vocab_size": 1024},
    "pack": {"seq_len": 64, "val_fraction": 0.1, "samples_per_shard": 2000},
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
    "train": {"max_steps": 20, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2, "eval_every": 10,
              "eval_batches": 2, "log_every": 5, "threads": 1},
    "checkpoint": {"every": 5, "keep_last": 10},
}


def tiny_config(out_dir: Path, **sections):
    """The TINY config with `out_dir` and any section overrides, e.g. train={"max_steps": 4}."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    data["out_dir"] = str(out_dir)
    data["data"] = {**data["data"], "inputs": [str(SAMPLE_WARC)]}
    return build_config(data)


def html_page(body: str, title: str = "page", charset: str = "utf-8") -> bytes:
    page = f'<html><head><meta charset="{charset}"><title>{title}</title></head>'
    page += f"<body><article>{body}</article></body></html>"
    return page.encode(charset, "replace")


def write_warc(path: Path, pages: list[tuple[str, bytes, str]]) -> Path:
    """A real gzipped WARC with a request and a response record per (url, payload, content_type)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=True)
        for url, payload, ctype in pages:
            req = StatusAndHeaders("GET / HTTP/1.1", [("Host", url.split("/")[2])], is_http_request=True)
            w.write_record(w.create_warc_record(url, "request", http_headers=req))
            headers = StatusAndHeaders(
                "200 OK", [("Content-Type", ctype), ("Content-Length", str(len(payload)))], protocol="HTTP/1.1"
            )
            rec = w.create_warc_record(url, "response", payload=io.BytesIO(payload), http_headers=headers)
            w.write_record(rec)
    return path


def warc_pages(path: Path, keep=lambda url: True) -> list[tuple[str, bytes]]:
    """(URL, HTTP body) of the response records of a WARC whose URL `keep` accepts."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with open(path, "rb") as f:
        return [
            (r.headers.get("WARC-Target-URI"), r.reader.read())
            for r in ArchiveIterator(f, record_types=WarcRecordType.response)
            if keep(r.headers.get("WARC-Target-URI"))
        ]


def english_pages() -> list[tuple[str, bytes]]:
    """The sample's English pages, index pages left out."""
    return warc_pages(SAMPLE_WARC, lambda url: url.endswith(".en.html") and "index" not in url)


@pytest.fixture(scope="session")
def sample_warc() -> Path:
    assert SAMPLE_WARC.is_file(), "examples/data/sample.warc.gz is missing"
    return SAMPLE_WARC


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """Config whose out_dir holds docs/, tokenizer/ and shards/ built from the sample (read-only for tests)."""
    from kiln.stages import run_data_stage, run_pack_stage, run_tokenizer_stage

    cfg = tiny_config(tmp_path_factory.mktemp("prepared") / "out")
    quiet = lambda *_: None  # noqa: E731
    run_data_stage(cfg, quiet)
    run_tokenizer_stage(cfg, quiet)
    run_pack_stage(cfg, quiet)
    return cfg



@pytest.fixture
def workdir(prepared, tmp_path) -> Path:
    """A fresh out_dir holding the prepared tokenizer and shards (training writes run/ beside them)."""
    out = tmp_path / "out"
    for name in ("tokenizer", "shards"):
        shutil.copytree(prepared.out / name, out / name)
    return out


def _torchrun(nproc: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def torchrun_script(script: Path, *args, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 300):
    """`python -m torch.distributed.run --standalone --nproc_per_node=NPROC SCRIPT ARGS` from the repo root, output
    captured, each rank with one OpenMP thread and faulthandler on (a rank that dies in native code prints its
    Python stack).

    A rank killed by a signal runs the script once more, with a warning that shows the first attempt's output: CI
    saw gloo ranks end in SIGABRT ("terminate called without an active exception") in torch's teardown after the
    script's work was done (here: 1 run in 15 on 2 loaded cores, 1 in 80 after destroy_process_group). A wrong
    result, an exception or a timeout still fails at once. So a script run here must give the same result when
    run twice (it writes nothing, or writes over what it wrote)."""
    import subprocess
    import warnings

    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [*_torchrun(nproc), str(script), *map(str, args)]
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or attempt == 2 or not killed_by_a_signal(proc.stderr):
            return proc
        warnings.warn(f"{script.name}: a rank was killed by a signal, running it once more:\n{proc.stderr[:3000]}")


def killed_by_a_signal(torchrun_stderr: str) -> bool:
    """torchrun's summary names each failed rank's exit code; a negative one is a signal (-6 SIGABRT, -11 SIGSEGV),
    except SIGTERM (-15), which torchrun sends the other ranks after the first one fails."""
    import re

    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", torchrun_stderr)}
    return any(c < 0 and c != -15 for c in codes)


def torchrun_kiln(*args, env: dict[str, str], nproc: int = 2, timeout: float = 300):
    """`python -m torch.distributed.run --standalone --nproc_per_node=NPROC -m kiln ARGS`, run from the repo root,
    output captured: the launch every multi-rank CLI test uses."""
    import subprocess

    return subprocess.run([*_torchrun(nproc), "-m", "kiln", *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def assert_trained_alike(a: dict, b: dict) -> None:
    """Two runs' weights after the same steps under layouts that sum in another order (pp, tp against one process):
    every element within rtol 1e-2 / atol 1e-4 but a handful. Adam moves an element by about lr whatever the size
    of its gradients, so in the rows of tokens seen once or twice float noise can turn a step: a few embedding
    elements end up a few lr apart (at most 1.2e-3 seen), at most 1e-4 of a tensor's elements, each under 5e-3."""
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        off = ~torch.isclose(a[k], b[k], rtol=1e-2, atol=1e-4)
        assert off.sum() <= 1e-4 * off.numel() and (a[k] - b[k]).abs().max() < 5e-3, (k, int(off.sum()))
