"""Encode documents, split train/val by a hash of the document id, pack them into shards: in tasks.

A docs folder is packed in tasks, each a fixed range of `pack.task_parts` docs parts, so the partition depends on
the docs folder and the config, never on the workers or the engine. A task (`pack_range`, on a worker) encodes
its documents in order (encode.py), splits them by id hash, packs each split's stream (`pack.mode`, packing.py)
and streams it into shards of its own (writer.py, provenance.py) in the work folder beside the output,
`.NAME-work-<key>/task-KKKKK/`, then hashes and fsyncs them; the driver writes `task-KKKKK.done.json` (each
file's size, sha256 and xxh3) when the task's summary comes back. Tasks run on the data stage's engine
(kiln.tasks.executor): a local pool of `pack.workers` spawned processes, or Ray (`pack.executor: ray`; the work
folder on storage every node mounts). A re-run (after kill -9, say) redoes only the tasks without a marker that
still matches their files. The final step (`assemble`) links every task's files into the staging folder under
global names, `{split}/NNNNN.bin` numbered in task order (a shard group's `{split}/{slug}-NNNNN.bin` likewise),
and writes `files.jsonl` and manifest.json from the summaries, reading no shard. The shards are byte-identical
for any number of workers, on either engine, and after any number of interruptions.

A document's number (an `.idx` entry's `doc`, its provenance row's) is its place in the docs folder, both splits
counted: a task's first is its first part's index times the folder's `docs_per_part`. Each task's streams end
with it: a concat tail shorter than one sample is dropped per task and counted in `dropped_tail_tokens` (under
seq_len + 1 tokens a task and split), best_fit packs its last window per task. Each split's shard lists and the
files' sizes and hashes go to `files.jsonl` (format.py) and each shard's provenance to its side file, so
manifest.json's size depends on neither the documents nor the shards.

Any other iterable of documents is one task, run in this process with `pack.workers` spawned encoders taking
chunks in order (encode.py); its shards are those of a docs folder packed as one task.

Memory: a task holds the packer's window, less than one sample of tokens, and the provenance rows of the
documents whose tokens are not all written yet (shards are streamed to disk as they fill: not even one is
held, whatever its size); the driver, each task's summary (its counts and shard names) until the manifest is
written. Nothing grows with the documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import xxhash

from kiln.config import PackConfig
from kiln.data.docs import DocsReader
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import FileList, sha256_file, staging_dir, write_atomic, write_manifest, writes_folder
from kiln.shards import external
from kiln.shards.encode import encode_documents
from kiln.shards.format import FILES_TABLE, FORMAT_VERSION, ShardHeader, token_dtype
from kiln.shards.packing import make_packer
from kiln.shards.provenance import SUFFIX as PROVENANCE
from kiln.shards.writer import SplitWriter
from kiln.tokenizer import eos_id, load_tokenizer, pad_id, special_names, tokenizer_sha256
from kiln.tokenizer import tokenizer_file as tokenizer_file_of

SPLITS = ("train", "val")


def split_of(doc_id: str, val_fraction: float) -> str:
    """Stable per document: adding documents never moves an existing one to the other split."""
    return "val" if xxhash.xxh64_intdigest(doc_id.encode()) / 2**64 < val_fraction else "train"


def packing_efficiency(splits: dict[str, dict[str, Any]]) -> float:
    """Document tokens in samples over all the tokens packing produced (padding and the dropped tail are waste)."""
    tokens = sum(s["tokens"] for s in splits.values())
    waste = sum(s["pad_tokens"] for s in splits.values())
    dropped = sum(s["dropped_tail_tokens"] for s in splits.values())
    return round((tokens - waste) / max(tokens + dropped, 1), 6)


def data_weight(train_tokens: int, weighted_tokens: float) -> float:
    """The data stage's sampling weight for these shards: its per-source weights averaged over the training tokens
    (`weighted_tokens`: each document's train tokens times its source's weight; 1.0 without tokens)."""
    return weighted_tokens / train_tokens if train_tokens else 1.0


def group_prefix(source: str | None) -> str:
    """A shard group's file prefix: `{slug}-` (the plain shards: none)."""
    if source is None:
        return ""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", source)[-40:] + "-" + xxhash.xxh64_hexdigest(source.encode())[:8] + "-"


