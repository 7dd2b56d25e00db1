"""Every shard byte trained on is checked against the manifest, without a start-up pass over the corpus.

At start (`SplitVerifier(...)`, cheap: a stat and a header per file): each `.bin` and `.idx` of the split
is listed in manifest.json with the size it has, every `.bin` header agrees with the manifest (sample
length, tokenizer, vocabulary), and every `.idx` header promises the entries its size holds. When a shard
is first opened (`verify(k)`, called by `ShardSet` on first use, so in the loader's prefetch thread before
the batch that needs it is served), its `.bin` and `.idx` are hashed against the manifest's sha256, and
its tokens are checked to lie inside the vocabulary, in one streaming pass (memory: one 8 MiB block).
A mismatch raises `IntegrityError` naming the file. Remote shards are verified by the cache as they
download (`kiln.shards.remote`), so this is for local folders.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

from kiln.errors import IntegrityError
from kiln.manifest import MANIFEST, sha256_file
from kiln.names import listed_name

BLOCK = 8 << 20  # a multiple of every token width, and of the 64-byte header


class SplitVerifier:
    def __init__(self, folder: Path, manifest: dict, names: list[str]) -> None:
        from kiln.shards.format import read_header, read_index_header

        self.folder, self.manifest, self.names = Path(folder), manifest, names
        self.files = manifest["files"]
        self.headers = []
        for name in names:
            for listed in (name, _idx(name)):
                self._check_size(listed)
            header = read_header(self.folder / name)
            expected = (int(manifest["sample_len"]), manifest["tokenizer_sha256"], int(manifest["vocab_size"]))
            if (header.sample_len, header.tokenizer_sha256, header.vocab_size) != expected:
                raise IntegrityError(f"{self.folder / name}: header does not match manifest.json (sample length or "
                                     f"tokenizer, or vocabulary)")
            read_index_header(self.folder / _idx(name))
            self.headers.append(header)
        self._verified: set[int] = set()
        self._lock = threading.Lock()

    def _check_size(self, name: str) -> None:
        path = listed_name(self.folder, name, self.files, self.folder / MANIFEST)
        meta = self.files[name]
        if not path.is_file():
            raise IntegrityError(f"{path}: listed in {MANIFEST} but missing; re-run `kiln pack`")
        if path.stat().st_size != meta["size"]:
            raise IntegrityError(f"{path}: {path.stat().st_size} bytes, {MANIFEST} says {meta['size']}; the file is "
                                 f"cut or changed, re-run `kiln pack`")

    def verify(self, k: int) -> None:
        """Hash shard k's files and check its tokens, once per process."""
        if k in self._verified:
            return
        with self._lock:
            if k in self._verified:
                return
            name = self.names[k]
            self._hash_bin(name, self.headers[k].vocab_size)
            path = self.folder / _idx(name)
            digest = sha256_file(path, BLOCK)
            if digest != self.files[_idx(name)]["sha256"]:
                raise IntegrityError(f"{path}: sha256 {digest[:16]}… != {MANIFEST}; the index changed after "
                                     f"`kiln pack` wrote it, re-run `kiln pack`")
            self._verified.add(k)

    def _hash_bin(self, name: str, vocab: int) -> None:
        from kiln.shards.format import BIN_HEADER, token_dtype

        path, dtype = self.folder / name, token_dtype(vocab)
        h, top, at = hashlib.sha256(), -1, 0
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                h.update(block)
                tokens = np.frombuffer(block, dtype=dtype, offset=BIN_HEADER.size if at == 0 else 0)
                if len(tokens):
                    top = max(top, int(tokens.max()))
                at += len(block)
        if h.hexdigest() != self.files[name]["sha256"]:
            raise IntegrityError(f"{path}: sha256 {h.hexdigest()[:16]}… != {MANIFEST}; the shard changed after "
                                 f"`kiln pack` wrote it, re-run `kiln pack` (or `kiln shards verify` to check all)")
        if top >= vocab:
            raise IntegrityError(f"{path}: holds token id {top}, outside the vocabulary of {vocab}; the shard is "
                                 f"corrupt, re-run `kiln pack`")


def _idx(name: str) -> str:
    return name[: -len(".bin")] + ".idx" if name.endswith(".bin") else name + ".idx"

