"""metrics.jsonl: one JSON object per line, `event` = "step" (one per optimizer step) or "eval"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.manifest import write_atomic


class MetricsLog:
    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Lines written after the checkpoint we resume from describe steps that will run again.
        if self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(ln + "\n" for ln in keep))
        self.file = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
