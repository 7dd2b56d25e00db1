"""A checkpoint folder, whatever its format: `checkpoints/step-NNNNNNNN/`, committed by rename after its manifest.

Every checkpoint folder holds, beside its format's weights (full.py: model.safetensors, optimizer.pt;
sharded.py: each rank's pieces and index.json):
  rng.pt              RNG states of every rank (python, numpy, torch CPU, the rank's own CUDA device)
  state.json          step, tokens seen and the train state's parts (checkpointer.TrainState)
  config.yaml         the resolved config of the run
  tokenizer.json      the tokenizer, so the folder alone can evaluate and generate
  manifest.json       size and sha256 of each file above, step, tokens seen, config hash, data
                      fingerprint, world size, environment fingerprint, Kiln version; written last
  manifest.sig        optional Ed25519 signature of manifest.json's bytes
Here: the folder's name, listing and retention, the RNG states, signing, and reading the small files
(rng.pt, state.json) that every rank reads itself.

Every file any reader opens (the files above, the format's weights, optimizer state and indexes) is opened
through `listed_file`: it must be listed in manifest.json with its size and sha256, so the hashes that `kiln
ckpt verify` and every reader check cover it; a file dropped from the manifest is refused, never read unhashed.
"""

from __future__ import annotations

import json
import random
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from kiln.errors import IntegrityError, KilnError
from kiln.lock import unpinned
from kiln.manifest import MANIFEST, read_manifest, remove_folder, set_aside, verify_folder, write_atomic
from kiln.names import listed_name
from kiln.run_layout import candidate_checkpoint_roots, is_checkpoints_folder

STEP_DIR = re.compile(r"^step-(\d{8})$")
SIGNATURE = "manifest.sig"
# What a rank other than 0 reads on resume: rank 0 reads the weights and broadcasts them.
SMALL_FILES = {"rng.pt", "state.json"}
# What every checkpoint holds beside its format's files, each of which some reader opens.
COMMON_FILES = ("rng.pt", "state.json", "config.yaml", "tokenizer.json")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def step_of(folder: Path) -> int:
    return int(STEP_DIR.match(Path(folder).name).group(1))


def check_step(folder: Path, manifest: dict[str, Any]) -> None:
    """The step manifest.json states is the folder's own (`step-NNNNNNNN`) and state.json's: an unsigned manifest
    edited to say another step (its hashes still match) would have `ckpt verify`, `ckpt list` and a resume
    report and pick the wrong one. Call after the folder verified (state.json is then the one hashed)."""
    folder = Path(folder)
    step = manifest.get("step")
    named = step_of(folder) if STEP_DIR.match(folder.name) else step
    try:
        state = json.loads((folder / "state.json").read_text()).get("step", step)
    except (OSError, ValueError, AttributeError):
        state = step  # a missing or unreadable state.json is reported by the load checks
    if not (isinstance(step, int) and step == named == state):
        raise IntegrityError(f"{folder}: manifest.json says step {step!r}, but the folder is step {named} and "
                             f"state.json says {state!r}; the manifest was changed after Kiln wrote it: restore the "
                             "checkpoint from a copy, or resume from another (checkpoint.signing_key signs manifests)")


# --- RNG -------------------------------------------------------------------------------------

