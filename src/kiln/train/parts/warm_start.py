"""Where a run started when it started from another run's weights (train.init_from), kept for its whole life."""

from __future__ import annotations

from typing import Any, Callable


class WarmStart:
    """The record of train.init_from: `run` (the run folder), `checkpoint` (the folder), `sha256` (of its
    manifest.json, which holds every file's sha256), `checkpoint_step` (its step) and `optimizer` (whether its
    AdamW state came too). Saved as `init_from` in every checkpoint's state.json, so a resumed run still says
    where it began; the run's first process writes it as an `init_from` event (step 0) into metrics.jsonl, which
    `kiln report` shows."""

    state_key = "init_from"

    def __init__(self, event: Callable[[dict], None]) -> None:
        self.event = event
        self.record: dict[str, Any] | None = None
        self.now = False  # this process made the warm start (its event is still to be written)

    def started(self, record: dict[str, Any]) -> None:
        self.record, self.now = record, True

    def pre_train(self) -> None:
        if self.now:
            self.event({"event": "init_from", "step": 0, **self.record})  # step: this run's, as every event's

    def state_dict(self) -> dict[str, Any] | None:
        return self.record

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.record = state
