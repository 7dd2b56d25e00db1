"""One writer per output folder: an exclusive `fcntl.flock` on a lock file beside the folder.

`{parent}/.{name}.lock` holds the holder's host, pid, start time and command (JSON). A second
writer does not wait: it refuses at once with a message naming the holder. The kernel releases a
flock when its process ends however it ends (SIGKILL too), so a lock left by a dead process is
simply taken over; nobody ever deletes a lock file by hand. The lock file is removed on release;
a writer that locked a file which was removed meanwhile (its inode is no longer the path's)
retries on the new file, so two writers can never both hold "the" lock.

Locks are per open file: two writers in one process exclude each other too. On a shared
filesystem (NFS) Linux maps flock to POSIX record locks, which NFS honours across machines.

A reader pins a folder that a writer may remove (a checkpoint under retention): `pinned` holds a shared
flock on `.NAME.pin` beside it while it reads; `unpinned` is the remover's exclusive, non-blocking side
(a folder being read is spared). Only a remover, holding the exclusive lock, deletes a pin file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kiln.errors import KilnError


def lock_path(folder: Path) -> Path:
    folder = Path(folder).absolute()
    return folder.with_name(f".{folder.name}.lock")


def describe_holder(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {when} ({info.get('command', '?')})"


class OutputLock:
    """An exclusive lock on `folder`'s lock file, held until `release()` (or the process ends)."""

    def __init__(self, folder: Path, what: str) -> None:
        self.folder, self.path, self.what = Path(folder), lock_path(folder), what
        self.fd: int | None = None

    def acquire(self) -> "OutputLock":
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                writer = holder.get("what") or f"another {self.what}"  # the holder's kind: a train, say, for an import
                raise KilnError(f"{self.folder} is being written by {writer}: {describe_holder(holder)}; "
                                f"wait for it to finish or stop it (its lock {self.path} goes when it ends)") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder before us removed this file on release: lock the new one
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300], "what": self.what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def _open(self) -> int:
        """The lock file, created if need be; a folder Kiln cannot write (a read-only filesystem, no permission)
        is a one-line error before any work."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
                raise
            raise KilnError(f"cannot write {self.folder}: {exc.strerror} ({exc.filename or self.path}); "
                            "give an output on a writable filesystem (or fix its permissions)") from None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody else holds this inode
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def pin_path(folder: Path) -> Path:
    folder = Path(folder).resolve()  # every spelling of the folder pins the same file
    return folder.with_name(f".{folder.name}.pin")


def _open_pin(folder: Path) -> int | None:
    """The pin file, created if need be; None where the folder's parent cannot be written (nothing removes
    folders there, so there is nothing to pin against)."""
    try:
        return os.open(pin_path(folder), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise


def _still_the_pin(fd: int, folder: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(pin_path(folder)).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def pinned(folder: Path, gone: str) -> Iterator[None]:
    """Read `folder` inside this block: a remover (`unpinned`) spares it meanwhile. A folder removed before the
    pin was taken is one KilnError: `{folder} {gone}`."""
    folder, fd = Path(folder), None
    while folder.is_dir():  # no pin file is made beside a folder that is not there
        fd = _open_pin(folder)
        if fd is None:
            break
        fcntl.flock(fd, fcntl.LOCK_SH)  # a remover holds its exclusive lock only while it renames
        if _still_the_pin(fd, folder):
            break
        os.close(fd)  # removed with its folder meanwhile: pin the path's file now (or learn the folder is gone)
        fd = None
    try:
        if not folder.is_dir():
            raise KilnError(f"{folder} {gone}")
        yield
    finally:
        if fd is not None:
            _drop_pin(fd, folder)


def _drop_pin(fd: int, folder: Path) -> None:
    """Release a reader's pin, removing the pin file when no one else holds it (taken exclusively, as a remover
    does: anyone who opened it meanwhile finds it is no longer the path's file and opens the new one)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _still_the_pin(fd, folder):
            pin_path(folder).unlink(missing_ok=True)
    except OSError:  # another reader or a remover holds it: the file stays for them
        pass
    finally:
        os.close(fd)


@contextmanager
def unpinned(folder: Path) -> Iterator[bool]:
    """Yield True while no reader pins `folder` (and none can start), False at once if one does. On True the
    caller may move the folder away inside the block; its pin file is removed when the block ends."""
    while True:
        fd = _open_pin(folder)
        if fd is None:
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        if _still_the_pin(fd, folder):
            break
        os.close(fd)
    try:
        yield True
        if not Path(folder).exists():
            pin_path(folder).unlink(missing_ok=True)  # still locked: no reader holds this inode
    finally:
        os.close(fd)


def _read(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
