"""Host memory of each rank at start-up under FSDP on 1, 2 and 4 gloo ranks (CPU), against the baseline (issue 39).

`kiln train` is launched by torchrun (`--nproc_per_node W`, parallel.mode fsdp, one OpenMP thread a rank) on a
Llama of d=2048, 16 heads (8 KV heads), SwiGLU 5,632, the prepared tokenizer's vocabulary of 4,096 and
KILN_BENCH_LAYERS layers: 21 by default (0.99 B parameters, issue 39's ~1 B); 14 (0.67 B) is the largest whose
old start-up (4 whole fp32 models at W=4) fits beside other jobs on a 24 GiB machine, for the before/after pair.
Each rank stops when start-up ends (model built, split, initialised; before validation and the first step):

  host peak   the rank's VmHWM (/proc/self/status) at the entry of `Trainer._start`, read by this module's
              wrapper in every case, so the code before and after compare by the same method
  record      the `startup` record's host_peak_bytes (metrics.jsonl; the code after issue 39 only)
  baseline    the VmHWM of a 1-rank torchrun process with torch and Kiln (its trainer and CLI) imported, no model

Check (issue 39's "done when"): at W ranks every rank's peak exceeds the baseline by at most 1.2 / W of the full
fp32 model (4 bytes a parameter). KILN_BENCH_OLD_SRC names the src/ of the code before (`git worktree add
/tmp/kiln-before 9c06c96`): it is measured the same way, in the same run; without it only this checkout is.
The prepared out_dir is `kiln run examples/tiny.yaml --until pack` in a temporary folder (KILN_BENCH_WORK keeps it
there and reuses it). Settings: KILN_BENCH_LAYERS (21), KILN_BENCH_DIM (2048), KILN_BENCH_WORLDS (1,2,4),
KILN_BENCH_RUNS (1; memory peaks are steady: medians of several runs if more).

    python -m benchmarks startup_memory                                                   # ~1 B, this code
    KILN_BENCH_LAYERS=14 KILN_BENCH_OLD_SRC=/tmp/kiln-before/src python -m benchmarks startup_memory  # before/after
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_SRC = os.environ.get("KILN_BENCH_OLD_SRC")
LAYERS = int(os.environ.get("KILN_BENCH_LAYERS", "21"))
DIM = int(os.environ.get("KILN_BENCH_DIM", "2048"))
WORLDS = [int(w) for w in os.environ.get("KILN_BENCH_WORLDS", "1,2,4").split(",")]
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "1"))
WORK = os.environ.get("KILN_BENCH_WORK")
GB = 1e9


def vmhwm() -> int:
    """This process's peak resident memory so far (VmHWM, bytes): the one method for every case."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def worker(mode: str, out: Path, config: str | None) -> None:
    """One rank (under torchrun): `baseline` imports and measures; `train` runs `kiln train CONFIG` to the end of
    start-up, writes out/rank-R.json and leaves."""
    import torch.distributed as dist

    from kiln import cli
    from kiln.train import trainer

    rank = int(os.environ.get("RANK", "0"))
    if mode == "baseline":
        (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "host_peak_bytes": vmhwm()}))
        return
    start = trainer.Trainer._start

    def measured_start(self):
        peak = vmhwm()  # model built, split and initialised (before and after issue 39 alike)
        self.validator.validate = lambda *args, **kwargs: None  # stop before step 0's evaluation
        start(self)
        if self.metrics is not None:
            self.metrics.file.flush()
        params = sum(getattr(p, "_local_tensor", p).numel() for p in self.model.parameters())
        (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "host_peak_bytes": peak,
                                                           "local_params": params}))
        dist.barrier()
        os._exit(0)  # every rank at the same point: nothing left to agree on

    trainer.Trainer._start = measured_start
    cli.main(["train", config])
    raise SystemExit(f"rank {rank}: kiln train ended without reaching the end of start-up")


