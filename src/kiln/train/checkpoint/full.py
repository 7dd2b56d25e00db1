"""The full format (kiln.checkpoint.full: whole weights and optimizer state) as the loop uses it: rank 0 writes what
every rank gathered; rank 0 reads and broadcasts, unless every rank keeps its own part."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.checkpoint.full import read_folder, write_checkpoint

if TYPE_CHECKING:
    from kiln.train.parallel import Dist
    from kiln.train.parallel.parallelize import Parallelized


class FullCheckpoint:
    """The full format's four methods (gather, write, read, load), as checkpointer.Checkpointer uses them."""

    every_rank_writes = False  # rank 0 writes; the others only take part in the gather

    def gather(self, parallel: Parallelized, optimizer) -> tuple[dict, dict]:
        """Every rank takes part (FSDP2 gathers); the whole tensors, on CPU."""
        return parallel.full_states(optimizer)

    def write(self, root: Path, step: int, weights: tuple[dict, dict], rngs: list, state: dict, config_yaml: str,
              tokenizer_file: Path, fields: dict, signing_key: str | None) -> Path:
        """Rank 0 only."""
        return write_checkpoint(root, step, *weights, rngs, state, config_yaml, tokenizer_file, fields, signing_key)

    def read(self, folder: Path, d: Dist, every_rank: bool = False) -> dict[str, Any]:
        # Verified by agreement.agreed_checkpoint; only rank 0 reads the weights, and broadcasts them (load),
        # unless `every_rank` (Parallelized.every_rank_reads: pipeline stages, expert slices keep their part).
        return read_folder(folder, verify=False, weights=d.is_main or every_rank)

    def load(self, parallel: Parallelized, optimizer, data: dict[str, Any]) -> None:
        parallel.load(optimizer, data["model"], data["optimizer"])
