"""Checkpoints as training uses them: save, resume and roll back, every rank agreeing (the formats and their readers
are kiln.checkpoint, below this package).

  saver.py         the CPU snapshot, the finiteness check and `Saver` (one write at a time, maybe in a thread)
  full.py          FullCheckpoint: rank 0 writes what every rank gathered
  sharded.py       ShardedCheckpoint: every rank saves its pieces and loads its share, any world size and mesh
  agreement.py     the checkpoint (and data, tokenizer) every rank of a multi-rank run agrees on
  resume.py        the checks before a run trains: prepared data, the run folder's lock, resuming onto its own data
  checkpointer.py  `TrainState` and `Checkpointer`: save, resume and roll back, as the loop asks; `SaveClock`:
                   checkpoint.every_seconds
  init_from.py     train.init_from: a new run starts from another run's checkpoint, read as a resume reads it
A new checkpoint format is a class beside FullCheckpoint and ShardedCheckpoint with the same four methods (gather,
write, read, load), chosen in checkpointer.checkpoint_format.
"""

from kiln.train.checkpoint.checkpointer import (Checkpointer, RunInputs, SaveClock, TrainState, checkpoint_format,
                                                config_hash)
from kiln.train.checkpoint.full import FullCheckpoint
from kiln.train.checkpoint.saver import Saver, all_finite, snapshot
from kiln.train.checkpoint.sharded import ShardedCheckpoint

__all__ = ["Checkpointer", "FullCheckpoint", "RunInputs", "SaveClock", "Saver", "ShardedCheckpoint", "TrainState",
           "all_finite", "checkpoint_format", "config_hash", "snapshot"]
