"""`kiln eval`: a checkpoint's loss, perplexity and bits per byte on the run's validation shards or a text file
(eval/loss.py), its accuracy on multiple-choice tasks (eval/mc.py), and text sampled from it (eval/generate.py).
Everything here takes a checkpoint folder; what scores a model in memory is kiln.scoring, below the trainer."""

from kiln.eval.generate import generate_from_checkpoint
from kiln.eval.loss import evaluate_checkpoint
from kiln.eval.mc import checkpoint_question_results, evaluate_mc_checkpoint

__all__ = ["checkpoint_question_results", "evaluate_checkpoint", "evaluate_mc_checkpoint", "generate_from_checkpoint"]
