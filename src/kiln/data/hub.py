"""Inputs in the Hugging Face on-disk formats: a `datasets.save_to_disk` folder, and a downloaded Hub dataset folder.

- A save_to_disk folder of a Dataset: Arrow IPC stream files, listed in order in `state.json` (`_data_files`),
  beside `dataset_info.json` (the features). A DatasetDict's folder has `dataset_dict.json` naming its splits,
  each a Dataset folder of that name: every split is read, in the order listed (give `FOLDER/train` for one).
- A Hub dataset folder (`hf download --repo-type dataset`, or a git clone): Parquet files (JSONL works too).
  When its README.md declares `configs` in its YAML header, the default config's `data_files` patterns say
  which files make the data set (FineWeb: `data/*/*`, leaving out its `sample/` copies): the config marked
  `default: true`, else the one named `default`, else the first; a data file under the folder that none of
  its configs names is refused in one line (give it by name or glob), never left out unsaid.
- Any other folder: every data file under it, in sorted path order, whatever its format (Parquet, Arrow,
  JSONL, WARC: `DATA`), and each save_to_disk folder inside it at its place (its files as above); other files
  (a README, .gitattributes) are not data. No data file is left out: a mixed folder reads all of them.
A folder given in `data.inputs` expands to those files, in that order; each is then an input like any other:
its identity in the data fingerprint, its rows read streaming, provenance as the file and the row (`offset`,
`length` 1, as Parquet). The names read from state.json, dataset_dict.json and README.md are the folder's
own: each must be a plain relative name inside the folder (no absolute path, no `..`), or the folder is
refused naming the file and the entry.

The Arrow files are read by `sources.read_arrow`, one record batch at a time (datasets writes batches of
1,000 rows): a task holds one batch, whatever the file's size (`benchmarks/bench_hub_inputs.py` measures peak
RSS at 1M and 10M rows). This module reads only the folders' own small files; it imports nothing of the
readers.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Any

import yaml

from kiln.errors import KilnError

STATE, INFO, DICT, CARD = "state.json", "dataset_info.json", "dataset_dict.json", "README.md"
READABLE = (".parquet", ".arrow", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".ndjson", ".warc", ".warc.gz")
# The names of data files a folder's walk reads: READABLE, and JSON lines compressed under any of their names.
DATA = READABLE + tuple(f"{ext}.{z}" for ext in (".json", ".ndjson") for z in ("gz", "zst"))


def folder_files(folder: Path) -> list[str]:
    """The input files a dataset folder stands for, in reading order (rules: module docstring)."""
    if (folder / DICT).is_file():
        splits = _json(folder / DICT).get("splits")
        if not isinstance(splits, list) or not splits:
            raise KilnError(f"{folder / DICT}: no 'splits' list; is this a datasets.save_to_disk folder?")
        return [f for split in splits for f in folder_files(folder / _inside(folder, DICT, split))]
    if (folder / STATE).is_file():
        return _saved_dataset(folder)
    configs = _card_patterns(folder)
    if configs is None:
        return [str(p) for p in _data_under(folder)] or _not_data(folder)
    files: list[Path] = []
    for pattern in configs[0]:
        matched = sorted(p for p in folder.glob(_inside(folder, CARD, pattern)) if p.is_file())
        if not matched:
            raise KilnError(f"{folder / CARD}: data_files pattern {pattern!r} matches no file in {folder}")
        files += [p for p in matched if p not in files]
    named = {p for pattern in configs[1] for p in folder.glob(_inside(folder, CARD, pattern))}
    unnamed = [p for p in _data_under(folder) if Path(p) not in named and Path(p) not in files]
    if unnamed:
        more = f" (and {len(unnamed) - 1} more)" if len(unnamed) > 1 else ""
        raise KilnError(f"{folder}: {unnamed[0]}{more} is a data file that no config of {folder / CARD} names, so "
                        f"reading the folder would leave it out; give the files to read by name or glob (e.g. "
                        f"'{(folder / '**' / '*.parquet').as_posix()}'), or add it to the card's data_files")
    if not files:  # not a data set's folder
        return _not_data(folder)
    unreadable = [p for p in files if not p.name.lower().endswith(READABLE)]
    if unreadable:
        raise KilnError(f"{unreadable[0]}: a data file Kiln cannot read (it reads {', '.join(READABLE)}); give the "
                        "readable files or a glob instead of the folder")
    return [str(p) for p in files]


def _data_under(folder: Path, seen: set[str] | None = None) -> list[Path | str]:
    """Every data file under `folder` in sorted path order, a save_to_disk folder's files at its place (a folder
    reached twice through symlinks is read once)."""
    seen = set() if seen is None else seen
    seen.add(os.path.realpath(folder))
    found: list[Path | str] = []
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if os.path.realpath(path) in seen:
                continue
            saved = (path / DICT).is_file() or (path / STATE).is_file()
            found += folder_files(path) if saved else _data_under(path, seen)
        elif path.is_file() and path.name.lower().endswith(DATA):
            found.append(path)
    return found


def _not_data(folder: Path) -> list[str]:
    raise KilnError(f"input {folder} is a folder with no data files ({', '.join(DATA)}); give its files or a glob, "
                    f"e.g. '{(folder / '*.warc.gz').as_posix()}' or '{(folder / '*.jsonl').as_posix()}'")


def _saved_dataset(folder: Path) -> list[str]:
    if not (folder / INFO).is_file():
        raise KilnError(f"{folder}: has {STATE} but no {INFO}; not a complete datasets.save_to_disk folder")
    entries = _json(folder / STATE).get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise KilnError(f"{folder / STATE}: no '_data_files' list; is this a datasets.save_to_disk folder?")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        path = folder / _inside(folder, STATE, name)
        if not path.is_file():
            raise KilnError(f"{folder / STATE}: lists {name!r}, which is not in {folder}; the folder is incomplete")
        files.append(str(path))
    return files


def _inside(folder: Path, listing: str, name: Any) -> str:
    """`name` from the folder's own `listing` file, if it is a plain relative name inside the folder."""
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or "\\" in name \
            or ".." in posixpath.normpath(name).split("/") or ":" in name.split("/")[0]:
        raise KilnError(f"{folder / listing}: entry {name!r} is not a plain relative name inside {folder}; "
                        "refusing the folder")
    return name


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KilnError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _card_patterns(folder: Path) -> tuple[list[str], list[str]] | None:
    """(the default config's data_files patterns, every config's) from README.md's YAML header, or None without
    one."""
    card = folder / CARD
    if not card.is_file():
        return None
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return None
    try:
        header = yaml.safe_load(text[3:text.find("\n---", 3)]) if "\n---" in text[3:] else None
    except yaml.YAMLError as exc:
        raise KilnError(f"{card}: its YAML header does not parse ({str(exc).splitlines()[0]})") from None
    configs = header.get("configs") if isinstance(header, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    chosen = next((c for c in configs if isinstance(c, dict) and c.get("default")), None) \
        or next((c for c in configs if isinstance(c, dict) and c.get("config_name") == "default"), configs[0])
    every = [p for c in configs if c is not chosen for p in _config_patterns(card, c)]
    default = _config_patterns(card, chosen)
    return default, default + every


def _config_patterns(card: Path, config: Any) -> list[str]:
    files = config.get("data_files") if isinstance(config, dict) else None
    patterns: list[str] = []
    for item in files if isinstance(files, list) else [files]:
        paths = item.get("path") if isinstance(item, dict) else item
        patterns += paths if isinstance(paths, list) else [paths]
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise KilnError(f"{card}: config {config.get('config_name') if isinstance(config, dict) else config!r} "
                        "has no data_files patterns Kiln can read")
    return patterns
