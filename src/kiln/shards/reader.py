"""Reading the samples of one split of a shards folder (local, or any fsspec URL through a verified cache), each
shard memory-mapped when first sampled. The bytes are format.py's; a local shard is hashed on first use
(verify.py), a remote one as the cache downloads it (remote.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import read_manifest
from kiln.shards.format import BIN_HEADER, read_header, read_tokens, token_dtype
from kiln.shards.remote import RemoteFolder, ShardCache
from kiln.storage import is_url
from kiln.shards.verify import SplitVerifier


class LocalFolder:
    """A committed shards folder on this machine (the counterpart of remote.RemoteFolder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def read_manifest(self) -> dict:
        return read_manifest(self.folder)

    def local_path(self, name: str) -> Path:
        return self.folder / name


class ShardSet:
    """The samples of one split, memory-mapped: sample i is `sample_len` consecutive tokens.

    `folder` is a local path or any fsspec URL; a URL's shards are read through
    `cache` (verified by sha256 on first read) and opened only when first sampled.
    """

    def __init__(self, folder: Path | str, split: str, tokenizer_sha256: str | None = None,
                 cache: ShardCache | None = None, group: int | None = None) -> None:
        """`group`: only the files of the split's shard group at that index (manifest `groups`, see pack.py)."""
        self.location = str(folder).rstrip("/")
        if is_url(folder):
            if cache is None:
                raise KilnError(f"{folder}: shards at a URL are read through a local cache; set loader.cache_dir")
            self.source: LocalFolder | RemoteFolder = RemoteFolder(str(folder), cache)
        else:
            self.source = LocalFolder(Path(folder))
        self.manifest = self.source.read_manifest()
        if "splits" not in self.manifest and self.manifest.get("stage") not in (None, "pack"):  # docs, say
            raise KilnError(f"{folder}: a `kiln {self.manifest['stage']}` output, not token shards; give the folder "
                            "`kiln pack` wrote ({out_dir}/shards)")
        if (fmt := self.manifest.get("format", "kiln")) != "kiln":
            raise KilnError(f"{folder}: packed for {fmt} (pack.format: {fmt}), which kiln train does not read; pack "
                            "again with pack.format=kiln for Kiln's trainer")
        if split not in self.manifest.get("splits", {}):
            raise KilnError(f"{folder}: no '{split}' split in manifest.json; re-run `kiln pack`")
        if tokenizer_sha256 and self.manifest["tokenizer_sha256"] != tokenizer_sha256:
            raise KilnError(
                f"{folder}: shards were encoded with tokenizer {self.manifest['tokenizer_sha256'][:12]}…, "
                f"the run uses {tokenizer_sha256[:12]}…; re-run `kiln pack` with this tokenizer")
        self.sample_len = int(self.manifest["sample_len"])
        listed = self.manifest["splits"][split]
        self.names: list[str] = list(listed["files"] if group is None else listed["groups"][group]["files"])
        self._arrays: dict[int, np.ndarray] = {}
        self._paths: dict[int, Path] = {}
        if isinstance(self.source, LocalFolder):  # cheap: sizes and headers now, each file's hash on first use
            self.verifier: SplitVerifier | None = SplitVerifier(self.source.folder, self.manifest, self.names)
            counts = [h.num_tokens // self.sample_len for h in self.verifier.headers]
        else:  # the manifest's sizes, checked against each header when the shard is fetched (and hashed)
            self.verifier = None
            width = token_dtype(int(self.manifest["vocab_size"])).itemsize
            counts = [(self.source.listed(n)["size"] - BIN_HEADER.size) // width // self.sample_len for n in self.names]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def _array(self, k: int) -> np.ndarray:
        arr = self._arrays.get(k)
        if arr is not None:
            return arr
        name = self.names[k]
        if self.verifier is not None:
            self.verifier.verify(k)
        path = self.source.local_path(name)
        header = read_header(path)
        if header.sample_len != self.sample_len or header.tokenizer_sha256 != self.manifest["tokenizer_sha256"]:
            raise IntegrityError(
                f"{self.location}/{name}: header does not match manifest.json (sample length or tokenizer)"
            )
        arr = self._arrays[k] = np.asarray(read_tokens(path, header))  # a plain view slices faster than np.memmap
        self._paths[k] = path
        if not isinstance(self.source, LocalFolder):  # a bounded cache may have evicted others: stop holding their maps
            for j in [j for j, p in self._paths.items() if j != k and not p.is_file()]:
                del self._arrays[j], self._paths[j]
        return arr

    def __len__(self) -> int:
        return int(self.starts[-1])

    def sample(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, i, side="right") - 1)
        j = (i - int(self.starts[shard])) * self.sample_len
        return self._array(shard)[j: j + self.sample_len]

    def gather(self, indices: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        """out[rows[k]] = sample(indices[k]), converting to out's dtype in the one copy."""
        L = self.sample_len
        shards = np.searchsorted(self.starts, indices, side="right") - 1
        offsets = (indices - self.starts[shards]) * L
        rows = range(len(indices)) if rows is None else rows.tolist()
        arrays = self._arrays
        for r, k, j in zip(rows, shards.tolist(), offsets.tolist()):
            out[r] = (arrays.get(k) if k in arrays else self._array(k))[j: j + L]
