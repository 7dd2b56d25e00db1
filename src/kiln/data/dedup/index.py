"""`data.dedup.index`: the signatures of earlier runs, so the next run (the next dump) is deduplicated
against them without reading or hashing them again (FineWeb-2 deduplicates across dumps this way).

Layout of the folder (Kiln's own: `index.json` says so, and nothing else in it is touched):

    index.json          {"kind": "kiln-dedup-index", "settings": {...}, "runs": [{"name", "key", "docs",
                         "documents", "parts": [{"name", "count"}]}]}, in the order the runs were added
    run-NNNNN/          one finished run: per task of that run, the stage files (`signatures.KINDS`, `ids.json`)
                        of the documents it kept (dedup survivors), and a manifest.json

A run uses the runs listed before its own entry (all of them the first time), in that order, as
documents that come before its own: they always survive, and a document of this run that is a copy of
one of them is removed naming it (`duplicate_of`, and `duplicate_in`: the run's name). Then, before its
docs folder is committed, the run adds itself (its key is the data fingerprint without the index, so a
re-run finds its entry and neither adds it twice nor deduplicates against itself). The signature
settings (method, bands, rows, seed, ngram, tokens, hamming) must be those the index was built with.
Each run folder is checked against its manifest before it is used (sizes when the fingerprint is taken,
sha256 when the dedup layout is made), so a cut or changed index file stops the run naming it instead of
silently deduplicating against damaged signatures. `check_use` refuses, before any work, an index inside
the docs folder (or the docs folder inside the index), an index whose earlier run wrote this same docs
folder from other inputs or settings (deduplicating against it would remove every document the two share),
and the same inputs and settings into a second docs folder while the first exists (both would keep everything).
Memory: one task's files at a time. One writer at a time: `use_index` holds the index's lock for the run.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kiln.config import DedupConfig
from kiln.data.dedup.signatures import Part, npy_bytes
from kiln.errors import ConfigError, IntegrityError
from kiln.manifest import HASH_THREADS, staging_dir, verify_folder, write_atomic, write_manifest
from kiln.names import check_name, listed_name, resolve_name

INDEX = "index.json"
SIGNATURE_KEYS = ("method", "bands", "rows", "seed", "ngram", "tokens", "hamming")


def _settings(cfg: DedupConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in SIGNATURE_KEYS}


def read_index(cfg: DedupConfig) -> dict[str, Any] | None:
    """index.json of data.dedup.index, checked against this run's settings; None when the folder is new."""
    if not cfg.index:
        return None
    folder = Path(cfg.index)
    path = folder / INDEX
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"data.dedup.index: {folder} is a file, not a folder; give a new or empty folder, or one "
                          "an earlier run's data.dedup.index wrote")
    if not path.exists():
        if folder.exists() and any(folder.iterdir()):
            raise ConfigError(f"data.dedup.index: {folder} is not empty and has no {INDEX}; it is not a Kiln dedup "
                              "index: give an empty or new folder")
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{path}: unreadable ({exc}); restore it or start a new index folder") from None
    if not isinstance(index, dict) or index.get("kind") != "kiln-dedup-index":
        raise ConfigError(f"data.dedup.index: {path} is not a Kiln dedup index")
    runs = index.get("runs")
    if not (isinstance(index.get("settings"), dict) and isinstance(runs, list) and all(
            isinstance(r, dict) and {"name", "key", "parts"} <= set(r) for r in runs)):
        raise IntegrityError(f"{path}: has no settings or runs table Kiln can read; restore it or start a new index "
                             "folder")
    if index["settings"] != _settings(cfg):
        raise ConfigError(f"data.dedup.index: {folder} was built with data.dedup {index['settings']}, this run has "
                          f"{_settings(cfg)}: use the same settings or another index folder")
    return index


def runs_before(cfg: DedupConfig, key: str) -> list[dict[str, Any]]:
    """The index's runs this run deduplicates against: those added before its own entry (all, if it has none)."""
    index = read_index(cfg)
    if index is None:
        return []
    runs = index["runs"]
    own = next((k for k, run in enumerate(runs) if run["key"] == key), len(runs))
    for run in runs[:own]:
        _verify_run(cfg, run, deep=False)  # a cut or missing file: before any work
    return runs[:own]


