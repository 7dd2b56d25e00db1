"""Names read from Kiln's own files: the one check every reader uses before it opens what a name says.

Resolve a name read from a Kiln file inside its folder, or raise IntegrityError naming the file and the entry.

A Kiln file that names other files (a manifest's `files`, a file table's rows, a split's shard list, a
checkpoint's piece indexes, a dedup index's run list, a provenance side file, an HF index's `weight_map`)
is trusted only as far as a hash covers it. So such a name must be a plain relative name inside the folder
the file describes: a non-empty POSIX path, not absolute, no empty, `.` or `..` part, no backslash or NUL,
and no symlink along it that resolves outside the folder. `resolve_name(folder, name, where)` checks that
and gives `folder / name`; `listed_name` also requires the name to be listed (size and sha256) in the
folder's manifest, so the manifest's hash (and its signature) covers what is read. Anything else is a
one-line `IntegrityError` naming `where` (the file that holds the name) and the entry, before anything
outside the folder is opened (the checks resolve symlinks with `lstat`/`readlink`, never `open`).

`check_name` is the syntax alone (no file system), for names that are not on local disk (fsspec URLs).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from kiln.errors import IntegrityError


def _refuse(where: Path | str, name: object, why: str) -> IntegrityError:
    return IntegrityError(f"{where}: the entry {name!r} {why}; Kiln reads only plain names inside the folder that "
                          f"its manifest lists and hashes: the folder was changed after Kiln wrote it, re-run the "
                          f"stage that wrote it (or restore it from a copy)")


def check_name(name: object, where: Path | str) -> str:
    """`name` when it is a plain relative POSIX name (syntax only: no file system access), else IntegrityError."""
    if not isinstance(name, str) or not name:
        raise _refuse(where, name, "is not a file name")
    if "\\" in name or "\0" in name:
        raise _refuse(where, name, "holds a backslash or NUL")
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        raise _refuse(where, name, "is an absolute path")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise _refuse(where, name, "leaves its folder (an empty, '.' or '..' part)")
    return name


def resolve_name(folder: Path | str, name: object, where: Path | str) -> Path:
    """`folder / name` for a name read from the Kiln file `where`, once it is a plain relative name and no
    symlink along it leads outside `folder` (a name that does not exist yet is fine: the caller's open fails)."""
    folder = Path(folder)
    name = check_name(name, where)
    path = folder / name
    if not any(p.is_symlink() for p in _steps(folder, name)):
        return path
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip("/") + "/"):
        raise _refuse(where, name, f"is a symlink that leads outside {folder} (to {real})")
    return path


def _steps(folder: Path, name: str) -> list[Path]:
    """folder/a, folder/a/b, ...: each step of a name (the links an `open` would follow)."""
    parts, steps = name.split("/"), []
    for k in range(1, len(parts) + 1):
        steps.append(folder.joinpath(*parts[:k]))
    return steps


def listed_name(folder: Path | str, name: object, files: Mapping[str, Any], where: Path | str) -> Path:
    """`resolve_name`, and `name` must be one of the manifest's `files` (with size and sha256), so that the
    manifest's hash covers what is read; else IntegrityError naming `where` and the entry."""
    path = resolve_name(folder, name, where)
    meta = files.get(name)
    if not (isinstance(meta, Mapping) and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)):
        raise _refuse(where, name, f"is not listed with its size and sha256 in {Path(folder) / 'manifest.json'}")
    return path
