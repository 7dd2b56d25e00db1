"""The folders of one out_dir, named in one place: every stage, command and report asks a `RunLayout` where a
run's docs, tokenizer, shards, run folder, checkpoints and caches are, and no other module spells those names.

    out_dir/
      docs/            the data stage's documents (kiln data)
      tokenizer/       the tokenizer folder (kiln tokenizer train, or tokenizer.path committed)
      shards/          the packed token shards (kiln pack)
      run/             the training run: metrics.jsonl, env.json, config.yaml, the lock
        checkpoints/   step-NNNNNNNN/ folders
        replicas/group-N/  torchft replica group N's own run folder (parallel.fault_tolerance)
      cache/shards/    shards fetched from a URL (loader.cache_dir's default)

The root is a local folder (a Path) or an fsspec URL (a str: `kiln train` with a URL out_dir reads tokenizer/ and
shards/ there); each folder is of the root's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DOCS, TOKENIZER, SHARDS, RUN, CHECKPOINTS, CACHE = "docs", "tokenizer", "shards", "run", "checkpoints", "cache"
# The folder each stage of a run commits, in the stages' order (kiln.stages runs them; `--until` names them).
STAGE_FOLDERS = {"data": DOCS, "tokenizer": TOKENIZER, "pack": SHARDS, "train": RUN}


@dataclass(frozen=True)
class RunLayout:
    root: Path | str

    @classmethod
    def of_run(cls, run_dir: Path | str) -> RunLayout:
        """The layout whose run folder is `run_dir` (a report given out_dir/run finds the shards beside it)."""
        return cls(Path(run_dir).parent if isinstance(run_dir, Path) else str(run_dir).rstrip("/").rsplit("/", 1)[0])

    def _at(self, *names: str) -> Path | str:
        if isinstance(self.root, Path):
            return self.root.joinpath(*names)
        return "/".join([str(self.root).rstrip("/"), *names])

    @property
    def docs(self) -> Path | str:
        return self._at(DOCS)

    @property
    def tokenizer(self) -> Path | str:
        return self._at(TOKENIZER)

    @property
    def shards(self) -> Path | str:
        return self._at(SHARDS)

    @property
    def run(self) -> Path | str:
        return self._at(RUN)

    @property
    def checkpoints(self) -> Path | str:
        return self._at(RUN, CHECKPOINTS)

    @property
    def shard_cache(self) -> Path | str:
        return self._at(CACHE, SHARDS)


def checkpoints_of(run_dir: Path) -> Path:
    """A run folder's checkpoints/ (the trainer and the checkpointer are given the run folder)."""
    return Path(run_dir) / CHECKPOINTS


def replica_run_of(run_dir: Path | str, group: int) -> Path:
    """The run folder of torchft replica group `group` >= 1 (group 0 writes the run folder itself)."""
    return Path(run_dir) / "replicas" / f"group-{group}"


def is_checkpoints_folder(folder: Path | str) -> bool:
    """`folder` is named as a run's checkpoints/ (retention removes step folders only inside one)."""
    return Path(str(folder)).name == CHECKPOINTS


def candidate_checkpoint_roots(path: Path) -> tuple[Path, ...]:
    """Where a checkpoint root may be, given a checkpoints/ folder, a run folder or an out_dir."""
    return (path, checkpoints_of(path), RunLayout(path).checkpoints)
