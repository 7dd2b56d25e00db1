"""Scoring a model in memory: summed losses and bits per byte (losses.py), multiple-choice accuracy with
lm-eval-harness's definitions (mc.py), sampling (sampling.py). Below the trainer (validation and the in-loop tasks
use it) and the data stage (the perplexity gate); kiln.eval, above, does the same for a checkpoint folder."""
