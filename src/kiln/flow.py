"""`kiln run`: every stage of kiln.stages in order; a stage whose committed output matches its inputs is skipped."""

from __future__ import annotations

import time
from typing import Any, Callable

from kiln.config import Config
from kiln.errors import ConfigError
from kiln.stages import STAGES, StageLog


def run_all(cfg: Config, log: Callable[[str], None] = print, until: str = "train") -> dict[str, Any]:
    """Run the stages in order up to and including `until`; returns each stage's result by name, its wall
    time (`timings_s`) and the stages that were already up to date (`skipped`)."""
    if until == "train":  # what would stop the last stage, before the first one's work
        from kiln.train.loggers import check_loggers

        if cfg.pack.format != "kiln":
            raise ConfigError(f"pack.format: {cfg.pack.format} packs for another trainer, which kiln train does not "
                              "read; add --until pack, or set pack.format: kiln to train with Kiln")

        check_loggers(cfg.train.loggers)
    results: dict[str, Any] = {"timings_s": {}, "skipped": []}
    for name, stage in STAGES.items():
        start = time.perf_counter()
        stage_log = StageLog(log)
        results[name] = stage(cfg, stage_log)
        results["timings_s"][name] = round(time.perf_counter() - start, 3)
        if stage_log.skipped:
            results["skipped"].append(name)
        if name == until:
            break
    return results
