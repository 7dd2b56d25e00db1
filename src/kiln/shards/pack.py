"""Encode documents, split train/val by a hash of the document id, pack them into shards.

Each split is one token stream: the packer (`pack.mode`, see packing.py) turns
documents, each followed by EOS, into samples of `seq_len + 1` tokens (inputs
and shifted targets); the writer cuts the stream into shards of
`samples_per_shard` samples. A concat tail shorter than one sample is dropped
and counted. Each shard's document provenance goes into its side file
(provenance.py), not the manifest, and the files' sizes and hashes and each
split's shard list into `files.jsonl` (format.py), so manifest.json's size
depends on neither the number of documents nor that of shards.

Memory: documents stream through (the docs parts are read one at a time); a split
holds the packer's window, less than one sample of tokens, and the provenance rows
of the documents whose tokens are not all written yet: shards are streamed to disk
as they fill (writer.py), so not even one shard is held, whatever its size. Nothing
grows with the corpus except per-source token counts (one number per input file).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import xxhash

from kiln.config import PackConfig
from kiln.errors import KilnError
from kiln.manifest import FileList, staging_dir, write_manifest, writes_folder
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


def data_weight(train_tokens: dict[str | None, int], source_weights: dict[str, dict] | None) -> float:
    """The data stage's sampling weight for these shards: its per-source weights averaged over the
    training tokens ({source: tokens}; 1.0 when the data stage gave none)."""
    tokens = sum(train_tokens.values())
    if not source_weights or not tokens:
        return 1.0
    return sum(n * source_weights.get(src, {}).get("weight", 1.0) for src, n in train_tokens.items()) / tokens


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
                 source_weights: dict[str, dict] | None) -> None:
        self.folder, self.header, self.cfg, self.pad = folder, header, cfg, pad
        self.weights = {src: w["weight"] for src, w in (source_weights or {}).items() if w.get("weight", 1.0) < 1.0}
        self.own: dict[tuple[str, str], SplitWriter] = {}

    def writer(self, split: str, source: str | None, shared: dict[str, SplitWriter]) -> SplitWriter:
        if source not in self.weights:
            return shared[split]
        if (split, source) not in self.own:
            slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source)[-40:] + "-" + xxhash.xxh64_hexdigest(source.encode())[:8]
            self.own[split, source] = SplitWriter(self.folder, split, self.header, self.cfg.samples_per_shard,
                                                  make_packer(self.cfg, self.pad), prefix=slug + "-")
        return self.own[split, source]

    def close(self, shared: dict[str, SplitWriter]) -> dict[str, dict[str, Any]]:
        splits = {s: w.close() for s, w in shared.items()}
        for split in SPLITS:
            parts = [(None, 1.0, splits[split])] + [(src, self.weights[src], w.close())
                                                    for (s, src), w in sorted(self.own.items()) if s == split]
            if len(parts) == 1:
                continue
            merged = {k: ([f for *_, p in parts for f in p[k]] if k == "files" else sum(p[k] for *_, p in parts))
                      for k in splits[split]}
            merged["groups"] = [{"group": src, "weight": w, "files": p["files"], "samples": p["samples"]}
                                for src, w, p in parts if p["samples"]]  # the loader samples only groups with samples
            splits[split] = merged
        return splits


@writes_folder("pack", out="out", inputs=("docs", "tokenizer_dir"))
def pack(docs: Iterable[dict], tokenizer_dir: Path, out: Path, cfg: PackConfig, fingerprint: str = "",
         progress: bool | None = None, source_weights: dict[str, dict] | None = None) -> dict[str, Any]:
    """Encode and pack `docs` into `out` (committed atomically with its manifest). Returns the manifest.

    `progress`: a progress bar on stderr; None shows it when stderr is a terminal.
    """
    tok = load_tokenizer(tokenizer_dir)
    names = special_names(tokenizer_dir)  # a tokenizer of the user's own names its tokens in its manifest
    eos = eos_id(tok, names["eos_token"])
    # PAD only fills best_fit's gaps: a tokenizer without one packs `concat` with no pad id.
    has_pad = names["pad_token"] is not None and tok.token_to_id(names["pad_token"]) is not None
    pad = pad_id(tok, names["pad_token"]) if has_pad or cfg.mode == "best_fit" else None
    vocab = tok.get_vocab_size()
    dtype = token_dtype(vocab)
    tokenizer_file = tokenizer_file_of(tokenizer_dir)
    header = ShardHeader(dtype.itemsize, vocab, cfg.seq_len + 1, 0, tokenizer_sha256(tokenizer_dir))
    train_tokens: dict[str | None, int] = {}
    with staging_dir(out) as tmp, PackProgress(progress) as advance:
        groups = ShardGroups(tmp, header, cfg, pad, source_weights)
        writers = {s: SplitWriter(tmp, s, header, cfg.samples_per_shard, make_packer(cfg, pad)) for s in SPLITS}
        text_bytes, tokens_by_lang = {s: 0 for s in SPLITS}, Counter()  # for bytes/token and the report
        encoded = encode_documents(docs, tokenizer_file, cfg.batch_docs, cfg.workers, dtype, eos, advance)
        for number, (doc, ids) in enumerate(encoded):
            split = split_of(doc["id"], cfg.val_fraction)
            text_bytes[split] += len(doc["text"].encode("utf-8", "replace"))
            tokens_by_lang[doc.get("lang") or "unknown"] += len(ids)
            group = doc.get("source_group") or doc.get("source")
            groups.writer(split, group, writers).add(ids, number, {
                "id": doc["id"], "split": split, "source": doc.get("source"), "offset": doc.get("offset"),
                "length": doc.get("length"), "url": doc.get("url"),
                **({"source_group": doc["source_group"]} if "source_group" in doc else {})})
            if split == "train":
                train_tokens[group] = train_tokens.get(group, 0) + len(ids)
        splits = groups.close(writers)
        for info in splits.values():  # the shard lists go to the file table with the files (FILES_TABLE)
            info["files"] = FileList(info["files"])
            for shard_group in info.get("groups", ()):
                shard_group["files"] = FileList(shard_group["files"])
        if splits["train"]["samples"] == 0:
            raise KilnError(
                f"too few tokens to fill one training sample of {cfg.seq_len + 1}; lower pack.seq_len or add data"
            )
        manifest = write_manifest(
            tmp, stage="pack", fingerprint=fingerprint, format_version=FORMAT_VERSION, dtype=dtype.name,
            vocab_size=vocab, eos_id=eos, pad_id=pad, tokenizer_sha256=header.tokenizer_sha256, seq_len=cfg.seq_len,
            sample_len=cfg.seq_len + 1, mode=cfg.mode, splits=splits, packing_efficiency=packing_efficiency(splits),
            data_weight=round(data_weight(train_tokens, source_weights), 6),
            split_documents=sum(s["split_documents"] for s in splits.values()),
            documents=sum(s["documents"] for s in splits.values()), provenance=f"{{split}}/NNNNN{PROVENANCE}",
            tokens_by_lang=dict(tokens_by_lang.most_common()), text_bytes=text_bytes, table=FILES_TABLE,
        )
    return manifest


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