def _part_files(method: str) -> tuple[str, ...]:
    """The files of one task a run folder holds (`_kept_files`), by the dedup method."""
    return ("ids.json", "exact.npy") + {"none": (), "simhash": ("bands.npy", "prints.npy"),
                                        "minhash": ("bands.npy", "shingles.npy", "spans.npy")}[method]


def _verify_run(cfg: DedupConfig, run: dict[str, Any], deep: bool) -> Path:
    """The run's folder, after checking the names index.json gives it (the run's folder, its parts' files: plain
    names, listed in the run's manifest; `kiln.names`) and its files against that manifest."""
    where = Path(cfg.index) / INDEX
    folder = resolve_name(cfg.index, run["name"], where)
    if not folder.is_dir():
        raise IntegrityError(f"data.dedup.index: {folder}, listed in {where}, is missing: restore the index folder "
                             "from a copy, or start a new one")
    try:
        files = verify_folder(folder, deep=deep, workers=HASH_THREADS)["files"]
        for part in run["parts"]:
            if not (isinstance(part, dict) and isinstance(part.get("count"), int)):
                raise IntegrityError(f"{where}: the run {run['name']!r} lists a part {part!r} without a name and a "
                                     "count")
            for kind in _part_files(cfg.method):
                listed_name(folder, f"{check_name(part.get('name'), where)}.{kind}", files, where)
    except IntegrityError as exc:
        raise IntegrityError(f"data.dedup.index: {exc}; the index's files changed after Kiln wrote them: restore the "
                             "index folder from a copy, or start a new one") from None
    return folder


def index_parts(cfg: DedupConfig, key: str) -> list:
    """The parts of the runs this run deduplicates against, each run folder verified (sha256) first."""
    return [Part(str(_verify_run(cfg, run, deep=True)), p["name"], p["count"], run["name"])
            for run in runs_before(cfg, key) for p in run["parts"]]


def _check_overlap(cfg: DedupConfig, docs: Path) -> None:
    folder, docs = Path(cfg.index).resolve(), Path(docs).resolve()
    if folder == docs or docs in folder.parents or folder in docs.parents:
        raise ConfigError(f"data.dedup.index: {cfg.index} and the docs folder {docs} overlap (the docs folder is "
                          "replaced as a whole, and the index must outlive it): give an index folder outside it")


def _check_docs(cfg: DedupConfig, index: dict[str, Any] | None, docs: Path, key: str) -> None:
    """The refusals of `check_use`, given the index as read."""
    _check_overlap(cfg, docs)
    docs = Path(docs).resolve()
    runs = (index or {}).get("runs", [])
    own = next((k for k, run in enumerate(runs) if run["key"] == key), len(runs))
    if own < len(runs) and (first := runs[own].get("docs")) and Path(first).resolve() != docs and Path(first).exists():
        raise ConfigError(
            f"data.dedup.index: {runs[own]['name']} of {cfg.index} holds these same inputs and settings, written to "
            f"{first}; a second docs folder of them would keep every document again (training on both would see "
            f"each twice): run into {first} (it resumes or is skipped), or use another index folder")
    for run in runs[:own]:
        if run.get("docs") and Path(run["docs"]).resolve() == docs:
            raise ConfigError(
                f"data.dedup.index: {run['name']} of {cfg.index} was written into this same docs folder {docs} "
                "from other inputs or settings; deduplicating against it would remove every document the two "
                "share: write this run to a new --out (one docs folder per dump), or start a new index folder")


@contextmanager
def use_index(cfg, inputs: list[str], docs: Path) -> Iterator[None]:
    """Around a run of the data stage into `docs` (`cfg` is the DataConfig): with data.dedup.index, hold the
    index's lock (`.NAME.lock` beside it) for the whole run, so a second run on the same index stops at once
    naming the first (run side by side, neither would be deduplicated against the other, while the index
    would list one before the other), then `check_use`. Without an index, nothing."""
    if not cfg.dedup.index:
        yield
        return
    from kiln.lock import OutputLock

    _check_overlap(cfg.dedup, docs)  # before a lock file is made beside the index: in the docs folder, or
    if not Path(cfg.dedup.index).is_dir():  # beside a file given for the index
        read_index(cfg.dedup)
    # A folder is read under the lock (in check_use): another run may be writing it, and is named, not its files.
    with OutputLock(Path(cfg.dedup.index), "a `kiln data` run using it as data.dedup.index"):
        check_use(cfg, inputs, docs)
        yield


