"""The parts the training loop is composed of (OLMo-core's callbacks): each a small class with only the hooks it
needs, and, when it holds state a resume must restore, its own `state_dict()` / `load_state_dict()`.

Hooks the loop (trainer.py) calls on every part that defines them, in the order the parts are listed:

    pre_train()            after resume, before the first step (start threads, install handlers)
    pre_step(step)         before optimizer step `step` (1-based)
    flags() -> dict        requests (stop, save, save_due, budget) agreed by every rank in the step's one all-reduce
    post_step(outcome)     after the step: an `Outcome` with the step's numbers
    close()                in the loop's finally, also on errors

The engine calls the schedule probes' `before_clip(engine)` and `after_step(engine, step, grad_norm, out)`,
and asks the guards' `check(loss, grad_norm)`.

State: a class with a `state_key` is saved as `state[state_key] = part.state_dict()` in every checkpoint and
restored by that key on resume (train/checkpoint/checkpointer.py); `restore_on_rollback = True` restores it on a
rollback too.
Adding a stateful part is one class, listed once in Trainer.parts.
"""

from kiln.train.parts.outcome import Outcome

__all__ = ["Outcome"]
