"""`kiln train` with `out_dir: s3://bucket/prefix` (gs://, any fsspec URL): a run on object storage.

The URL holds what the data stages wrote (run them with a local out_dir and copy `tokenizer/` and `shards/` up;
`kiln run` refuses a URL out_dir: config.Config.out). `localize(cfg)` turns the config into the local one the
trainer runs, so the loop knows nothing of URLs:
  - out_dir: a local folder keyed by the URL, `$XDG_CACHE_HOME/kiln/runs/<sha256 of the URL>` (~/.cache when
    unset): its run/ holds the lock, metrics.jsonl, config.yaml, env.json and the newest checkpoint's copy;
  - tokenizer/: downloaded into it, every file checked against the URL's manifest.json (through the shard cache),
    kept while the URL's manifest is the same one;
  - loader.sources (unless set): `URL/shards`, read through the remote shard cache (shards/remote.py) with the
    environment's credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...);
  - checkpoint.dir (unless set): `URL/run/checkpoints`, uploaded and resumed from as any checkpoint.dir
    (checkpoint/remote.py), which also uploads run/'s small files beside them at each save and brings
    metrics.jsonl back to a machine that has none.
checkpoint.storage_options serve the tokenizer's download too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from kiln.config import Config
from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, sha256_file, staging_dir
from kiln.names import check_name
from kiln.shards.remote import ShardCache
from kiln.storage import is_url
from kiln.checkpoint.remote import RemoteCheckpoints
from kiln.run_layout import RunLayout


def local_folder(url: str) -> Path:
    """The local out_dir of a URL out_dir: one per URL on this machine."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kiln" / "runs" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def localize(cfg: Config) -> Config:
    """The config `kiln train` runs for an out_dir URL (the module's docstring); a local out_dir's as it is."""
    if not is_url(cfg.out_dir):
        return cfg
    url = cfg.out_dir.rstrip("/")
    data = cfg.model_dump(mode="json")
    data["out_dir"] = str(local_folder(url))
    data["checkpoint"]["dir"] = data["checkpoint"]["dir"] or RunLayout(url).checkpoints
    data["loader"]["sources"] = data["loader"]["sources"] or [{"path": RunLayout(url).shards}]
    local = Config.model_validate(data)
    cache = ShardCache(Path(local.loader.cache_dir) if local.loader.cache_dir else local.layout.shard_cache,
                       int(local.loader.cache_max_gb * 2**30))
    fetch_folder(RunLayout(url).tokenizer, local.layout.tokenizer, cfg.checkpoint.storage_options, cache)
    return local


def fetch_folder(url: str, dest: Path, storage_options: dict, cache: ShardCache) -> Path:
    """A committed folder at `url` (its manifest.json, then every file it lists, each verified by the cache) as
    `dest`, replaced only when the URL's manifest differs; the ranks of a node take turns (a flock)."""
    remote = RemoteCheckpoints(url, storage_options)
    where = f"{remote.url}/{MANIFEST}"
    with remote.call(where):
        try:
            manifest = remote.fs.cat_file(f"{remote.root}/{MANIFEST}")
        except FileNotFoundError:
            raise KilnError(f"{where}: not found; out_dir is a URL: make {Path(url).name}/ with a local out_dir "
                                 f"(`kiln run CONFIG out_dir=DIR --until pack`) and copy it up to {url}") from None
    try:
        files = json.loads(manifest)["files"]
        assert isinstance(files, dict) and all(isinstance(m, dict) and isinstance(m.get("size"), int)
                                               and isinstance(m.get("sha256"), str) for m in files.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise IntegrityError(f"{where}: not a Kiln manifest; copy the folder up again as Kiln wrote it") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.fetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if (dest / MANIFEST).is_file() and sha256_file(dest / MANIFEST) == hashlib.sha256(manifest).hexdigest():
            return dest
        with staging_dir(dest) as tmp:
            for name, meta in files.items():
                check_name(name, where)
                got = cache.fetch(remote.fs, f"{remote.root}/{name}", f"{remote.url}/{name}", meta["size"],
                                  meta["sha256"])
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(got, tmp / name)
            (tmp / MANIFEST).write_bytes(manifest)
    return dest
