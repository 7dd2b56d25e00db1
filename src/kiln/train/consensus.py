"""What every rank must agree on before a multi-rank run starts or resumes: the data, the tokenizer and the
checkpoint to resume from.

Each rank sees its own filesystem: a node-local out_dir, or a shared one that lags (NFS attribute caches).
Left to itself every rank would pick the newest checkpoint it can verify, and two nodes could resume from
different steps, or train on different shards, without an error. Here rank 0 chooses and broadcasts, every
rank checks what it will read, and a disagreement stops every rank with one message naming the rank that
differs (never a hang: every rank takes part in every collective, whatever it found).

Cost: one all_gather of a few strings per rank, plus the hashing each rank does of the files it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kiln.errors import IntegrityError, KilnError
from kiln.manifest import MANIFEST, sha256_file
from kiln.train import checkpoint as ckpt
from kiln.train.parallel import Dist


def gather(d: Dist, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (all_gather_object over the default group)."""
    if d.world == 1:
        return [value]
    values: list[Any] = [None] * d.world
    dist.all_gather_object(values, value)
    return values


def broadcast(d: Dist, value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if d.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_inputs(d: Dist, inputs: dict[str, tuple[str, Path]]) -> None:
    """`inputs` maps a name ("data", "tokenizer") to (this rank's fingerprint, the file it comes from). Every
    rank must hold rank 0's; else every rank raises the same KilnError naming the ranks that differ."""
    mine = {name: fp for name, (fp, _) in inputs.items()}
    seen = gather(d, (d.host, mine))
    first = seen[0][1]
    bad = [(rank, host, name) for rank, (host, fps) in enumerate(seen) for name in inputs if fps[name] != first[name]]
    if bad:
        what = "; ".join(f"rank {r} on host {h} has another {name} ({seen[r][1][name][:12]}… vs rank 0's "
                         f"{first[name][:12]}…)" for r, h, name in bad)
        files = ", ".join(str(path) for _, path in inputs.values())
        raise KilnError(f"the ranks do not train on the same inputs: {what}; every rank must read the same "
                        f"{files} (copy them to every node, or put out_dir on a shared filesystem)")


def _readable(folder: Path, public_key: str | None) -> tuple[str | None, str | None]:
    """(problem, manifest sha256) of the files a rank other than 0 reads from `folder`."""
    try:
        ckpt.load_checkpoint(folder, verify=True, weights=False)
        if public_key:
            ckpt.verify_signature(folder, public_key)
        return None, sha256_file(folder / MANIFEST)
    except (IntegrityError, OSError) as exc:
        return str(exc), None


def agreed_checkpoint(d: Dist, root: Path, log: Callable[[str], None],
                      public_key: str | None = None, before: int | None = None) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's newest valid one that every other rank can read and
    whose manifest is byte-for-byte rank 0's. A candidate some rank cannot read is reported (rank, host, why)
    and the next older one is tried, as one process skips a corrupt checkpoint. None: start from scratch.

    Ranks other than 0 verify only the small files they read themselves (SMALL_FILES); rank 0 verifies the
    whole folder and broadcasts the weights (Parallelized.load). `before`: only checkpoints of earlier
    steps (a rollback)."""
    candidates = [c for c in ckpt.list_checkpoints(root) if before is None or ckpt.step_of(c) < before]
    if d.world == 1:
        return ckpt.latest_valid_of(candidates, log, public_key)
    candidates = candidates if d.is_main else []
    while True:
        step = -1
        while d.is_main and candidates and step < 0:
            folder = candidates.pop()
            if ckpt.latest_valid_of([folder], log, public_key) is not None:
                step = ckpt.step_of(folder)
        step = broadcast(d, step)
        if step < 0:
            return None
        folder = ckpt.step_dir(root, step)
        if d.is_main:
            found = (None, sha256_file(folder / MANIFEST))
        else:
            found = _readable(folder, public_key)
        seen = gather(d, (d.host, *found))
        manifest = seen[0][2]
        bad = [(r, h, why or "its manifest.json differs from rank 0's")
               for r, (h, why, sha) in enumerate(seen) if why or sha != manifest]
        if not bad:
            return folder
        if d.is_main:
            for rank, host, why in bad:
                log(f"skipping {folder.name}: rank {rank} on host {host} cannot resume from it ({why})")
