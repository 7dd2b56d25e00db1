"""DiLoCo against plain DDP on the same data and token budget: the validation loss after STEPS steps, and the
communication volume per step (issue 42).

Both train bench_train_step's prepared sample (seq 256, global batch 8, seed 7) with the small model below, the
same schedule and inner optimizer (AdamW, lr LR), and evaluate on the same validation rows (EVAL_BATCHES of
DDP's 2 ranks' micro-batches) at step 0 and step STEPS:

  ddp      `torchrun --nproc_per_node=2 -m kiln train`: 2 ranks, gradients all-reduced every step
  diloco   a `torchft_lighthouse` on 127.0.0.1 and 2 torchft replica groups of 1 rank (`kiln train` with
           KILN_REPLICA_GROUP=0/1, gloo), `train.outer: {algorithm: diloco, sync_every: SYNC_EVERY}` with the
           DiLoCo paper's outer Nesterov SGD (lr 0.7, momentum 0.9): each group its half of every global batch,
           the pseudo-gradients averaged every SYNC_EVERY steps (STEPS a multiple of it: the last step syncs)

Communication per step is the bytes one rank hands to all-reduces, per step: DDP's gradients are the model's
size in fp32 every step (the `startup` record's param_bytes); DiLoCo's are counted by ReplicaGroups.bytes (its
`outer_sync` records' `bytes`, summed over the run, over STEPS). A ring all-reduce's traffic is the same
multiple of that payload for both. Also reported: each run's wall time (2 processes on this shared machine).

    python -m benchmarks diloco
    STEPS=400 SYNC_EVERY=20 python -m benchmarks diloco
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_train_step import bench_config, fresh_out, prepare
from benchmarks.elastic_agents import ROOT, Lighthouse, records

STEPS = int(os.environ.get("STEPS", "200"))
SYNC_EVERY = int(os.environ.get("SYNC_EVERY", "10"))
EVAL_BATCHES = 16
LR = 1e-3
MODEL = {"dim": 128, "n_layers": 2, "n_heads": 4}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "KILN_FT_HOST": "127.0.0.1",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def config(out: Path, outer: bool) -> Path:
    # The validator takes eval_batches x micro-batch rows per data-parallel rank of the run (of a group under
    # torchft): the group's one rank takes twice DDP's batches, so both score the same first rows.
    cfg = bench_config(out, max_steps=STEPS, threads=1, lr=LR, warmup_steps=10, micro_batch_size=4,
                       eval_every=STEPS, eval_batches=EVAL_BATCHES * (2 if outer else 1),
                       log_every=50).model_dump(mode="json")
    cfg["model"].update(MODEL)
    if outer:
        cfg["train"]["outer"] = {"algorithm": "diloco", "sync_every": SYNC_EVERY}
        cfg["parallel"].update(fault_tolerance="torchft", torchft={"timeout_s": 30, "quorum_timeout_s": 300})
        cfg["checkpoint"]["format"] = "full"
    from kiln.config import build_config

    path = out / "config.yaml"
    path.write_text(build_config(cfg).to_yaml())
    return path


def finished(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    for proc, log in zip(procs, logs):
        if proc.wait(3600) != 0:
            raise RuntimeError(f"{log}: exit {proc.returncode}\n{log.read_text()[-3000:]}")


def ddp(out: Path) -> dict:
    log = out / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "kiln",
           "train", str(config(out, outer=False))]
    tick = time.perf_counter()
    finished([subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT)], [log])
    wall = time.perf_counter() - tick
    return {"wall_s": wall, "bytes_per_step": records(out, "startup")[0]["param_bytes"], **losses(out)}


def diloco(out: Path) -> dict:
    path = config(out, outer=True)
    lighthouse = Lighthouse(out, min_replicas=2)
    logs = [out / f"group-{g}.log" for g in (0, 1)]
    try:
        tick = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "kiln", "train", str(path)], cwd=ROOT,
                                  env={**ENV, "KILN_REPLICA_GROUP": str(g), "TORCHFT_LIGHTHOUSE": lighthouse.url},
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT) for g, log in enumerate(logs)]
        finished(procs, logs)
        wall = time.perf_counter() - tick
    finally:
        lighthouse.close()
    syncs = records(out, "outer_sync")
    assert len(syncs) == STEPS // SYNC_EVERY and all(s["committed"] for s in syncs), syncs
    return {"wall_s": wall, "bytes_per_step": sum(s["bytes"] for s in syncs) / STEPS, "syncs": len(syncs),
            **losses(out)}


def losses(out: Path) -> dict:
    evals = {r["step"]: r["val_loss"] for r in records(out, "eval")}
    steps = [r["loss"] for r in records(out, "step")]
    return {"val_start": evals[0], "val_end": evals[STEPS], "train_last10": sum(steps[-10:]) / 10}


def main() -> None:
    if STEPS % SYNC_EVERY:
        raise SystemExit(f"STEPS={STEPS} must be a multiple of SYNC_EVERY={SYNC_EVERY} (the last step syncs)")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kiln-bench-diloco-") as tmp:
        data = prepare(Path(tmp))
        rows = {"ddp": ddp(fresh_out(data, Path(tmp))), "diloco": diloco(fresh_out(data, Path(tmp)))}
    for name, r in rows.items():
        print(f"{name:7s} val loss {r['val_start']:.4f} -> {r['val_end']:.4f}  (train, last 10 steps "
              f"{r['train_last10']:.4f})  all-reduce {r['bytes_per_step'] / 1e6:.4f} MB/step/rank  "
              f"wall {r['wall_s']:.1f} s")
    a, b = rows["ddp"], rows["diloco"]
    print(f"DiLoCo H={SYNC_EVERY} after {STEPS} steps: val loss gap {b['val_end'] - a['val_end']:+.4f} "
          f"({(b['val_end'] - a['val_end']) / a['val_end'] * 100:+.2f}%), communication "
          f"{b['bytes_per_step'] / a['bytes_per_step']:.4f} of DDP's (1/H = {1 / SYNC_EVERY:.4f}); "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
