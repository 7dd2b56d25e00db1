"""Where a command expects a checkpoint, a user may type a run folder: find the checkpoint they mean.

`resolve_checkpoint(path)` accepts, in this order:
  a checkpoint folder      run/checkpoints/step-NNNNNNNN (has state.json and manifest.json): itself;
  a checkpoints/ folder    its newest checkpoint that verifies;
  a run folder             {out_dir}/run: the newest valid one under run/checkpoints/;
  an out_dir               {out_dir}: the newest valid one under run/checkpoints/.
A newer checkpoint that fails verification is named and skipped. Anything else (a missing path, a
Hugging Face folder, a folder with no checkpoints) is a one-line KilnError saying what to pass instead
(checkpoint.folder.checkpoint_root, which train.init_from's lookup shares).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.errors import IntegrityError


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] = lambda *_: None) -> Path:
    """The checkpoint folder `path` stands for; `log` is told which one was chosen when it was not `path`."""
    from kiln.checkpoint import latest_valid
    from kiln.checkpoint.folder import checkpoint_root

    path = Path(path)
    root, folder = checkpoint_root(path)
    if folder is not None:
        return folder
    skipped: list[str] = []
    found = latest_valid(root, log=skipped.append)
    for message in skipped:
        log(message)
    if found is None:
        raise IntegrityError(f"{root}: no checkpoint verifies ({skipped[0] if skipped else 'none found'}); "
                             f"see `kiln ckpt list {root}`")
    log(f"using {found} (the newest valid checkpoint under {path})")
    return found
