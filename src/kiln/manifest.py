"""Atomic outputs and the manifests that vouch for them.

Every committed folder (docs/, tokenizer/, shards/, a checkpoint) carries a
`manifest.json` listing each file's size and sha256, written last. A folder is
built under a temporary name and renamed into place only after its manifest is
written, so a reader never sees half a folder. Readers trust only what the
manifest vouches for and verify it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kiln import __version__
from kiln.errors import IntegrityError

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file under a temporary name in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def write_manifest(folder: Path, **fields: Any) -> dict[str, Any]:
    """List every file under `folder` (size, sha256) plus `fields`; written last and atomically."""
    folder = Path(folder)
    fsync_tree(folder)
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    }
    manifest = {"kiln_version": __version__, **fields, "files": files}
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=False))
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{folder}: no {MANIFEST}; the folder was never committed (re-run the stage that writes it)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: not valid JSON ({exc}); the folder is corrupt, re-run the stage") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(f"{path}: has no 'files' table; the folder is corrupt, re-run the stage")
    return manifest


def verify_folder(folder: Path, deep: bool = True, only: set[str] | None = None) -> dict[str, Any]:
    """Check every file the manifest lists, or those in `only` (size, and sha256 when deep). Raise naming the
    first bad file."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    for name, meta in manifest["files"].items():
        if only is not None and name not in only:
            continue
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise IntegrityError(f"{path}: size {size} != {meta['size']} in {MANIFEST}")
        if deep:
            digest = sha256_file(path)
            if digest != meta["sha256"]:
                raise IntegrityError(f"{path}: sha256 {digest[:16]}… != {meta['sha256'][:16]}… in {MANIFEST}")
    return manifest


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it replaces `final` (rename, parent fsync)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def is_complete(folder: Path, fingerprint: str) -> bool:
    """A stage output is reusable when its manifest verifies and was made from the same inputs."""
    try:
        manifest = verify_folder(folder)
    except IntegrityError:
        return False
    return manifest.get("fingerprint") == fingerprint
