"""Atomic outputs and the manifests that vouch for them.

Every committed folder (docs/, tokenizer/, shards/, a checkpoint) carries a
`manifest.json` listing each file's size and sha256, written last. A folder is
built under a temporary name and renamed into place only after its manifest is
written, so a reader never sees half a folder. Readers trust only what the
manifest vouches for and verify it.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import inspect
import json
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from kiln import __version__
from kiln.errors import IntegrityError, KilnError
from kiln.names import check_name, resolve_name

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
    with writing_atomic(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def writing_atomic(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends (fsynced, renamed over it); an error in the
    block leaves `path` as it was and removes the temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # any failure (Ctrl-C too) leaves no temporary file; re-raised
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_tree(folder: Path, skip: Iterable[str] = ()) -> None:
    skip = set(skip)
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.relative_to(folder).as_posix() not in skip:
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def write_manifest(folder: Path, hashed: dict[str, dict] | None = None, table: str | None = None,
                   **fields: Any) -> dict[str, Any]:
    """List every file under `folder` (size, sha256) plus `fields`; written last and atomically.

    `hashed`: {name: {"size", "sha256"}} of files their writers already fsynced and hashed (the ranks of a
    sharded checkpoint, in parallel): taken as given instead of read again here.
    `table`: the name of a file table (see `FILE_TABLE`) that takes the files, and the `FileList`s among
    `fields`, out of manifest.json; the result is then what `read_manifest` gives back."""
    folder = Path(folder)
    hashed = hashed or {}
    fsync_tree(folder, skip=hashed)
    files = {
        name: hashed.get(name) or {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
        for name in [p.relative_to(folder).as_posix()]
    }
    if table is not None:
        return _write_with_table(folder, table, files, fields)
    manifest = {"kiln_version": __version__, **fields, "files": files}
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=False))
    return manifest


# --- a file table beside the manifest ---------------------------------------------------------------

FILE_TABLE = "file_table"  # manifest key: {"name": the table file, "files": its row count}


class FileList(list):
    """A list of file names in a manifest's fields that moves to the file table with the files
    (write_manifest's `table`): manifest.json keeps an empty list in its place, read_manifest refills it."""


def _write_with_table(folder: Path, table: str, files: dict[str, dict], fields: dict[str, Any]) -> dict[str, Any]:
    """A folder of many files (shards) keeps manifest.json's size independent of their number: `table`
    (JSON lines, one `{"name", "size", "sha256"}` row per file, and `"in": [path, ...]` naming the
    FileLists that hold it) lists them, and manifest.json lists only `table`, whose sha256 therefore
    vouches for every row, and records `file_table: {"name", "files"}`. Rows come in the FileLists'
    order (then the other files by name), so appending each row's name to its lists rebuilds them."""
    moved: list[tuple[list, list[str]]] = []  # (path inside the manifest, the names)

    def strip(node: Any, path: list) -> Any:
        if isinstance(node, FileList):
            moved.append((path, list(node)))
            return []
        if isinstance(node, dict):
            return {k: strip(v, path + [k]) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(v, path + [i]) for i, v in enumerate(node)]
        return node

    fields = strip(fields, [])
    files = {name: meta for name, meta in files.items() if name != table}  # an earlier table is rewritten
    paths: dict[str, list[list]] = {}
    for path, names in moved:
        for name in names:
            if name not in files:
                raise ValueError(f"{folder}: {name} is in a manifest list but not in the folder")
            paths.setdefault(name, []).append(path)
    order = list(paths) + [name for name in files if name not in paths]
    rows = [{"name": name, **files[name], **({"in": paths[name]} if name in paths else {})} for name in order]
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    manifest = {"kiln_version": __version__, **fields, FILE_TABLE: {"name": table, "files": len(rows)},
                "files": {table: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}
    text = json.dumps(manifest, indent=1, sort_keys=False)
    expanded = expand_file_table(json.loads(text), data, folder / table)
    for path, names in moved:  # a list whose order the rows cannot give is the caller's bug: never commit it
        if _at(expanded, path) != names:
            raise ValueError(f"{folder}: the manifest list at {path} is not in the order of the other lists")
    write_atomic(folder / table, data)
    write_atomic(folder / MANIFEST, text)
    return expanded


def _at(node: Any, path: list) -> Any:
    for key in path:
        node = node[key]
    return node


def table_name(manifest: dict[str, Any], where: Path | str) -> str:
    """The file table's name, checked to be a file manifest.json lists (`where`: the manifest, for errors)."""
    meta = manifest.get(FILE_TABLE)
    name = meta.get("name") if isinstance(meta, dict) else None
    listed = manifest["files"].get(name) if isinstance(name, str) else None
    if not (isinstance(listed, dict) and isinstance(listed.get("size"), int) and isinstance(listed.get("sha256"), str)
            and isinstance(meta.get("files"), int)):
        raise IntegrityError(f"{where}: its '{FILE_TABLE}' does not name a file it lists with size and sha256; the "
                             f"folder is corrupt, re-run the stage")
    return name


def expand_file_table(manifest: dict[str, Any], data: bytes, where: Path | str) -> dict[str, Any]:
    """`manifest` (parsed manifest.json) with its file table `data` (read from `where`) put back: every
    row in `files` (sorted by name, the table's own entry among them), each name appended to the lists its
    row names, `file_table` removed: the same dict as a manifest that held it all. Memory: the table."""
    name = table_name(manifest, where)
    listed, count = manifest["files"][name], manifest.pop(FILE_TABLE)["files"]
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != listed["size"] or digest != listed["sha256"]:
        raise IntegrityError(f"{where}: {len(data)} bytes with sha256 {digest[:16]}…, {MANIFEST} says "
                             f"{listed['size']} bytes with {listed['sha256'][:16]}…; the file table changed after "
                             f"Kiln wrote it, re-run the stage")
    files: dict[str, Any] = {name: listed}
    try:
        lines = data.decode("utf-8").splitlines()
        for line in lines:
            row = json.loads(line)
            entry = check_name(row.pop("name"), where)
            for path in row.pop("in", []):
                _at(manifest, path).append(entry)
            files[entry] = row
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{where}: not a Kiln file table ({exc!r}); the folder is corrupt, "
                             f"re-run the stage") from None
    if len(lines) != count:
        raise IntegrityError(f"{where}: {len(lines)} rows, {MANIFEST} says {count}; re-run the stage")
    manifest["files"] = dict(sorted(files.items()))
    return manifest


def _table_names(folder: Path, manifest: dict[str, Any]) -> set[str]:
    """The names in a folder's file table, read without checking its hash: for telling Kiln's files from
    others (check_replaceable), so that a damaged table does not stop Kiln replacing its own folder."""
    meta = manifest.get(FILE_TABLE)
    try:
        lines = (folder / meta["name"]).read_bytes().decode("utf-8", "replace").splitlines()
    except (OSError, TypeError, KeyError):
        return set()
    names = set()
    for line in lines:
        try:
            names.add(json.loads(line)["name"])
        except (ValueError, KeyError, TypeError):
            continue
    return names


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise IntegrityError(
            f"{folder}: no {MANIFEST}; the folder was never committed (re-run the stage that writes it)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: not valid JSON ({exc}); the folder is corrupt, re-run the stage") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise IntegrityError(f"{path}: has no 'files' table; the folder is corrupt, re-run the stage")
    if FILE_TABLE in manifest:  # the files are listed beside it (write_manifest's `table`)
        name = table_name(manifest, path)
        table = resolve_name(folder, name, path)
        if not table.is_file():
            raise IntegrityError(f"{table}: listed in {MANIFEST} but missing; re-run the stage")
        manifest = expand_file_table(manifest, table.read_bytes(), table)
        where = table
    else:
        where = path
    for name in manifest["files"]:  # every name a reader may open: plain, inside the folder (kiln.names)
        resolve_name(folder, name, where)
    return manifest


def hash_files(paths: list[Path], workers: int = 1) -> Iterator[str]:
    """sha256 of each file, in order, as each is ready (a caller that stops early reads no more files).
    `workers` > 1 hashes that many files at once in threads: hashlib and file reads release the GIL, so threads
    use as many cores and disks. Memory: one 1 MiB block per thread."""
    if workers <= 1 or len(paths) <= 1:
        yield from (sha256_file(p) for p in paths)
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(min(workers, len(paths)), thread_name_prefix="kiln-sha256")
    try:
        for future in [pool.submit(sha256_file, p) for p in paths]:
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# Threads `kiln ckpt verify` and a resume hash a checkpoint's files with (hash_files): a few, since the disk,
# not the cores, is the limit beyond that (BENCHMARKS.md, sharded checkpoints).
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def verify_folder(folder: Path, deep: bool = True, only: set[str] | None = None, workers: int = 1) -> dict[str, Any]:
    """Check every file the manifest lists, or those in `only` (size, and sha256 when deep, by `workers` threads).
    Raise naming the first bad file in the manifest's order (every size is checked before any file is read)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    try:
        _verify_files(folder, manifest, [name for name in manifest["files"] if only is None or name in only], deep,
                      workers)
    except FileNotFoundError as exc:  # between the listing and the read: a writer's retention removed it
        raise IntegrityError(f"{exc.filename or folder}: removed while being read; read the folder again (or "
                             "the newest one where its writer keeps only the latest)") from None
    return manifest


def _verify_files(folder: Path, manifest: dict[str, Any], names: list[str], deep: bool, workers: int) -> None:
    for name in names:
        meta, path = manifest["files"][name], folder / name
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)):
            # a flipped byte in manifest.json can land in a key: that is a corrupt manifest, not a KeyError
            raise IntegrityError(f"{folder / MANIFEST}: the entry of {name} has no size or sha256; the folder is "
                                 "corrupt, re-run the stage")
        if not path.is_file():
            raise IntegrityError(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise IntegrityError(f"{path}: size {size} != {meta['size']} in {MANIFEST}")
    if deep:
        for name, digest in zip(names, hash_files([folder / n for n in names], workers)):
            if digest != manifest["files"][name]["sha256"]:
                raise IntegrityError(f"{folder / name}: sha256 {digest[:16]}… != "
                                     f"{manifest['files'][name]['sha256'][:16]}… in {MANIFEST}")


STAGING_MARK = ".kiln-staging"  # inside a staging folder: who made it (the name alone could be a user's)
SIGNATURE = "manifest.sig"  # written beside manifest.json after it (checkpoint.signing_key)


@contextmanager
def staging_dir(final: Path, stage: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it replaces `final` (rename, parent fsync).

    `final` is replaced only when Kiln wrote it for the same stage (`check_replaceable`); the stage is
    that of the manifest written in the staging folder, or `stage` (then checked before any work too).
    """
    final = Path(final)
    if stage is not None:
        check_replaceable(final, stage)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    (tmp / STAGING_MARK).write_text(json.dumps({"stage": stage, "pid": os.getpid()}))
    try:
        yield tmp
        written = json.loads((tmp / MANIFEST).read_text()).get("stage") if (tmp / MANIFEST).is_file() else None
        check_replaceable(final, written or stage)
        (tmp / STAGING_MARK).unlink()
    except BaseException as exc:  # any failure (Ctrl-C too) removes the staging folder; re-raised
        remove_folder(tmp, ignore_errors=True)  # frees the space a full disk needs back
        if is_disk_full(exc):
            raise KilnError(disk_full_message(final, exc)) from None
        raise
    old = None
    if not final.exists():
        os.replace(tmp, final)
    elif _exchange(tmp, final):  # one atomic swap, so `final` is never missing: the old folder is now at tmp
        old = tmp
    else:  # killed between these two renames, the next run commits tmp (remove_stale_staging)
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        remove_folder(old, ignore_errors=True)  # a folder check_replaceable vouched for: ours, same stage


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def set_aside(folder: Path) -> Path:
    """The first step of removing a committed folder Kiln wrote: rename it to `NAME.old-XXXXXXXX`, which no listing
    takes for the folder and the next run's remove_stale_staging clears if a kill stops `remove_folder`."""
    folder = Path(folder)
    old = folder.with_name(f"{folder.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(folder, old)
    fsync_dir(folder.parent)
    return old


_PROOF = (MANIFEST, STAGING_MARK)  # what shows a folder is Kiln's: removed last


def remove_folder(folder: Path, ignore_errors: bool = False) -> None:
    """Remove a folder Kiln wrote with manifest.json and its staging mark last, so that a kill part-way leaves
    a folder the next run still knows as Kiln's (remove_stale_staging), never an anonymous half."""
    folder = Path(folder)
    try:
        for top, dirs, files in os.walk(folder, topdown=False):
            here = Path(top)
            for name in files:
                if here != folder or name not in _PROOF:
                    (here / name).unlink(missing_ok=True)
            for name in dirs:
                (here / name).unlink() if (here / name).is_symlink() else (here / name).rmdir()
        for name in _PROOF:
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()
    except OSError:
        if not ignore_errors:
            raise


_DISK_FULL_WORDS = ("no space left", "unexpected pos", "file write failed", "storagefull", "disk quota")


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, or how torch.save and safetensors report them (RuntimeError "unexpected pos ...",
    "file write failed"; SafetensorError "StorageFull")."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, Exception) and any(w in str(exc).lower() for w in _DISK_FULL_WORDS)


def disk_full_message(where: Path | str, exc: BaseException) -> str:
    where = Path(getattr(exc, "filename", None) or where)
    probe = next((p for p in (where, *where.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free / 2**20
    return (f"no space left on the device writing {where} ({free:,.0f} MiB free there); nothing half-written was "
            f"kept: free some space and run the same command again, it resumes from what was committed")


def _is_cwd_or_above(folder: Path) -> bool:
    here = Path.cwd().resolve()
    return folder == here or folder in here.parents


def check_replaceable(folder: Path, stage: str | None, inputs: Iterable[Any] = ()) -> None:
    """Refuse (one line naming the folder and the fix) to write `folder` unless Kiln may replace it.

    Kiln replaces only a folder it wrote itself for the same stage: its manifest.json says `stage` and
    every file in it is one the manifest lists. An empty or absent folder is fine. The current folder
    (or one above it), a file, and a folder that equals or holds one of `inputs` (paths, globs, or
    objects with a `.folder`, such as `read_docs`'s) are refused.
    """
    folder = Path(folder)
    real = folder.resolve()
    if _is_cwd_or_above(real):
        raise KilnError(f"output folder {folder} is the current folder (or holds it); an output gets a folder of "
                        f"its own, which Kiln replaces as a whole: give a new name such as "
                        f"{Path(folder) / stage_name(stage)}")
    if folder.exists() and not folder.is_dir():
        raise KilnError(f"output {folder} is a file, not a folder; give the path of a folder to create (or an "
                        f"earlier output of this stage to replace)")
    for src in _local_paths(inputs):
        if src == real or real in src.parents or (src.is_dir() and src in real.parents):
            raise KilnError(f"output folder {folder} and the input {src} overlap; writing there would replace "
                            f"the input: choose an output folder outside the inputs")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    what = f"an earlier `{STAGE_COMMANDS.get(stage, stage)}` output" if stage else "an output"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise KilnError(f"{folder} already exists and is not {what} Kiln wrote (no manifest.json); Kiln replaces "
                        f"only its own folders: choose a new or empty folder, or move this one away")
    if stage is not None and manifest.get("stage") != stage:
        raise KilnError(f"{folder} holds a `{manifest.get('stage')}` output, so it is not {what}; choose another "
                        f"folder, or move this one away")
    listed = set(manifest["files"]) | _table_names(folder, manifest)
    for p in sorted(folder.rglob("*")):
        name = p.relative_to(folder).as_posix()
        if p.is_file() and name not in listed and name not in (MANIFEST, SIGNATURE):
            raise KilnError(f"{folder} holds {name}, which Kiln did not write (manifest.json does not list it); "
                            f"move that file away, or choose another output folder")


STAGE_COMMANDS = {"data": "kiln data", "tokenizer": "kiln tokenizer train", "pack": "kiln pack",
                  "hf-export": "kiln export --hf", "checkpoint": "kiln train"}


def stage_name(stage: str | None) -> str:
    return {"data": "docs", "pack": "shards"}.get(stage or "", stage or "out")


def _local_paths(inputs: Iterable[Any]) -> Iterator[Path]:
    for item in inputs:
        item = getattr(item, "folder", item)
        if isinstance(item, (list, tuple)):
            yield from _local_paths(i for i in item if isinstance(i, (str, os.PathLike)))
            continue
        if not isinstance(item, (str, os.PathLike)):  # documents given as an iterable: no folder to protect
            continue
        text = str(item)
        if "://" in text and not text.startswith("file://"):
            continue
        text = text.removeprefix("file://")
        for match in (glob.glob(text) if glob.has_magic(text) and not os.path.lexists(text) else [text]):
            try:
                yield Path(match).resolve()
            except (RuntimeError, OSError):  # a symlink loop: not a folder to protect (the input check names it)
                continue


def remove_stale_staging(final: Path, stage: str | None) -> list[Path]:
    """Clear what a killed writer of `final` left: its `NAME.tmp-XXXXXXXX` staging folders (marked by Kiln, same
    stage) and `NAME.old-XXXXXXXX` folders (Kiln's manifest, same stage; or empty: a removal killed at its end).
    A staging folder without its mark but with this stage's manifest (and nothing else) was complete: when
    `final` is missing (killed between the two renames of a replace) it becomes `final`, else it is removed.
    Call while holding `final`'s lock, so no live writer owns them. Returns what was removed."""
    final = Path(final)
    pattern = re.compile(rf"^{re.escape(final.name)}\.(tmp|old)-[0-9a-f]{{8}}$")
    gone = []
    for p in sorted(final.parent.iterdir()) if final.parent.is_dir() else []:
        m = pattern.match(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        kind, mark = m.group(1), p / STAGING_MARK
        if kind == "tmp" and not mark.exists() and stage is not None and _owned(p, stage):
            if not final.exists():
                os.replace(p, final)
                fsync_dir(final.parent)
                continue
        elif kind == "old" and not any(q.is_file() or q.is_symlink() for q in p.rglob("*")):
            pass  # nothing in it but empty folders: no one's data
        else:
            try:
                meta = json.loads((mark if kind == "tmp" else p / MANIFEST).read_text())
            except (OSError, ValueError):
                continue  # not Kiln's
            if not (isinstance(meta, dict) and meta.get("stage") in ((None, stage) if kind == "tmp" else (stage,))):
                continue
        remove_folder(p)
        gone.append(p)
    return gone


def _owned(folder: Path, stage: str) -> bool:
    """`folder` holds a manifest.json of `stage` and only files it lists (check_replaceable's rule)."""
    try:
        if json.loads((folder / MANIFEST).read_text()).get("stage") != stage:
            return False
        check_replaceable(folder, stage)
    except (OSError, ValueError, AttributeError, KilnError):
        return False
    return True


@contextmanager
def writing_folder(folder: Path, stage: str, inputs: Iterable[Any] = ()) -> Iterator[None]:
    """For the whole of a stage that writes `folder`: refuse what it may not replace, hold its lock,
    and clear a killed run's leftovers (see `check_replaceable`, `kiln.lock`, `remove_stale_staging`)."""
    from kiln.lock import OutputLock

    inputs = list(inputs)
    check_replaceable(folder, stage, inputs)  # before the lock file: `--out .` must not lock the parent
    with OutputLock(folder, f"`{stage}` writer"):
        check_replaceable(folder, stage, inputs)
        remove_stale_staging(folder, stage)
        try:
            yield
        except OSError as exc:  # a full disk that names no file (a C writer's): it is this output's filesystem
            if is_disk_full(exc):
                raise KilnError(disk_full_message(folder, exc)) from None
            raise


def writes_folder(stage: str, out: str, inputs: tuple[str, ...] = ()) -> Callable:
    """Decorator: the call runs inside `writing_folder(<argument out>, stage, <arguments inputs>)`."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            with writing_folder(Path(bound.arguments[out]), stage, [bound.arguments.get(n) for n in inputs]):
                return fn(*args, **kwargs)
        return wrapper
    return decorate


def is_complete(folder: Path, fingerprint: str) -> bool:
    """A stage output is reusable when its manifest verifies and was made from the same inputs."""
    try:
        manifest = verify_folder(folder)
    except IntegrityError:
        return False
    return manifest.get("fingerprint") == fingerprint
