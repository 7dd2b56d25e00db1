"""Checkpoints on disk: the formats and their readers, the one face eval, data, ops, ablate, the flow and the CLI
use (kiln.train.checkpoint, above it, saves, resumes and agrees across ranks).

`checkpoints/step-NNNNNNNN/` is committed by rename after its manifest (docs/formats.md has every file). The
package, bottom up (each module imports only those above it in this list):
  storage.py  pieces of tensors in safetensors files, located by JSON indexes (the sharded format's bytes)
  folder.py   what every checkpoint folder has: its name, listing and retention, RNG states, signing,
              and the small files (rng.pt, state.json) every rank reads itself
  full.py     checkpoint.format=full: whole weights and optimizer state (model.safetensors, optimizer.pt)
  sharded.py  checkpoint.format=sharded: each rank's pieces and their indexes, read whole or a tensor at a time
  read.py     either format: load, verify, the newest valid one, the table `kiln ckpt list` prints
  remote.py   checkpoint.dir (an fsspec URL): upload, COMMITTED marker, download into the local cache, retention
  model.py    a verified checkpoint as a model in eval mode, with its tokenizer and run config
A new format is a module beside full.py and sharded.py, read back in read.load_checkpoint (and written by a class
in kiln.train.checkpoint with the same four methods as FullCheckpoint).
"""

from kiln.checkpoint.folder import (SMALL_FILES, checkpoint_config, list_checkpoints, restore_rng, retain, rng_state,
                                    sign_manifest, step_dir, step_of, verify_signature)
from kiln.checkpoint.full import write_checkpoint
from kiln.checkpoint.model import load_model
from kiln.checkpoint.read import (check_loads, checkpoint_table, latest_valid, latest_valid_of, load_checkpoint,
                                  verify_checkpoint)
from kiln.checkpoint.sharded import CheckpointWeights, is_sharded
from kiln.checkpoint.storage import StreamedWeights, write_safetensors

__all__ = ["SMALL_FILES", "CheckpointWeights", "StreamedWeights", "check_loads", "checkpoint_config",
           "checkpoint_table", "is_sharded", "latest_valid", "latest_valid_of", "list_checkpoints", "load_checkpoint",
           "load_model", "restore_rng", "retain", "rng_state", "sign_manifest", "step_dir", "step_of",
           "verify_checkpoint", "verify_signature", "write_checkpoint", "write_safetensors"]
