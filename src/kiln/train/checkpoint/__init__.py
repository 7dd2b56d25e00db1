"""Checkpoints: the one face the loop, export, eval, the flow and the CLI use.

`checkpoints/step-NNNNNNNN/` is committed by rename after its manifest (docs/formats.md has every file). The
package, bottom up (each module imports only those above it in this list):
  storage.py       pieces of tensors in safetensors files, located by JSON indexes (the sharded format's bytes)
  folder.py        what every checkpoint folder has: its name, listing and retention, RNG states, signing,
                   and the small files (rng.pt, state.json) every rank reads itself
  saver.py         the CPU snapshot, the finiteness check and `Saver` (one write at a time, maybe in a thread)
  full.py          checkpoint.format=full: whole weights and optimizer state, written by rank 0
  sharded.py       checkpoint.format=sharded: every rank writes its pieces; any world size and mesh reads them
  read.py          either format: load, verify, the newest valid one, the table `kiln ckpt list` prints
  remote.py        checkpoint.dir (an fsspec URL): upload, COMMITTED marker, download into the local cache, retention
  agreement.py     the checkpoint (and data, tokenizer) every rank of a multi-rank run agrees on
  resume.py        the checks before a run trains: prepared data, the run folder's lock, resuming onto its own data
  checkpointer.py  `TrainState` and `Checkpointer`: save, resume and roll back, as the loop asks; `SaveClock`:
                   checkpoint.every_seconds
  init_from.py     train.init_from: a new run starts from another run's checkpoint, read as a resume reads it
A new checkpoint format is a module beside full.py and sharded.py with the same four methods (gather, write,
read, load), chosen in checkpointer.checkpoint_format and read back in read.load_checkpoint.
"""

from kiln.train.checkpoint.checkpointer import (Checkpointer, RunInputs, SaveClock, TrainState, checkpoint_format,
                                                config_hash)
from kiln.train.checkpoint.folder import (SMALL_FILES, checkpoint_config, list_checkpoints, restore_rng, retain,
                                          rng_state, sign_manifest, step_dir, step_of, verify_signature)
from kiln.train.checkpoint.full import FullCheckpoint, write_checkpoint
from kiln.train.checkpoint.read import (check_loads, checkpoint_table, latest_valid, latest_valid_of, load_checkpoint,
                                        verify_checkpoint)
from kiln.train.checkpoint.saver import Saver, all_finite, snapshot
from kiln.train.checkpoint.sharded import CheckpointWeights, ShardedCheckpoint, is_sharded
from kiln.train.checkpoint.storage import StreamedWeights, write_safetensors

__all__ = ["SMALL_FILES", "CheckpointWeights", "Checkpointer", "FullCheckpoint", "RunInputs", "SaveClock", "Saver",
           "ShardedCheckpoint", "StreamedWeights", "TrainState", "all_finite", "check_loads", "checkpoint_config",
           "checkpoint_format", "checkpoint_table", "config_hash", "is_sharded", "latest_valid", "latest_valid_of",
           "list_checkpoints", "load_checkpoint", "restore_rng", "retain", "rng_state", "sign_manifest", "snapshot",
           "step_dir", "step_of", "verify_checkpoint", "verify_signature", "write_checkpoint", "write_safetensors"]