class ShardGroups:
    """Per-source shard groups, so the loader can sample a down-weighted source less (train/data.py).

    Every source the data stage's distribution gate gave a weight below 1 gets its own writers (files
    `{split}/{slug}-NNNNN.bin`); all the others share the plain ones, since the loader's sampling depends
    only on the weight, and a group per source would cost a dropped tail and a shard per source. Without
    a down-weighted source the shards are exactly the ungrouped ones. A split's manifest then lists every
    file as before, plus `groups`: [{group, weight, files, samples}] (group null: the weight-1 sources).
    Memory: each down-weighted source's writers buffer up to a shard each, so the gate's few drifting
    sources are cheap; a key giving thousands of them wants a coarser `data.distribution.source_key`.
    """

    def __init__(self, folder: Path, header: ShardHeader, cfg: PackConfig, pad: int | None,
                 weights: dict[str, float]) -> None:
        self.folder, self.header, self.cfg, self.pad, self.weights = folder, header, cfg, pad, weights
        self.own: dict[tuple[str, str], SplitWriter] = {}

    def writer(self, split: str, source: str | None, shared: dict[str, SplitWriter]) -> SplitWriter:
        if source not in self.weights:
            return shared[split]
        if (split, source) not in self.own:
            self.own[split, source] = split_writer(self.folder, split, self.header, self.cfg, self.pad,
                                                   group_prefix(source))
        return self.own[split, source]

    def close(self, shared: dict[str, SplitWriter]) -> dict[str, list]:
        """{split: [(group, weight, the writer's counts and files)]}, the plain writer first, then the groups by
        source (`assemble` puts the tasks' together)."""
        return {split: [(None, 1.0, shared[split].close())]
                + [(src, self.weights[src], w.close()) for (s, src), w in sorted(self.own.items()) if s == split]
                for split in SPLITS}


@dataclass(frozen=True)
class PackSpec:
    """What every task needs besides its documents."""
    tokenizer_file: str
    header: ShardHeader
    eos: int
    pad: int | None
    cfg: PackConfig
    weights: dict[str, float]  # the sources the data stage weighted below 1; the others weigh 1
    threads: int = 0  # the tokenizers library's threads in a worker process (0: its default; a Ray task: 1)

    @classmethod
    def of(cls, tokenizer_dir: Path, cfg: PackConfig, source_weights: dict[str, dict] | None) -> "PackSpec":
        tok = load_tokenizer(tokenizer_dir)
        names = special_names(tokenizer_dir)  # a tokenizer of the user's own names its tokens in its manifest
        eos = eos_id(tok, names["eos_token"])
        # PAD only fills best_fit's gaps: a tokenizer without one packs `concat` with no pad id.
        has_pad = names["pad_token"] is not None and tok.token_to_id(names["pad_token"]) is not None
        pad = pad_id(tok, names["pad_token"]) if has_pad or cfg.mode == "best_fit" else None
        vocab = tok.get_vocab_size()
        tokenizer_file = tokenizer_file_of(tokenizer_dir)
        header = ShardHeader(token_dtype(vocab).itemsize, vocab, cfg.seq_len + 1, 0, tokenizer_sha256(tokenizer_dir))
        weights = {src: w["weight"] for src, w in (source_weights or {}).items() if w.get("weight", 1.0) < 1.0}
        return cls(str(tokenizer_file), header, eos, pad, cfg, weights)

    @property
    def dtype(self) -> np.dtype:
        """The tokens' dtype: Kiln's shards' (format.token_dtype), or the rule of the trainer they are for."""
        fmt, vocab = self.cfg.format, self.header.vocab_size
        return token_dtype(vocab) if fmt == "kiln" else external.token_dtype(fmt, vocab)


def split_writer(folder: Path, split: str, header: ShardHeader, cfg: PackConfig, pad: int | None,
                 prefix: str = "") -> SplitWriter | external.DocWriter:
    """One split's (or shard group's) writer in a task: Kiln's packed shards, or whole documents for another
    trainer's format (external.py)."""
    if cfg.format != "kiln":
        return external.DocWriter(folder, split, external.token_dtype(cfg.format, header.vocab_size), prefix)
    return SplitWriter(folder, split, header, cfg.samples_per_shard, make_packer(cfg, pad), prefix=prefix)