def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states as tensors and plain lists, so they load with weights_only=True.

    CUDA: only this rank's own device (`device`), not every visible one, so a resume where each process sees
    fewer GPUs (a launcher that masks them) restores what it saved instead of failing on a missing index.
    """
    py = random.getstate()
    np_state = np.random.get_state()
    cuda = device is not None and device.type == "cuda"
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if cuda else None,
    }


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device is None or device.type != "cuda" or cuda is None or (isinstance(cuda, list) and not cuda):
        return
    if isinstance(cuda, list):  # written before states were per device: every visible device's, by index
        index = device.index or 0
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda, device)


# --- signing ---------------------------------------------------------------------------------

def _read_key(path: str, private: bool):
    from cryptography.hazmat.primitives import serialization

    try:
        data = Path(path).read_bytes()
        if private:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (OSError, ValueError) as exc:
        kind = "checkpoint.signing_key" if private else "checkpoint.public_key"
        raise KilnError(f"{kind} {path}: not a readable Ed25519 PEM key ({exc})") from None


def sign_manifest(folder: Path, key_path: str) -> None:
    key = _read_key(key_path, private=True)
    write_atomic(Path(folder) / SIGNATURE, key.sign((Path(folder) / MANIFEST).read_bytes()).hex())


def verify_signature(folder: Path, public_key_path: str) -> None:
    from cryptography.exceptions import InvalidSignature

    sig = Path(folder) / SIGNATURE
    if not sig.is_file():
        raise IntegrityError(f"{folder}: unsigned, but checkpoint.public_key requires a signature ({SIGNATURE})")
    try:
        _read_key(public_key_path, private=False).verify(
            bytes.fromhex(sig.read_text().strip()), (Path(folder) / MANIFEST).read_bytes()
        )
    except (InvalidSignature, ValueError):
        raise IntegrityError(
            f"{folder}/{SIGNATURE}: signature does not match manifest.json under {public_key_path}"
        ) from None



# --- listing and retention -----------------------------------------------------------------

def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def checkpoint_root(path: Path) -> tuple[Path, Path | None]:
    """(the checkpoints folder `path` names, the checkpoint folder itself when `path` is one, else None),
    nothing verified yet: `path` is a checkpoint folder, a checkpoints/ folder, a run folder or an out_dir. A path
    that names no checkpoint is a one-line KilnError."""
    if not path.exists():
        raise KilnError(f"{path} does not exist; pass a checkpoint folder (run/checkpoints/step-NNNNNNNN) "
                        "or a run folder ({out_dir}/run)")
    if not path.is_dir():
        raise KilnError(f"{path} is a file; pass a checkpoint folder (run/checkpoints/step-NNNNNNNN) "
                        "or a run folder ({out_dir}/run)")
    if (path / "state.json").is_file() and (path / MANIFEST).is_file():
        return path.parent, path
    for root in candidate_checkpoint_roots(path):
        if list_checkpoints(root):
            return root, None
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        raise KilnError(f"{path} is a Hugging Face model folder, not a Kiln checkpoint; "
                        f"bring it in with `kiln import --hf {path} --config CONFIG`")
    raise KilnError(f"{path}: no checkpoints here or under checkpoints/ or run/checkpoints/; "
                    "train first (`kiln train CONFIG`), or pass a checkpoint folder (run/checkpoints/step-NNNNNNNN)")


def retain(root: Path, keep_last: int, keep_every: int | None, best_step: int | None) -> list[Path]:
    """Delete committed checkpoints that no rule keeps: the last K, every M-th, the best; one a reader pins
    (`kiln.lock.pinned`: an export) is spared until a later save. Each is moved aside before it is removed
    (`kiln.manifest.set_aside`); what an older Kiln's killed removal left (`half_deleted`) goes too. Returns the
    deleted."""
    ckpts = [c for c in list_checkpoints(root) if not half_deleted(c)]
    keep = kept_steps([step_of(c) for c in ckpts], keep_last, keep_every, best_step)
    gone = [c for c in ckpts if step_of(c) not in keep and _written_by_kiln(c)]  # never one Kiln cannot vouch for
    halves = [c for c in list_checkpoints(root) if half_deleted(c)]
    return [c for c in gone + halves if _remove(c, in_place=c in halves)]


def kept_steps(steps: list[int], keep_last: int, keep_every: int | None, best_step: int | None) -> set[int]:
    """The steps retention keeps of `steps` (ascending): the last K, every M-th, the best."""
    keep = set(steps[-keep_last:])
    keep |= {s for s in steps if keep_every and s % keep_every == 0}
    return keep | {s for s in steps if s == best_step}


def remove_checkpoint(folder: Path) -> bool:
    """Remove one checkpoint folder Kiln wrote as retention does (aside first; spared while a reader pins it);
    False for one Kiln cannot vouch for, or a pinned one."""
    halved = half_deleted(folder)
    return (halved or _written_by_kiln(Path(folder))) and _remove(Path(folder), in_place=halved)


def _remove(folder: Path, in_place: bool) -> bool:
    with unpinned(folder) as free:  # held while it goes (aside): a reader that comes later finds it gone
        if free and in_place:
            remove_folder(folder, ignore_errors=True)
        elif free:
            folder = set_aside(folder)
    if free and not in_place:
        remove_folder(folder, ignore_errors=True)
    return free


# The names a checkpoint's files have (this module's, full.py's and sharded.py's).
CHECKPOINT_FILE = re.compile(r"^(model\.safetensors|optimizer\.pt|rng\.pt|state\.json|config\.yaml|tokenizer\.json|"
                             r"manifest\.sig|index\.json|(model|optimizer)-\d{5}\.safetensors|index-\d{5}\.json)$")


def half_deleted(folder: Path) -> bool:
    """A `checkpoints/step-NNNNNNNN` without manifest.json holding nothing but checkpoint files (by name): what
    a removal killed part-way left before removals went aside first. Never committed, so never read: retention
    removes it; anything else in it (a user's file) keeps it."""
    folder = Path(folder)
    if (not STEP_DIR.match(folder.name) or not is_checkpoints_folder(folder.parent) or folder.is_symlink()
            or not folder.is_dir() or (folder / MANIFEST).exists()):
        return False
    return all(p.is_file() and not p.is_symlink() and CHECKPOINT_FILE.match(p.name) for p in folder.iterdir())


def _written_by_kiln(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("stage") == "checkpoint"
    except (OSError, ValueError, AttributeError):
        return False



def checkpoint_config(folder: Path):
    """The run config a checkpoint holds (config.yaml, a file its manifest lists: `listed_file`)."""
    from kiln.config import load_config

    if not (Path(folder) / MANIFEST).is_file() and not (Path(folder) / "config.yaml").is_file():
        raise KilnError(f"{folder}: no config.yaml; is this a Kiln checkpoint folder (run/checkpoints/step-NNNNNNNN)?")
    return load_config(listed_file(folder, "config.yaml"))


# --- reading the small files -----------------------------------------------------------------

def listed_file(folder: Path, name: str, files: dict[str, Any] | None = None) -> Path:
    """`folder / name` for a file a reader of the checkpoint opens: a plain name the manifest (`files`: its files,
    read from the folder when not given) lists with its size and sha256 (`kiln.names.listed_name`), so the hashes
    the readers check cover it; else one IntegrityError naming the file."""
    folder = Path(folder)
    files = read_manifest(folder)["files"] if files is None else files
    return listed_name(folder, name, files, folder)


def check_listed(folder: Path, names: Iterable[str], files: dict[str, Any] | None = None) -> None:
    """Every file of COMMON_FILES and `names` (the format's own) is listed in the manifest (`listed_file`)."""
    files = read_manifest(folder)["files"] if files is None else files
    for name in (*COMMON_FILES, *names):
        listed_file(folder, name, files)


def check_manifest(folder: Path, verify: bool, weights: bool) -> dict[str, Any]:
    """Before a format reads its files: every file hashed against manifest.json (`verify`; only SMALL_FILES when
    not `weights`), else the manifest read (a folder without one is refused); every one of COMMON_FILES must be
    listed. Returns the manifest's files, which the reader opens its own files through (`listed_file`)."""
    if verify:
        files = verify_folder(folder, only=None if weights else SMALL_FILES)["files"]
    else:
        files = read_manifest(folder)["files"]
    check_listed(folder, (), files)
    return files


@contextmanager
def loads_safely(folder: Path) -> Iterator[None]:
    """Anything that fails to load inside (UnpicklingError for a pickle that is not plain data, SafetensorError,
    ...) is an IntegrityError naming the folder."""
    try:
        yield
    except Exception as exc:  # whatever a loader raises for bytes it cannot take: one IntegrityError
        raise IntegrityError(f"{folder}: cannot be loaded safely ({type(exc).__name__}: {str(exc)[:200]})") from None


def read_small_files(folder: Path) -> dict[str, Any]:
    """{"rng", "state"}: rng.pt with weights_only torch.load, state.json as JSON (no code runs)."""
    files = read_manifest(folder)["files"]
    return {"rng": torch.load(listed_file(folder, "rng.pt", files), map_location="cpu", weights_only=True),
            "state": json.loads(listed_file(folder, "state.json", files).read_text())}
