"""What every rank must agree on before a multi-rank run starts or resumes: the data, the tokenizer and the
checkpoint to resume from.

Each rank sees its own filesystem: a node-local out_dir, or a shared one that lags (NFS attribute caches).
Left to itself every rank would pick the newest checkpoint it can verify, and two nodes could resume from
different steps, or train on different shards, without an error. Here rank 0 chooses and broadcasts, every
rank checks its share of the files and what it will read, and a disagreement stops every rank with one message
naming the rank that differs (never a hang: every rank takes part in every collective, whatever it found).

Cost: a few all_gathers of a few strings per rank, plus the hashing: each rank hashes its share of a
checkpoint's files (hash_shares), all ranks at once, so the resume waits for the largest share, not the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import HASH_THREADS, MANIFEST, read_manifest, sha256_file, verify_folder
from kiln.checkpoint.folder import SMALL_FILES, list_checkpoints, step_dir, step_of, verify_signature
from kiln.checkpoint.read import check_loads, load_checkpoint
# The checkpoint's own gloo group (checkpoint.save_timeout_s), which saves talk over: the agreement waits for
# hashing as a save waits for writing.
from kiln.checkpoint.sharded import is_sharded
from kiln.train.checkpoint.sharded import checkpoint_group
from kiln.checkpoint.storage import rank_file
from kiln.train.parallel import Dist, all_gather_objects, broadcast_object


def check_same_inputs(d: Dist, inputs: dict[str, tuple[str, Path]]) -> None:
    """`inputs` maps a name ("data", "tokenizer") to (this rank's fingerprint, the file it comes from). Every
    rank must hold rank 0's; else every rank raises the same KilnError naming the ranks that differ."""
    mine = {name: fp for name, (fp, _) in inputs.items()}
    seen = all_gather_objects(d, (d.host, mine))
    first = seen[0][1]
    bad = [(rank, host, name) for rank, (host, fps) in enumerate(seen) for name in inputs if fps[name] != first[name]]
    if bad:
        what = "; ".join(f"rank {r} on host {h} has another {name} ({seen[r][1][name][:12]}… vs rank 0's "
                         f"{first[name][:12]}…)" for r, h, name in bad)
        files = ", ".join(str(path) for _, path in inputs.values())
        raise KilnError(f"the ranks do not train on the same inputs: {what}; every rank must read the same "
                        f"{files} (copy them to every node, or put out_dir on a shared filesystem)")


def hash_shares(files: dict[str, dict], views: list, sharded: bool) -> list[list[str]]:
    """Which of a checkpoint's files (its manifest's `files`) each rank hashes at resume, so that each is hashed
    once and the ranks hash at the same time; every rank computes the same shares from the same manifest.

    The small files every rank reads itself (folder.SMALL_FILES) are in no share: each rank verifies its own.
    - sharded: rank R's own files (model-R, optimizer-R, index-R: it wrote them, and on the same layout reads
      them) go to rank R; the rest, largest first, to the rank with the fewest bytes so far. The format needs a
      filesystem every rank sees, so any rank may hash any file.
    - full: rank 0 alone reads the weights and optimizer state (and broadcasts them), from its own filesystem,
      which may be node-local: the files go, largest first, to the ranks that see the very checkpoints folder
      rank 0 sees (`views`: every rank's `_view`, equal for those ranks).
    One file is hashed by one rank (sha256 does not split), so the largest file bounds the time.
    """
    world = len(views)
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    own = {rank_file(kind, r, ext): r for r in range(world) if sharded
           for kind, ext in (("model", "safetensors"), ("optimizer", "safetensors"), ("index", "json"))}
    helpers = list(range(world)) if sharded else [r for r in range(world) if views[r] == views[0]]
    rest = []
    for name, meta in files.items():
        if name in SMALL_FILES:
            continue
        size = meta.get("size", 0) if isinstance(meta, dict) else 0
        if name in own:
            shares[own[name]].append(name)
            load[own[name]] += size
        else:
            rest.append((size, name))
    for size, name in sorted(rest, key=lambda f: (-f[0], f[1])):
        rank = min(helpers, key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += size
    return shares


# How a rank's problem with a candidate counts (_verdict): a file of its share that does not hash as the manifest
# says, or any problem rank 0 finds (it reads the weights), makes the checkpoint corrupt for every rank; a small
# file that another rank alone cannot read is that rank's.
OWN, RANK0, SHARE = 0, 1, 2


def _view(root: Path, d: Dist) -> tuple:
    """Where this rank sees the checkpoints: (host, device, inode) of the folder. Equal on two ranks of one host
    that see the same folder, whatever its path; different for node-local copies."""
    try:
        st = Path(root).stat()
        return d.host, st.st_dev, st.st_ino
    except OSError:
        return d.host, None, str(root)


def _verdict(folder: Path, d: Dist, views: list, public_key: str | None) -> tuple[str | None, int, str | None]:
    """This rank's check of candidate `folder`: (the problem or None, OWN / RANK0 / SHARE, the sha256 of its
    manifest.json)."""
    whose = RANK0 if d.is_main else OWN
    try:
        manifest = read_manifest(folder)
    except (IntegrityError, OSError) as exc:
        return str(exc), whose, None
    share = hash_shares(manifest["files"], views, is_sharded(folder))[d.rank]
    try:
        verify_folder(folder, only=set(share), workers=HASH_THREADS)
    except (IntegrityError, OSError) as exc:
        return str(exc), SHARE, None
    try:
        load_checkpoint(folder, verify=True, weights=False)  # the small files this rank reads itself
        if public_key:
            verify_signature(folder, public_key)
        if d.is_main:
            check_loads(folder)
        return None, whose, sha256_file(folder / MANIFEST)
    except (IntegrityError, OSError) as exc:
        return str(exc), whose, None


def agreed_checkpoint(d: Dist, root: Path, log: Callable[[str], None], public_key: str | None = None,
                      before: int | None = None, timeout_s: float = 1800.0) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's newest one that every rank verifies and whose manifest is
    byte-for-byte rank 0's; None: start from scratch. `before`: only checkpoints of earlier steps (a rollback).

    For each candidate, newest first, every rank hashes its share of the files (`hash_shares`) in parallel with
    the others, and the small files it reads itself; one all_gather of the verdicts decides. A corrupt file,
    whichever rank hashed it, is one line ("skipping corrupt checkpoint: ...", as one process says it) and every
    rank tries the next older candidate; a candidate some rank alone cannot read is reported (rank, host, why).
    The collectives go over the checkpoint's own gloo group with `timeout_s` (checkpoint.save_timeout_s): ranks
    wait for the slowest hasher, which is no hung collective (the caller tells the watchdog: Checkpointer.agreed).
    """
    candidates = [c for c in list_checkpoints(root) if before is None or step_of(c) < before]
    group = checkpoint_group(d, timeout_s)
    views = all_gather_objects(d, _view(root, d), group)
    candidates = candidates if d.is_main else []
    while True:
        step = broadcast_object(d, step_of(candidates.pop()) if candidates else -1, group)
        if step < 0:
            return None
        folder = step_dir(root, step)
        seen = all_gather_objects(d, (d.host, *_verdict(folder, d, views, public_key)), group)
        manifest = seen[0][3]
        # a hash mismatch first: the line one process would give (a file that does not hash may not load either)
        corrupt = [why for _, why, whose, _ in sorted(seen, key=lambda v: -v[2]) if why and whose != OWN]
        bad = [(r, h, why or "its manifest.json differs from rank 0's")
               for r, (h, why, _, sha) in enumerate(seen) if why or sha != manifest]
        if not bad:
            return folder
        if d.is_main and corrupt:
            log(f"skipping corrupt checkpoint: {corrupt[0]}")
        elif d.is_main:
            for rank, host, why in bad:
                log(f"skipping {folder.name}: rank {rank} on host {host} cannot resume from it ({why})")
