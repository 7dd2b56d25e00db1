"""Shards behind any fsspec URL (s3://, gs://, file://, memory://), read through a local cache.

The cache is content-addressed: a file is stored under its sha256 only after
its bytes, hashed while downloading, match the remote manifest. A file found
in the cache was therefore verified on its first read and is not re-hashed.
The cache is bounded in size: the least recently used files go first. Several
processes may share one cache folder (files appear by atomic rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import FILE_TABLE, MANIFEST, expand_file_table, table_name
from kiln.names import check_name
from kiln.storage import filesystem

_CACHE_ENTRY = re.compile(r"[0-9a-f]{64}")


class RemoteFolder:
    """A committed shards folder at a URL: its manifest, and its files fetched into a ShardCache."""

    def __init__(self, url: str, cache: "ShardCache") -> None:
        self.url, self.cache = url.rstrip("/"), cache
        self.fs, self.root = filesystem(self.url)

    def read_manifest(self) -> dict[str, Any]:
        where = f"{self.url}/{MANIFEST}"
        try:
            with self.fs.open(f"{self.root}/{MANIFEST}", "rb") as f:
                manifest = json.loads(f.read())
        except FileNotFoundError:
            raise IntegrityError(
                f"{where}: not found; the folder was never committed (run `kiln pack`, then upload it)"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"{where}: not valid JSON ({exc}); re-upload the shards folder") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise IntegrityError(f"{where}: has no 'files' table; re-upload the shards folder")
        self.files = manifest["files"]
        if FILE_TABLE in manifest:  # the files are listed beside it (format.FILES_TABLE), read like the manifest
            name = check_name(table_name(manifest, where), where)
            try:
                with self.fs.open(f"{self.root}/{name}", "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise IntegrityError(f"{self.url}/{name}: listed in {MANIFEST} but missing; re-upload the shards "
                                     f"folder") from None
            manifest = expand_file_table(manifest, data, f"{self.url}/{name}")  # checked against its sha256
            self.files = manifest["files"]
        for name in self.files:  # plain names inside the folder (kiln.names; no symlinks at a URL to resolve)
            check_name(name, where)
        return manifest

    def listed(self, name: str) -> dict[str, Any]:
        """The manifest's size and sha256 of one file: what a fetched copy must match."""
        meta = self.files.get(name)
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("size"), int)
            or not isinstance(meta.get("sha256"), str)
        ):
            raise IntegrityError(f"{self.url}/{MANIFEST}: its 'files' table has no size and sha256 for {name}; "
                                 f"re-upload the whole shards folder as `kiln pack` wrote it")
        return meta

    def local_path(self, name: str) -> Path:
        meta = self.listed(name)
        return self.cache.fetch(self.fs, f"{self.root}/{name}", f"{self.url}/{name}", meta["size"], meta["sha256"])


class ShardCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), int(max_bytes)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def fetch(self, fs, remote_path: str, url: str, size: int, sha256: str) -> Path:
        local = self.path_for(sha256)
        if local.is_file():
            os.utime(local)  # recency for eviction
            return local
        if size > self.max_bytes:
            raise KilnError(
                f"{url}: {size:,} bytes do not fit the shard cache of {self.max_bytes:,}; raise loader.cache_max_gb"
            )
        self._make_room(size)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{sha256}.tmp-{uuid.uuid4().hex[:8]}")
        h, got = hashlib.sha256(), 0
        try:
            with fs.open(remote_path, "rb") as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 22):
                    h.update(block)
                    dst.write(block)
                    got += len(block)
            if got != size or h.hexdigest() != sha256:
                raise IntegrityError(
                    f"{url}: {got} bytes with sha256 {h.hexdigest()[:16]}…, manifest.json says {size} bytes "
                    f"with {sha256[:16]}…; the remote copy is corrupt, re-upload it"
                )
            os.replace(tmp, local)
        except FileNotFoundError:
            raise IntegrityError(f"{url}: listed in manifest.json but missing; re-upload the shards folder") from None
        finally:
            tmp.unlink(missing_ok=True)
        return local

    def _make_room(self, size: int) -> None:
        # Only the cache's own entries (SHA256/, named by their hash): loader.cache_dir may be a folder with
        # other files.
        files = [p for p in self.root.glob("*/*") if p.is_file() and _CACHE_ENTRY.fullmatch(p.name)
                 and p.parent.name == p.name[:2]]
        stats = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in files), key=lambda t: (t[0], t[2].name))
        used = sum(s for _, s, _ in stats)
        for _, s, p in stats:
            if used + size <= self.max_bytes:
                break
            p.unlink(missing_ok=True)  # an open memory map of it stays valid until closed
            used -= s
