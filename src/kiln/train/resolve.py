"""Where a command expects a checkpoint, a user may type a run folder: find the checkpoint they mean.

`resolve_checkpoint(path)` accepts, in this order:
  a checkpoint folder      run/checkpoints/step-NNNNNNNN (has state.json and manifest.json): itself;
  a checkpoints/ folder    its newest checkpoint that verifies;
  a run folder             {out_dir}/run: the newest valid one under run/checkpoints/;
  an out_dir               {out_dir}: the newest valid one under run/checkpoints/.
A newer checkpoint that fails verification is named and skipped. Anything else (a missing path, a
Hugging Face folder, a folder with no checkpoints) is a one-line KilnError saying what to pass instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.errors import IntegrityError, KilnError


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "state.json").is_file() and (folder / "manifest.json").is_file()


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] = lambda *_: None) -> Path:
    """The checkpoint folder `path` stands for; `log` is told which one was chosen when it was not `path`."""
    from kiln.train.checkpoint import latest_valid

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


def checkpoint_root(path: Path) -> tuple[Path, Path | None]:
    """(the checkpoints folder `path` names, the checkpoint folder itself when `path` is one, else None),
    nothing verified yet; a path that names no checkpoint is a one-line KilnError."""
    from kiln.train.checkpoint import list_checkpoints

    if not path.exists():
        raise KilnError(f"{path} does not exist; pass a checkpoint folder (run/checkpoints/step-NNNNNNNN) "
                        "or a run folder ({out_dir}/run)")
    if not path.is_dir():
        raise KilnError(f"{path} is a file; pass a checkpoint folder (run/checkpoints/step-NNNNNNNN) "
                        "or a run folder ({out_dir}/run)")
    if _is_checkpoint(path):
        return path.parent, path
    for root in (path, path / "checkpoints", path / "run" / "checkpoints"):
        if list_checkpoints(root):
            return root, None
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        raise KilnError(f"{path} is a Hugging Face model folder, not a Kiln checkpoint; "
                        f"bring it in with `kiln import --hf {path} --config CONFIG`")
    raise KilnError(f"{path}: no checkpoints here or under checkpoints/ or run/checkpoints/; "
                    "train first (`kiln train CONFIG`), or pass a checkpoint folder (run/checkpoints/step-NNNNNNNN)")