def torchrun(world: int, src: str, mode: str, out: Path, config: Path | None = None) -> list[dict]:
    """Run `worker` on `world` ranks with Kiln from `src`; every rank's result."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), src]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "benchmarks.bench_startup_memory", "--worker", mode, str(out), str(config or "")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    if proc.returncode != 0 or len(results) != world:
        raise SystemExit(f"{mode} on {world} ranks ({src}) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def prepare(work: Path) -> Path:
    """The tiny example's shards in work/out, and a config training the benchmark's model on them under FSDP."""
    out = work / "out"
    if not (out / "shards" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "kiln", "run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={out}",
                        "--until", "pack"], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return write_config(work / "startup.yaml", out, DIM, LAYERS, 16)


def write_config(path: Path, out: Path, dim: int, layers: int, heads: int, seq_len: int = 256) -> Path:
    """A config training a Llama of `dim` x `layers` for one step under FSDP on the tiny example's shards in out."""
    path.write_text(f"""out_dir: {out}
seed: 1234
data: {{inputs: [{ROOT / 'examples' / 'data' / 'sample.warc.gz'}], workers: 2, min_chars: 500}}
tokenizer: {{vocab_size: 4096}}
pack: {{seq_len: {seq_len}, val_fraction: 0.1}}
model: {{dim: {dim}, n_layers: {layers}, n_heads: {heads}, n_kv_heads: {heads // 2}}}
train: {{max_steps: 1, batch_size: 4, lr: 1.0e-4, warmup_steps: 0, dtype: fp32}}
parallel: {{mode: fsdp}}
""")
    return path


def measure(src: str, config: Path, work: Path) -> dict:
    """Baseline and every world size's per-rank peaks (medians over RUNS) with Kiln from `src`."""
    runs = {"baseline": [torchrun(1, src, "baseline", work / "res")[0]["host_peak_bytes"] for _ in range(RUNS)]}
    result = {"baseline": statistics.median(runs["baseline"]), "worlds": {}}
    for world in WORLDS:
        shutil.rmtree(work / "out" / "run", ignore_errors=True)
        rounds = [torchrun(world, src, "train", work / "res", config) for _ in range(RUNS)]
        records = {}
        metrics = work / "out" / "run" / "metrics.jsonl"
        if metrics.is_file():  # the last round's startup records (the code after issue 39)
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if record.get("event") == "startup":
                    records[record["rank"]] = record["host_peak_bytes"]
        result["worlds"][world] = {
            "peaks": [statistics.median(r[rank]["host_peak_bytes"] for r in rounds) for rank in range(world)],
            "records": [records.get(rank) for rank in range(world)],
            "local_params": [rounds[-1][rank]["local_params"] for rank in range(world)]}
        print(f"  {src}: W={world} peaks {[round(p / GB, 2) for p in result['worlds'][world]['peaks']]} GB", flush=True)
    return result


def within_limit(peaks: list[float], baseline: float, model_bytes: float, world: int) -> tuple[float, bool]:
    """The largest rank's excess over the baseline as a fraction of the fp32 model, and whether it is within
    issue 39's 1.2 / W."""
    excess = (max(peaks) - baseline) / model_bytes
    return excess, excess <= 1.2 / world


def report(name: str, result: dict, model_bytes: float) -> bool:
    base, ok = result["baseline"], True
    print(f"\n{name}: baseline {base / GB:.3f} GB (1 rank, torch and Kiln imported, no model)")
    print("| W | rank peaks GB (wrapper) | startup record GB | max excess / fp32 model | limit 1.2/W | met |")
    print("|---|---|---|---|---|---|")
    for world, r in result["worlds"].items():
        excess, met = within_limit(r["peaks"], base, model_bytes, world)
        ok &= met
        records = ", ".join("-" if v is None else f"{v / GB:.2f}" for v in r["records"])
        print(f"| {world} | {', '.join(f'{p / GB:.2f}' for p in r['peaks'])} | {records} | "
              f"{excess:.3f} | {1.2 / world:.3f} | {'yes' if met else 'NO'} |")
    return ok


def main() -> None:
    work = Path(WORK) if WORK else Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        config = prepare(work)
        sides = {"after (this checkout)": str(ROOT / "src")}
        if OLD_SRC:
            sides["before (KILN_BENCH_OLD_SRC)"] = OLD_SRC
        results = {name: measure(src, config, work) for name, src in sides.items()}
        if WORLDS[0] != 1:  # FSDP pads each shard: the full model's size is read on one rank
            raise SystemExit("KILN_BENCH_WORLDS must start with 1 (the full model's size is read there)")
        params = sum(next(iter(results.values()))["worlds"][1]["local_params"])
        model_bytes = 4 * params
        print(f"\nmodel: d={DIM}, {LAYERS} layers, {params / 1e9:.3f} B parameters, fp32 {model_bytes / GB:.2f} GB")
        for name, result in results.items():
            met = report(name, result, model_bytes)
            print(f"{name}: every rank within 1.2/W of the model above the baseline: {'yes' if met else 'no'}")
    finally:
        if not WORK:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4] or None)
    else:
        main()