def write_shards(encoded: Iterable[tuple[dict, np.ndarray]], first: int, folder: Path, spec: PackSpec) -> dict:
    """One task's documents (with their ids + EOS, in order; the first numbered `first`) packed into shards of
    its own under `folder`; returns its summary (`assemble` reads it)."""
    cfg = spec.cfg
    groups = ShardGroups(folder, spec.header, cfg, spec.pad, spec.weights)
    writers = {s: split_writer(folder, s, spec.header, cfg, spec.pad) for s in SPLITS}
    text_bytes, tokens_by_lang = {s: 0 for s in SPLITS}, Counter()  # for bytes/token and the report
    train_tokens, weighted = 0, 0.0
    number = first
    for number, (doc, ids) in enumerate(encoded, first):
        split = split_of(doc["id"], cfg.val_fraction)
        text_bytes[split] += len(doc["text"].encode("utf-8", "replace"))
        tokens_by_lang[doc.get("lang") or "unknown"] += len(ids)
        group = doc.get("source_group") or doc.get("source")
        groups.writer(split, group, writers).add(ids, number, {
            "id": doc["id"], "split": split, "source": doc.get("source"), "offset": doc.get("offset"),
            "length": doc.get("length"), "url": doc.get("url"),
            **({"source_group": doc["source_group"]} if "source_group" in doc else {})})
        if split == "train":
            train_tokens += len(ids)
            weighted += len(ids) * spec.weights.get(group, 1.0)
    return {"splits": groups.close(writers), "text_bytes": text_bytes, "tokens_by_lang": dict(tokens_by_lang),
            "train_tokens": train_tokens, "weighted_tokens": weighted}