def check_use(cfg, inputs: list[str], docs: Path) -> None:
    """Before any work: refuse an index that overlaps the docs folder `docs`, or whose earlier run wrote `docs`
    from other inputs or settings (`cfg` is the DataConfig; the inputs as given, globs too)."""
    if not cfg.dedup.index:
        return
    from kiln.data.plan import index_key
    from kiln.data.sources import expand_inputs

    key = index_key(expand_inputs(inputs, cfg.storage_options), cfg)
    _check_docs(cfg.dedup, read_index(cfg.dedup), docs, key)


def add_run(cfg: DedupConfig, key: str, docs: str, layout, removed: Callable[[int], np.ndarray]) -> None:
    """Add this run's surviving documents to the index (nothing when it is there already); `removed(k)`: the
    numbers, among part k's kept documents, of those dedup removed."""
    index = read_index(cfg) or {"kind": "kiln-dedup-index", "settings": _settings(cfg), "runs": []}
    if any(run["key"] == key for run in index["runs"]):
        return
    _check_docs(cfg, index, Path(docs), key)  # check_use's refusals, for callers of run_data that skipped it
    docs = str(Path(docs).resolve())  # a later run compares docs folders whatever its working directory
    folder = Path(cfg.index)
    name = f"run-{len(index['runs']):05d}"
    parts = []
    with staging_dir(folder / name) as tmp:
        for k, part in enumerate(layout.parts):
            if part.run is not None:
                continue
            keep = ~np.isin(np.arange(part.count), removed(k))
            for kind, data in _kept_files(layout, k, keep).items():
                write_atomic(tmp / f"{part.name}.{kind}", data)
            layout.forget(k)  # its maps' pages leave the driver's memory: one part at a time
            parts.append({"name": part.name, "count": int(keep.sum())})
        write_manifest(tmp, stage="dedup-index", key=key, docs=docs)
    index["runs"].append({"name": name, "key": key, "docs": docs, "documents": sum(p["count"] for p in parts),
                          "parts": parts})
    write_atomic(folder / INDEX, json.dumps(index, indent=1))


def _kept_files(layout, k: int, keep: np.ndarray) -> dict[str, bytes]:
    """One task's stage files restricted to the documents in `keep` (local indices renumbered)."""
    renumber = np.cumsum(keep) - 1
    out = {"ids.json": json.dumps([i for i, k in zip(layout.array(k, "ids.json"), keep) if k],
                                  ensure_ascii=False).encode()}
    exact = np.asarray(layout.array(k, "exact.npy"))
    cols = keep[exact[2].astype(np.int64)]
    exact = exact[:, cols]
    exact[2] = renumber[exact[2].astype(np.int64)]
    out["exact.npy"] = npy_bytes(exact)
    if layout.cfg.method == "none":
        return out
    if layout.path(k, "keys.npy").exists():  # a run's parts since keys.npy (an index run older than it has none)
        out["keys.npy"] = npy_bytes(np.asarray(layout.array(k, "keys.npy"))[keep])
    bands = np.asarray(layout.array(k, "bands.npy"))
    kept_bands = np.empty((bands.shape[0], 2, int(keep.sum())), dtype=np.uint64)
    for b in range(bands.shape[0]):
        cols = keep[bands[b, 1].astype(np.int64)]
        kept_bands[b, 0] = bands[b, 0, cols]
        kept_bands[b, 1] = renumber[bands[b, 1, cols].astype(np.int64)]
    out["bands.npy"] = npy_bytes(kept_bands)
    if layout.cfg.method == "simhash":
        out["prints.npy"] = npy_bytes(np.asarray(layout.array(k, "prints.npy"))[keep])
        return out
    spans = np.asarray(layout.array(k, "spans.npy"))
    shingles = layout.array(k, "shingles.npy")
    pieces = [np.asarray(shingles[spans[i]:spans[i + 1]]) for i in np.flatnonzero(keep)]
    sizes = np.array([len(p) for p in pieces], dtype=np.int64)
    out["shingles.npy"] = npy_bytes(np.concatenate(pieces) if pieces else np.empty(0, np.uint64))
    out["spans.npy"] = npy_bytes(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    return out
