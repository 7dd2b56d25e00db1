"""Resumes onto new shards or a new tokenizer (train.resume_on_new_data), each recorded in every later checkpoint."""

from __future__ import annotations

from typing import Any, Callable


class DataResets:
    """A resume onto other data restarts the loader at the start of a fresh epoch 0 (the old position means
    nothing on other shards) and is recorded: in `resume_on_new_data` events and as `data_resets` in state."""

    state_key = "data_resets"

    def __init__(self, loader, seed: int, event: Callable[[dict], None]) -> None:
        self.loader, self.seed, self.event = loader, seed, event
        self.resets: list[dict[str, Any]] = []
        self.now: dict[str, Any] | None = None  # the reset of this process's resume, if any

    def reset(self, step: int, folder: str, changes: Any, data_fingerprint: str, tokenizer_sha: str) -> None:
        self.loader.load_state_dict({"seed": self.seed, "epoch": 0, "position": 0})
        self.now = {"step": step, "from": folder, "changed": changes, "data_fingerprint": data_fingerprint,
                    "tokenizer_sha256": tokenizer_sha}
        self.resets.append(self.now)

    def pre_train(self) -> None:
        if self.now is not None:
            self.event({"event": "resume_on_new_data", **self.now})

    def state_dict(self) -> list[dict[str, Any]]:
        return self.resets

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.resets = list(state)
