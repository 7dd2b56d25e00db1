"""Which files under a folder were opened, by any process, through any path (symlinks too): Linux inotify.

Used by the trust-boundary tests to show that Kiln reads nothing outside the folders a manifest vouches for.
inotify sees every open(2) of a file in a watched directory, from Python, C or Rust code alike (safetensors and
numpy open files outside Python's own `open`), and does not depend on access times (often `noatime`)."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

IN_ACCESS, IN_OPEN, IN_ISDIR = 0x1, 0x20, 0x40000000
_EVENT = struct.Struct("iIII")
_libc = ctypes.CDLL(None, use_errno=True)


class OpenWatch:
    """`with OpenWatch(folder) as w: ...; w.opened()`: the files under `folder` (every subfolder at the start)
    opened or read since the watch began, as paths relative to `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.fd = -1
        self.dirs: dict[int, Path] = {}
        self.seen: set[str] = set()

    def __enter__(self) -> "OpenWatch":
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for d in [self.folder, *[p for p in self.folder.rglob("*") if p.is_dir() and not p.is_symlink()]]:
            wd = _libc.inotify_add_watch(self.fd, os.fsencode(d), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")
            self.dirs[wd] = d.relative_to(self.folder)
        return self

    def opened(self) -> set[str]:
        while self.fd >= 0:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return set(self.seen)
            at = 0
            while at < len(data):
                wd, mask, _, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size: at + _EVENT.size + size].rstrip(b"\0").decode(errors="replace")
                at += _EVENT.size + size
                if name and not mask & IN_ISDIR:
                    self.seen.add((self.dirs[wd] / name).as_posix())
        return set(self.seen)

    def __exit__(self, *exc) -> None:
        self.opened()
        os.close(self.fd)
        self.fd = -1
