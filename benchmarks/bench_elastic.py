"""A lost node: the time from the failure to the next step, and the work lost, with step-based and time-based
checkpoints, on two torchrun agents on this machine (benchmarks/elastic_agents.py: `--nnodes=1:2`, c10d on
localhost, gloo, one thread per worker, torch's rendezvous settings shortened to a 1 s keep-alive and last call).

For each model (a step time) and checkpoint policy, TRIALS times: both agents train; once the 2-rank group has
saved its first checkpoint, after a random delay in [0, SPAN) s node B is lost (SIGKILL of its agent and every
descendant); node A goes on alone from the newest checkpoint. Measured, from A's `membership` record and the
harness's clock:

  recovery_s   from the kill to the end of the first step of A alone (the step record's wall_time)
  lost_steps   steps trained past the checkpoint resumed (they run again), and lost_s their wall seconds

Policies, both with async sharded saves (`checkpoint.format: sharded`, `async_save: true`):
  steps        checkpoint.every = EVERY_STEPS
  time         checkpoint.every_seconds = EVERY_SECONDS (checkpoint.every beyond the run)
Models: `small` (d=64, 2 layers) and `base` (bench_train_step's d=256, 4 layers), seq 256, global batch 8:
step-based saves lose work in proportion to the step time, time-based ones at most EVERY_SECONDS plus a save.
Reported: medians over the trials, the step time of each model, and the load average of this shared machine
before and after.

    python -m benchmarks elastic
    KILN_BENCH_RUNS=5 python -m benchmarks elastic     # trials per model and policy (default 3)
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench_train_step import bench_config, fresh_out, prepare
from benchmarks.elastic_agents import Job, records, wait_until
from kiln.config import build_config

TRIALS = int(os.environ.get("KILN_BENCH_RUNS", "3"))
SPAN = 30.0  # longer than either policy's interval between saves on the base model
EVERY_STEPS, EVERY_SECONDS = 20, 5.0
MODELS = {"small": {"dim": 64, "n_layers": 2, "n_heads": 4}, "base": {"dim": 256, "n_layers": 4, "n_heads": 4}}
POLICIES = {"steps": {"every": EVERY_STEPS}, "time": {"every": 1_000_000, "every_seconds": EVERY_SECONDS}}


def saved_on_two(out: Path) -> bool:
    """A checkpoint saved by the 2-rank group (not by node A alone before B joined)."""
    two = [r["step"] for r in records(out, "step") if r["world"] == 2]
    return bool(two) and any(r["step"] >= two[0] and "refused" not in r for r in records(out, "save"))


def membership(out: Path, change: str) -> list[dict]:
    return [r for r in records(out, "membership") if r["change"] == change]


def trial(data: Path, parent: Path, model: str, policy: str, rng: random.Random) -> dict:
    out = fresh_out(data, parent)
    cfg = bench_config(out, max_steps=100_000, threads=1, log_every=50).model_dump(mode="json")
    cfg["model"].update(MODELS[model])
    cfg["checkpoint"] = {**cfg["checkpoint"], "format": "sharded", "async_save": True, "keep_last": 2,
                         **POLICIES[policy]}
    cfg["watchdog"]["stall_timeout_s"] = 120
    path = out / "config.yaml"
    path.write_text(build_config(cfg).to_yaml())
    job = Job(path, out / "agents", max_restarts=3)
    try:
        a, b = job.start("node-a"), job.start("node-b")
        wait_until(lambda: saved_on_two(out), "the first checkpoint of the 2-rank group", 900, [a, b])
        time.sleep(rng.uniform(0, SPAN))  # the failure comes at a random moment, not at a step boundary
        steps_before = [r for r in records(out, "step") if r["world"] == 2]
        killed = b.lose()
        # the record comes with A's first step alone (a start of A alone before B joined is no shrink)
        wait_until(lambda: membership(out, "shrink"), "a step of node A alone", 600, [a])
        shrink = membership(out, "shrink")[-1]
        first = [r for r in records(out, "step") if r["world"] == 1 and r["step"] == shrink["step"] + 1][-1]
    finally:
        job.close()
    step_s = statistics.median(r["step_time_s"] for r in steps_before[len(steps_before) // 2:])
    return {"recovery_s": first["wall_time"] - killed, "lost_steps": shrink["lost_steps"],
            "lost_s": shrink["lost_s"] or 0.0, "step_s": step_s}


def main() -> None:
    rng = random.Random()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-elastic-") as tmp:
        data = prepare(Path(tmp))
        rows = []
        for model in MODELS:
            for policy in POLICIES:
                got = [trial(data, Path(tmp), model, policy, rng) for _ in range(TRIALS)]
                row = {"model": model, "policy": policy,
                       **{k: statistics.median(g[k] for g in got) for k in got[0]},
                       "lost_s_max": max(g["lost_s"] for g in got)}
                rows.append(row)
                each = ", ".join("{recovery_s:.1f}/{lost_s:.1f}".format(**g) for g in got)
                print(f"{model:5s} {policy:5s}  step {row['step_s'] * 1000:5.0f} ms"
                      f"  recovery {row['recovery_s']:5.1f} s  lost {row['lost_steps']:4.0f} steps"
                      f" = {row['lost_s']:5.1f} s (max {row['lost_s_max']:.1f} s)"
                      f"  [recovery/lost s: {each}]")
    print(f"medians of {TRIALS} trials; load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} cores)")
