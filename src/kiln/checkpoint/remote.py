"""Checkpoints on object storage (`checkpoint.dir: s3://bucket/prefix`, gs://, any fsspec URL).

Object stores have no rename, so a checkpoint is committed by a marker instead:
  1. the checkpoint is written to `{out_dir}/run/checkpoints/step-NNNNNNNN/` exactly as without a URL (staging
     folder, every file hashed, manifest.json last, rename): the local cache, which keeps the newest only;
  2. rank 0 uploads its files to `{dir}/step-NNNNNNNN/` (a COMMITTED marker left there by an earlier save of the
     same step is removed first), manifest.json after every file it lists;
  3. then `COMMITTED`, holding the sha256 of manifest.json. A reader trusts a step's prefix only when COMMITTED
     is there and equals the sha256 of the manifest.json beside it; a write killed before that is skipped with
     that reason and never loaded, and every file downloaded is checked against the manifest's size and sha256.
Resume (`sync`, rank 0, before the ranks agree on a checkpoint): a local copy not committed at the URL is
removed from the cache; the newest committed step is downloaded into the cache (staging folder and rename, as a
save writes it) unless the cache holds that very manifest; the local agreement then verifies it as ever.
Retention removes COMMITTED first, then the files, manifest.json last; a prefix without COMMITTED (a killed
upload or removal) holding nothing but Kiln's checkpoint files goes too. Only Kiln's names are ever deleted.
The run's own files (`{dir}` = `{out_dir}/run/checkpoints`, as an out_dir URL implies: kiln.train.remote_run):
metrics.jsonl, config.yaml and env.json are uploaded to `{out_dir}/run/` after each checkpoint's upload, and a
resume whose local run folder has no metrics.jsonl downloads it first (MetricsLog then cuts what follows the step).
Every call is bounded (data.sources' S3 bounds: botocore's connect/read timeouts and attempts, overridable in
checkpoint.storage_options' config_kwargs); a failure is one line naming the URL.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.storage import filesystem, unreachable
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, read_manifest, sha256_file, staging_dir, write_atomic
from kiln.names import check_name
from kiln.checkpoint.folder import (CHECKPOINT_FILE, SIGNATURE, STEP_DIR, kept_steps, list_checkpoints,
                                          remove_checkpoint, step_dir, step_of)
from kiln.checkpoint.read import verify_checkpoint
from kiln.run_layout import RunLayout

MARKER = "COMMITTED"
RUN_FILES = ("metrics.jsonl", "config.yaml", "env.json")  # uploaded beside {out_dir}/run/checkpoints
UNFINISHED = f"its upload did not finish (no {MARKER} marker): never loaded"


class RemoteCheckpoints:
    """The checkpoints under one URL prefix: list, upload, download, remove, retain."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options)

    @contextmanager
    def call(self, what: str) -> Iterator[None]:
        """A call to the store: anything but a missing object is one KilnError naming the URL."""
        try:
            yield
        except (KilnError, FileNotFoundError):
            raise
        except Exception as exc:  # botocore's and aiohttp's errors, after their own bounded attempts
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            how = "could not reach the storage server" if unreachable(exc, what) else "the storage call failed"
            raise KilnError(f"{what}: {how} ({why}); check checkpoint.dir "
                            "and checkpoint.storage_options (client_kwargs.endpoint_url, credentials; config_kwargs: "
                            "connect_timeout, read_timeout, retries), then run the same command again") from None

    def where(self, step: int, name: str = "") -> str:
        return f"{self.url}/{step_dir(Path('.'), step).name}" + (f"/{name}" if name else "")

    def _path(self, step: int, name: str = "") -> str:
        return f"{self.root}/{step_dir(Path('.'), step).name}" + (f"/{name}" if name else "")

    def steps(self) -> list[int]:
        """Every `step-NNNNNNNN` prefix under the URL, committed or not, ascending."""
        with self.call(self.url):
            self.fs.invalidate_cache()
            try:
                names = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
        return sorted(step_of(Path(n)) for n in (str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)
                      if STEP_DIR.match(n))

    def _read(self, step: int, name: str) -> bytes | None:
        with self.call(self.where(step, name)):
            try:
                return self.fs.cat_file(self._path(step, name))
            except FileNotFoundError:
                return None

    def committed(self, step: int) -> tuple[bytes | None, str | None]:
        """(manifest.json's bytes, None) when the step is committed, else (None, why not)."""
        marker = self._read(step, MARKER)
        if marker is None:
            return None, UNFINISHED
        manifest = self._read(step, MANIFEST)
        if manifest is None:
            return None, f"{MARKER} but no {MANIFEST}: removed part-way, never loaded"
        sha = hashlib.sha256(manifest).hexdigest()
        if marker.decode(errors="replace").strip() != sha:
            return None, f"{MANIFEST} (sha256 {sha[:16]}…) is not the one {MARKER} names: changed after Kiln wrote it"
        return manifest, None

    # --- writing ---------------------------------------------------------------------------------

    def upload(self, folder: Path) -> None:
        """A committed local checkpoint folder to `{url}/step-N/`: its files, manifest.json, then COMMITTED."""
        folder, step = Path(folder), step_of(folder)
        self.remove(step)  # an earlier save of this step (a rollback's), or what a killed upload left
        names = sorted(read_manifest(folder)["files"]) + ([SIGNATURE] if (folder / SIGNATURE).is_file() else [])
        for name in [*names, MANIFEST]:
            with self.call(self.where(step, name)):
                self.fs.put_file(str(folder / name), self._path(step, name))
        with self.call(self.where(step, MARKER)):
            self.fs.pipe_file(self._path(step, MARKER), sha256_file(folder / MANIFEST).encode())

    def run_url(self) -> str | None:
        """`{out_dir}/run` when the checkpoints are `{out_dir}/run/checkpoints` (an out_dir URL's), else None."""
        layout = RunLayout(self.url.rstrip("/").rsplit("/", 2)[0])  # the out_dir, when self.url is its run/checkpoints
        return layout.run if layout.checkpoints == self.url.rstrip("/") else None

    def upload_run_files(self, run_dir: Path) -> None:
        """The run's small files beside the checkpoints (metrics.jsonl up to its last whole line)."""
        if self.run_url() is None:
            return
        for name in RUN_FILES:
            if (run_dir / name).is_file():
                data = (run_dir / name).read_bytes()
                data = data[:data.rfind(b"\n") + 1] if name == "metrics.jsonl" else data  # a line being written
                with self.call(f"{self.run_url()}/{name}"):
                    self.fs.pipe_file(f"{self.root.rpartition('/')[0]}/{name}", data)

    def fetch_metrics(self, run_dir: Path, log: Callable[[str], None]) -> None:
        """A resume on a machine whose run folder has no metrics.jsonl: the one uploaded with the last save."""
        local = run_dir / "metrics.jsonl"
        if self.run_url() is None or local.exists():
            return
        with self.call(f"{self.run_url()}/metrics.jsonl"):
            try:
                data = self.fs.cat_file(f"{self.root.rpartition('/')[0]}/metrics.jsonl")
            except FileNotFoundError:
                return
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(local, data)
        log(f"metrics.jsonl from {self.run_url()}/metrics.jsonl ({len(data.splitlines())} records)")

    def remove(self, step: int) -> bool:
        """COMMITTED first, then Kiln's checkpoint files, manifest.json last; anything else is left (and the step
        with it: False)."""
        with self.call(self.where(step)):
            self.fs.invalidate_cache()
            try:
                names = [str(n).rsplit("/", 1)[-1] for n in self.fs.find(self._path(step))]
            except FileNotFoundError:
                return True
            ours = [n for n in names if n != MANIFEST and (n == MARKER or CHECKPOINT_FILE.match(n))]
            for name in sorted(ours, key=lambda n: n != MARKER) + ([MANIFEST] if MANIFEST in names else []):
                self.fs.rm_file(self._path(step, name))
        return len(ours) + (MANIFEST in names) == len(names)

    def retain(self, keep_last: int, keep_every: int | None, best_step: int | None) -> list[int]:
        """Retention at the URL, by the rules of the local one; a step without COMMITTED goes too (this run is the
        one writer and its own upload is committed by now). Returns the steps removed."""
        steps = self.steps()
        done = [s for s in steps if self._read(s, MARKER) is not None]
        keep = kept_steps(done, keep_last, keep_every, best_step)
        return [s for s in steps if s not in keep and self.remove(s)]

    # --- reading ---------------------------------------------------------------------------------

    def download(self, step: int, root: Path) -> Path:
        """`root/step-N`, a verified local copy of the committed step (kept when it already holds that manifest)."""
        manifest, why = self.committed(step)
        if why:
            raise IntegrityError(f"{self.where(step)}: {why}")
        local = step_dir(root, step)
        sha = hashlib.sha256(manifest).hexdigest()
        if (local / MANIFEST).is_file() and sha256_file(local / MANIFEST) == sha:
            return local
        try:
            files = json.loads(manifest)["files"]
            assert isinstance(files, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise IntegrityError(f"{self.where(step, MANIFEST)}: not a Kiln manifest; never loaded") from None
        with staging_dir(local) as tmp:
            for name, meta in files.items():
                self._fetch(step, check_name(name, self.where(step, MANIFEST)), meta, tmp)
            signature = self._read(step, SIGNATURE)
            if signature is not None:
                (tmp / SIGNATURE).write_bytes(signature)
            (tmp / MANIFEST).write_bytes(manifest)
        return local

    def _fetch(self, step: int, name: str, meta: Any, tmp: Path) -> None:
        where = self.where(step, name)
        size, sha = (meta.get("size"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        h, got = hashlib.sha256(), 0
        with self.call(where):
            try:
                with self.fs.open(self._path(step, name), "rb") as src, open(path, "wb") as dst:
                    while block := src.read(1 << 22):
                        h.update(block)
                        dst.write(block)
                        got += len(block)
            except FileNotFoundError:
                raise IntegrityError(f"{where}: listed in {MANIFEST} but missing; never loaded") from None
        if got != size or h.hexdigest() != sha:
            raise IntegrityError(f"{where}: {got} bytes with sha256 {h.hexdigest()[:16]}…, {MANIFEST} says {size} "
                                 f"bytes with {str(sha)[:16]}…; the remote copy is corrupt, never loaded")

    def sync(self, cache: Path, log: Callable[[str], None], before: int | None = None) -> Path | None:
        """Rank 0, before a resume or rollback: the local cache holds only copies committed here, and the newest
        committed step (before `before`) that downloads verified; the others are said, with why, and skipped."""
        status = {s: self.committed(s) for s in self.steps()}
        for local in list_checkpoints(cache):
            manifest, why = status.get(step_of(local), (None, f"not at {self.url}"))
            if (local / MANIFEST).is_file() and manifest is not None and \
                    sha256_file(local / MANIFEST) == hashlib.sha256(manifest).hexdigest():
                continue
            if before is None or step_of(local) < before:
                log(f"skipping {local}: not committed at {self.where(step_of(local))} ({why or 'another manifest'})")
            remove_checkpoint(local)
        for step in reversed([s for s in status if before is None or s < before]):
            manifest, why = status[step]
            if why:
                log(f"skipping {self.where(step)}: {why}")
                continue
            try:
                return self.download(step, cache)
            except IntegrityError as exc:
                log(f"skipping corrupt checkpoint: {exc}")
        return None


# --- kiln ckpt verify | list on a URL ------------------------------------------------------------

def _split(url: str) -> tuple[RemoteCheckpoints, int]:
    parent, _, name = url.rstrip("/").rpartition("/")
    if not STEP_DIR.match(name) or "://" not in parent:
        raise KilnError(f"{url}: not a checkpoint URL; pass {{checkpoint.dir}}/step-NNNNNNNN "
                        "(`kiln ckpt list {checkpoint.dir}` lists them)")
    return RemoteCheckpoints(parent), step_of(Path(name))


def verify_url(url: str, public_key: str | None = None) -> dict[str, Any]:
    """`kiln ckpt verify URL/step-N`: committed, downloaded into a temporary folder, verified as a local one.
    Credentials and endpoint come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
    remote, step = _split(url)
    with tempfile.TemporaryDirectory(prefix="kiln-ckpt-") as tmp:
        return verify_checkpoint(remote.download(step, Path(tmp)), public_key)


def url_table(url: str, public_key: str | None = None) -> list[dict[str, Any]]:
    """`kiln ckpt list URL`: one row per step prefix, as checkpoint_table's: each committed one downloaded into a
    temporary folder and verified (its bytes cross the network once), the others with why they are skipped."""
    remote = RemoteCheckpoints(url)
    rows = []
    for step in remote.steps():
        row: dict[str, Any] = {"path": remote.where(step), "step": step, "valid": False, "problem": None}
        try:
            with tempfile.TemporaryDirectory(prefix="kiln-ckpt-") as tmp:
                folder = remote.download(step, Path(tmp))
                m = verify_checkpoint(folder, public_key)
                state = json.loads((folder / "state.json").read_text())
            row.update(valid=True, tokens_seen=m.get("tokens_seen"),
                       val_loss=state.get("history", {}).get("val_loss", {}).get(str(step)))
        except IntegrityError as exc:
            row["problem"] = str(exc)
        rows.append(row)
    return rows