def _file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` (a task's shards): size, sha256 (for the manifest) and xxh3 (for the marker),
    each fsynced, since the manifest takes these as given (write_manifest's `hashed`)."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        sha, xxh, size = hashlib.sha256(), xxhash.xxh3_128(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                sha.update(block)
                xxh.update(block)
                size += len(block)
            os.fsync(f.fileno())
        out[path.relative_to(folder).as_posix()] = {"size": size, "sha256": sha.hexdigest(), "xxh3": xxh.hexdigest()}
    return out


# --- tasks over a docs folder --------------------------------------------------------------------

WORK_LAYOUT = 1  # what a pack task leaves in the work folder
EXECUTION_KEYS = {"workers", "executor", "ray_address", "ray_connect_timeout_s"}  # how pack runs, not what it writes


@dataclass(frozen=True)
class PackTask:
    index: int
    folder: str  # the docs folder
    parts: tuple[tuple[str, str, int | None], ...]  # (name, sha256, documents it must hold: None for the last)
    first: int  # the number of its first document

    @property
    def name(self) -> str:
        return f"task-{self.index:05d}"


def plan(docs: DocsReader, cfg: PackConfig) -> tuple[list[PackTask], str]:
    """The tasks over a docs folder's parts, `pack.task_parts` each, and the docs manifest's sha256."""
    manifest, parts = docs.parts()
    per_part = manifest.get("docs_per_part")
    if per_part is None:  # a docs folder written before it was recorded: the first part is full
        per_part = sum(1 for _ in docs.part(parts[0], manifest["files"][parts[0]]["sha256"])) if len(parts) > 1 else 0
    rows = [(name, manifest["files"][name]["sha256"], per_part if k < len(parts) - 1 else None)
            for k, name in enumerate(parts)]
    tasks = [PackTask(t, str(docs.folder), tuple(rows[a:a + cfg.task_parts]), a * per_part)
             for t, a in enumerate(range(0, len(rows), cfg.task_parts))]
    return tasks, sha256_file(docs.folder / "manifest.json")


def _documents(task: PackTask) -> Iterator[dict]:
    reader = DocsReader(Path(task.folder))
    for name, sha, expected in task.parts:
        n = 0
        for n, doc in enumerate(reader.part(name, sha), 1):
            yield doc
        if expected is not None and n != expected:
            raise IntegrityError(f"{Path(task.folder) / name}: {n} documents, not the docs folder's docs_per_part "
                                 f"({expected}); the folder changed after `kiln data` wrote it, run `kiln data` again")


def pack_range(job: tuple[PackTask, PackSpec, str]) -> dict[str, Any]:
    """One task, on a worker: its docs parts encoded and packed into shards of its own in the work folder
    (`work/task-KKKKK/`, made anew), each file hashed and fsynced; returns the summary the marker keeps."""
    task, spec, work = job
    if spec.threads:  # before this process's first encode: the library sizes its thread pool then
        os.environ.setdefault("RAYON_NUM_THREADS", str(spec.threads))
    folder = Path(work) / task.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        encoded = encode_documents(_documents(task), Path(spec.tokenizer_file), spec.cfg.batch_docs, 1, spec.dtype,
                                   spec.eos)
        summary = write_shards(encoded, task.first, folder, spec)
        files = _file_records(folder)
    except BaseException:  # a failed task leaves no half-written shards (on a full disk: their space back)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return summary | {"index": task.index, "files": files,
                      "documents": sum(info["documents"] for parts in summary["splits"].values()
                                       for *_, info in parts)}


def _check(job: tuple[str, PackTask]) -> tuple[int, bool]:
    """Does the task's marker still vouch for every file it lists (size and xxh3)? On a worker, like the data
    stage's resume check."""
    from kiln.data.vouch import matches

    work, task = job
    try:
        summary = json.loads((Path(work) / f"{task.name}.done.json").read_text())
        files = summary["files"]
        return task.index, isinstance(files, dict) and all(
            matches(Path(work) / task.name / name, rec) for name, rec in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return task.index, False


def run_pack_tasks(docs: DocsReader, spec: PackSpec, out: Path, advance=None) -> tuple[Path, list[dict]]:
    """Every task's summary, in task order, running those without a valid marker on the engine; returns the work
    folder too (removed once the shards are committed)."""
    from kiln.tasks.executor import engine, run_tasks

    cfg = spec.cfg
    tasks, docs_sha = plan(docs, cfg)
    settings = cfg.model_dump(mode="json", exclude=EXECUTION_KEYS)
    key = hashlib.sha256(json.dumps([docs_sha, spec.header.tokenizer_sha256, settings, sorted(spec.weights.items()),
                                     WORK_LAYOUT]).encode()).hexdigest()[:16]
    work = out.parent / f".{out.name}-work-{key}"
    with engine(cfg.executor, cfg.workers, cfg.ray_address, cfg.ray_connect_timeout_s, section="pack"):
        work.mkdir(parents=True, exist_ok=True)  # once Ray is there: a cluster that never answers leaves nothing
        marked = [(str(work), t) for t in tasks if (work / f"{t.name}.done.json").exists()]
        good = {i for i, ok in run_tasks(_check, marked, cfg.workers, cfg.executor, cfg.ray_address) if ok}
        todo = [t for t in tasks if t.index not in good]
        if cfg.executor == "local" and cfg.workers > 1:  # the cores shared out among the processes that run
            spec = replace(spec, threads=max(1, (os.cpu_count() or 1) // min(cfg.workers, max(len(todo), 1))))
        jobs, committed = [(t, spec, str(work)) for t in todo], set()
        results = run_tasks(pack_range, jobs, cfg.workers, cfg.executor, cfg.ray_address, spawn=True)
        try:
            for summary in results:
                write_atomic(work / f"task-{summary['index']:05d}.done.json", json.dumps(summary))
                committed.add(summary["index"])
                if advance:
                    advance(summary["documents"], sum(summary["text_bytes"].values()))
        except BaseException:  # the workers ended first, then the files of every task not committed go
            getattr(results, "close", lambda: None)()
            for t in todo:
                if t.index not in committed:
                    shutil.rmtree(work / t.name, ignore_errors=True)
            raise
    return work, [json.loads((work / f"{t.name}.done.json").read_text()) for t in tasks]


# --- the final step ------------------------------------------------------------------------------

def assemble(tasks: list[tuple[Path, dict]], out: Path, move: bool = False,
             external_format: tuple[str, np.dtype] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """The tasks' files (each task's folder and summary, in task order) linked (`move`: renamed) into `out` under
    global names, numbered on per split and shard group in task order; returns the splits as the manifest lists
    them and every file's size and sha256 (write_manifest's `hashed`). Reads no shard. `external_format`
    (format, dtype): each split's and shard group's task files are streamed into one file set instead
    (external.concatenate)."""
    merged: dict[str, dict[str | None, dict[str, Any]]] = {s: {} for s in SPLITS}
    weights: dict[str | None, float] = {None: 1.0}
    hashed: dict[str, dict] = {}
    joined: dict[tuple[str, str | None], list[tuple[Path, str]]] = {}
    for folder, summary in tasks:
        for split, parts in summary["splits"].items():
            for group, weight, info in parts:
                weights[group] = weight
                into = merged[split].setdefault(group, {k: ([] if k == "files" else 0) for k in info})
                if external_format:
                    joined.setdefault((split, group), []).extend((folder, local) for local in info["files"])
                for local in [] if external_format else info["files"]:
                    name = f"{split}/{group_prefix(group)}{len(into['files']):05d}.bin"
                    into["files"].append(name)
                    for suffix in (".bin", ".idx", PROVENANCE):
                        src, dst = local.removesuffix(".bin") + suffix, name.removesuffix(".bin") + suffix
                        _place(folder / src, out / dst, move)
                        hashed[dst] = {k: summary["files"][src][k] for k in ("size", "sha256")}
                for k, v in info.items():
                    if k != "files":
                        into[k] += v
    for (split, group), files in joined.items():
        if files:
            fmt, dtype = external_format
            name = f"{split}/{group_prefix(group)}{external.STEM}{external.TOKENS[fmt]}"
            merged[split][group]["files"] = [name]
            hashed |= external.concatenate(files, out, name, fmt, dtype)
    splits = {}
    for split in SPLITS:
        parts = [(None, merged[split].get(None))] + sorted((g, p) for g, p in merged[split].items() if g is not None)
        plain = parts[0][1] or {"files": [], "tokens": 0, "samples": 0, "documents": 0, "dropped_tail_tokens": 0,
                                "split_documents": 0, "pad_tokens": 0}
        if len(parts) == 1:
            splits[split] = plain
            continue
        parts[0] = (None, plain)
        splits[split] = {k: ([f for _, p in parts for f in p[k]] if k == "files" else sum(p[k] for _, p in parts))
                         for k in plain}
        splits[split]["groups"] = [{"group": g, "weight": weights[g], "files": p["files"], "samples": p["samples"]}
                                   for g, p in parts if p["samples"]]  # the loader samples only groups with samples
    return splits, hashed


def _place(src: Path, dst: Path, move: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if move:
        os.replace(src, dst)
        return
    try:
        os.link(src, dst)  # the work folder keeps its files until the shards are committed
    except OSError:
        shutil.copyfile(src, dst)


@writes_folder("pack", out="out", inputs=("docs", "tokenizer_dir"))
def pack(docs: Iterable[dict], tokenizer_dir: Path, out: Path, cfg: PackConfig, fingerprint: str = "",
         progress: bool | None = None, source_weights: dict[str, dict] | None = None) -> dict[str, Any]:
    """Encode and pack `docs` (a docs folder's `DocsReader`: in tasks; any other iterable: as one task, here) into
    `out`, committed atomically with its manifest; returns the manifest. `source_weights`: the data stage's
    {source: row} (those below 1 get shard groups). `progress`: a progress bar on stderr; None shows it when
    stderr is a terminal."""
    spec = PackSpec.of(tokenizer_dir, cfg, source_weights)
    if cfg.executor == "ray":
        spec = replace(spec, threads=1)  # a Ray task has one CPU
    work = None
    with staging_dir(out) as tmp, PackProgress(progress) as advance:
        if isinstance(docs, DocsReader):
            work, summaries = run_pack_tasks(docs, spec, out, advance)
            tasks = [(work / f"task-{s['index']:05d}", s) for s in summaries]
        else:
            folder = tmp / ".task-00000"
            encoded = encode_documents(docs, Path(spec.tokenizer_file), cfg.batch_docs, cfg.workers, spec.dtype,
                                       spec.eos, advance)
            summary = write_shards(encoded, 0, folder, spec)
            tasks = [(folder, summary | {"files": _file_records(folder)})]
        splits, hashed = assemble(tasks, tmp, move=work is None,
                                  external_format=None if cfg.format == "kiln" else (cfg.format, spec.dtype))
        if work is None:
            shutil.rmtree(tmp / ".task-00000")
        manifest = _write_manifest(tmp, spec, fingerprint, splits, hashed, [s for _, s in tasks])
    if work is not None:  # this run's work folder, and any of an earlier plan for this folder (work_key's names)
        for stale in out.parent.glob(f".{out.name}-work-*"):
            if re.fullmatch(rf"\.{re.escape(out.name)}-work-[0-9a-f]{{16}}", stale.name):
                shutil.rmtree(stale, ignore_errors=True)
    return manifest


def _write_manifest(tmp: Path, spec: PackSpec, fingerprint: str, splits: dict[str, dict], hashed: dict[str, dict],
                    summaries: list[dict]) -> dict[str, Any]:
    cfg = spec.cfg
    if splits["train"]["samples"] == 0:
        raise KilnError(f"too few tokens to fill one training sample of {cfg.seq_len + 1}; lower pack.seq_len or add "
                        f"data")
    text_bytes = {s: sum(t["text_bytes"][s] for t in summaries) for s in SPLITS}
    tokens_by_lang: Counter[str] = Counter()
    for t in summaries:
        tokens_by_lang.update(t["tokens_by_lang"])
    train_tokens = sum(t["train_tokens"] for t in summaries)
    weighted = sum(t["weighted_tokens"] for t in summaries)
    for info in splits.values():  # the shard lists go to the file table with the files (FILES_TABLE)
        info["files"] = FileList(info["files"])
        for shard_group in info.get("groups", ()):
            shard_group["files"] = FileList(shard_group["files"])
    h = spec.header
    return write_manifest(
        tmp, hashed=hashed, stage="pack", fingerprint=fingerprint, format_version=FORMAT_VERSION,
        dtype=spec.dtype.name, vocab_size=h.vocab_size, eos_id=spec.eos, pad_id=spec.pad,
        tokenizer_sha256=h.tokenizer_sha256, seq_len=cfg.seq_len, sample_len=cfg.seq_len + 1, mode=cfg.mode,
        splits=splits, packing_efficiency=packing_efficiency(splits),
        data_weight=round(data_weight(train_tokens, weighted), 6),
        split_documents=sum(s["split_documents"] for s in splits.values()),
        documents=sum(s["documents"] for s in splits.values()),
        provenance=f"{{split}}/{'NNNNN' if cfg.format == 'kiln' else external.STEM}{PROVENANCE}",
        tokens_by_lang=dict(tokens_by_lang.most_common()), text_bytes=text_bytes, table=FILES_TABLE,
        **({} if cfg.format == "kiln" else {"format": cfg.format}),  # Kiln's own shards: as before, no key
    )


class PackProgress:
    """A rich progress line (documents, MB, MB/s); yields the `advance(documents, text_bytes)` callback or None."""

    def __init__(self, show: bool | None) -> None:
        from kiln.terminal import stderr_console

        self.console = stderr_console()
        self.show = self.console.is_terminal if show is None else show
        self.bar = None

    def __enter__(self):
        if not self.show:
            return None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            SpinnerColumn(finished_text="✓"),
            TextColumn(
                "pack: {task.fields[docs]:,} documents, {task.fields[mb]:,.1f} MB of text, {task.fields[rate]:.1f} MB/s"
            ),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.bar.start()
        task = self.bar.add_task("pack", total=None, docs=0, mb=0.0, rate=0.0)

        def advance(docs: int, text_bytes: int) -> None:
            t = self.bar.tasks[0]
            mb = t.fields["mb"] + text_bytes / 1e6
            self.bar.update(task, docs=t.fields["docs"] + docs, mb=mb, rate=mb / max(t.elapsed or 0, 1e-9))

        return advance

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.update(self.bar.task_ids[0], total=1, completed=1)  # the check mark, not a frozen spinner
            self.bar.stop()
