"""Sharded against full checkpoints on 2 FSDP2 ranks (gloo, CPU): save time, load time, and rank 0's peak RSS
during a save, in the same run.

State: a Llama of ~170 M parameters (d=1024, 8 layers, vocabulary 32,000) sharded by FSDP2 over 2 ranks, after
one AdamW step: weights + exp_avg + exp_avg_sq, ~2 GB of fp32 tensors in all, ~1 GB per rank (the largest that
fits beside other jobs on a 24 GiB, 2-core machine with room for the full format's gather on rank 0).

  full     what the trainer does for checkpoint.format=full: gather the whole weights and optimizer state
           (get_model_state_dict / get_optimizer_state_dict, full_state_dict, cpu_offload) onto rank 0, which
           writes model.safetensors + optimizer.pt (checkpoint.write_checkpoint: fsync, sha256 of every file,
           manifest, rename); load: rank 0 reads, broadcasts, each rank keeps its shard (FSDPModel.load).
  sharded  sharded_checkpoint.save: each rank writes, fsyncs and hashes its own pieces, rank 0 the small files
           and the manifest; load: each rank reads the slices of its own shard (sharded_checkpoint.load).

Times are rank 0's wall clock from the call until every rank is done (a barrier), medians of RUNS rounds with
the order flipped every round; the files are in the page cache when read.

Resume-time hashing, on the last round's checkpoint of each format (in the page cache: the hashing's CPU time):
  serial    what consensus.agreed_checkpoint did before: rank 0 hashes every file, the other ranks their small
            files, then a barrier
  parallel  consensus.agreed_checkpoint: every rank hashes its share (hash_shares), one thread each
  verify    one process hashing the whole folder (kiln ckpt verify's verify_folder) with 1 thread and with
            manifest.HASH_THREADS threads RSS: rank 0's resident memory
sampled every 2 ms during the save: its peak, and the peak less what it held before the save (the growth;
a tensor this large is mmapped by glibc and returned to the system when freed, so rounds do not mask each
other).

    python -m benchmarks sharded_checkpoint
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3
DIM, LAYERS, HEADS = 1024, 8, 16


class PeakRSS:
    """The most resident memory this process reached while in the `with` block, sampled from /proc."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.every_s)

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self.now()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from kiln.model.build import build_model
    from kiln.model.config import ModelConfig
    from kiln.train import parallel
    from kiln.train.parallel.parallelize import FSDPModel, apply_fsdp
    from kiln.train.checkpoint import sharded
    from kiln.checkpoint import load_checkpoint, rng_state, write_checkpoint
    from kiln.train.checkpoint import Saver

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    d = parallel.Dist(rank=dist.get_rank(), world=dist.get_world_size())
    torch.manual_seed(0)
    vocab = 32_000
    model = build_model(ModelConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS), vocab_size=vocab, max_seq_len=64)
    apply_fsdp(model, d, None, None)
    fsdp = FSDPModel(model, d, None, None)  # how the trainer gathers and loads full states under FSDP2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (1, 65))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights + 2 moments, fp32, all ranks
    tokenizer = out / "tokenizer.json"
    if d.is_main:
        tokenizer.write_text("{}")
    dist.barrier()
    meta = {"step": 1, "tokens_seen": 0}

    def save_full(root: Path) -> Path:
        model_sd, optim_sd = fsdp.state_dict(), fsdp.optimizer_state_dict(opt)
        if d.is_main:
            write_checkpoint(root, 1, model_sd, optim_sd, [rng_state()] * d.world, meta, "seed: 0\n", tokenizer,
                             {"config_hash": "0"})
        del model_sd, optim_sd
        return root / "step-00000001"

    def save_sharded(root: Path) -> Path:
        sharded.save(root, 1, model, opt, d, Saver(False), state=meta, rng=rng_state(), config_yaml="seed: 0\n",
                     tokenizer_file=tokenizer, manifest_fields={"config_hash": "0"}, signing_key=None, timeout_s=600)
        return root / "step-00000001"

    def load_full(folder: Path) -> None:
        data = load_checkpoint(folder, verify=False, weights=d.is_main)
        fsdp.load(opt, data["model"], data["optimizer"])

    def load_sharded(folder: Path) -> None:
        sharded.load(folder, model, opt, d)

    sides = {"full": (save_full, load_full), "sharded": (save_sharded, load_sharded)}
    results: dict[str, dict[str, list[float]]] = {k: {"save_s": [], "load_s": [], "rss_mb": [], "peak_mb": []}
                                                  for k in sides}
    for r in range(RUNS):
        for name in (("full", "sharded") if r % 2 == 0 else ("sharded", "full")):
            save, load = sides[name]
            root = out / f"{name}-{r}"
            dist.barrier()
            t0 = time.perf_counter()
            with PeakRSS() as rss:
                folder = save(root)
                dist.barrier()
            results[name]["save_s"].append(time.perf_counter() - t0)
            results[name]["rss_mb"].append((rss.peak - rss.base) / 1e6)
            results[name]["peak_mb"].append(rss.peak / 1e6)
            t0 = time.perf_counter()
            load(folder)
            dist.barrier()
            results[name]["load_s"].append(time.perf_counter() - t0)
            if d.is_main and r < RUNS - 1:
                shutil.rmtree(root)
    hashing = resume_hashing(d, {name: out / f"{name}-{RUNS - 1}" for name in sides})
    if d.is_main:
        print(json.dumps({"state_mb": state_bytes / 1e6, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                          "results": results, "hashing": hashing}))
    dist.destroy_process_group()


def resume_hashing(d, roots: dict[str, Path]) -> dict[str, dict[str, list[float]]]:
    """Seconds to agree on (and so hash) each root's one checkpoint: serial rank 0 against the ranks' shares,
    and one process's verify with 1 thread against HASH_THREADS; RUNS rounds, the order flipped each round."""
    import torch.distributed as dist

    from kiln import manifest
    from kiln.train.checkpoint import agreement as consensus
    from kiln.checkpoint import check_loads, list_checkpoints, load_checkpoint

    consensus.HASH_THREADS = 1  # the ranks' split alone; the threads are measured by `verify`

    def serial(root: Path) -> None:
        folder = list_checkpoints(root)[-1]
        if d.is_main:
            manifest.verify_folder(folder, workers=1)
            check_loads(folder)
        else:
            load_checkpoint(folder, verify=True, weights=False)

    def parallel(root: Path) -> None:
        assert consensus.agreed_checkpoint(d, root, print) is not None

    def verify(workers: int):
        def run(root: Path) -> None:
            if d.is_main:
                manifest.verify_folder(list_checkpoints(root)[-1], workers=workers)
        return run

    ways = {"serial": serial, "parallel": parallel, "verify-1": verify(1),
            f"verify-{manifest.HASH_THREADS}": verify(manifest.HASH_THREADS)}
    times = {f"{kind}/{way}": [] for kind in roots for way in ways}
    for r in range(RUNS):
        for kind, root in roots.items():
            for way in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                dist.barrier()
                t0 = time.perf_counter()
                ways[way](root)
                dist.barrier()
                times[f"{kind}/{way}"].append(time.perf_counter() - t0)
    return times


def main() -> None:
    pre_load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-sharded-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "benchmarks.bench_sharded_checkpoint", "--worker", tmp],
                              env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    res = report["results"]
    print(f"load average before: {pre_load}, after: {os.getloadavg()}")
    print(f"state: {report['params_m']:.1f} M parameters on 2 FSDP2 ranks, {report['state_mb']:.0f} MB of fp32 "
          f"weights + AdamW moments in all")
    print(f"\n{'':8} {'save s':>8} {'load s':>8} {'rank 0 RSS +MB':>15} {'peak MB':>8}   (medians of {RUNS}; runs)")
    med = {}
    for name, r in res.items():
        med[name] = {k: statistics.median(v) for k, v in r.items()}
        print(f"{name:8} {med[name]['save_s']:8.2f} {med[name]['load_s']:8.2f} {med[name]['rss_mb']:15.0f} "
              f"{med[name]['peak_mb']:8.0f}   "
              f"save {', '.join(f'{x:.2f}' for x in r['save_s'])}; load {', '.join(f'{x:.2f}' for x in r['load_s'])}")
    f, s = med["full"], med["sharded"]
    print(f"\nsharded/full: save time {s['save_s'] / f['save_s']:.2f}, load time {s['load_s'] / f['load_s']:.2f}, "
          f"rank 0 peak RSS during save {s['peak_mb'] / f['peak_mb']:.2f}; growth of rank 0's RSS during the save "
          f"= {s['rss_mb'] / report['state_mb']:.2f} (sharded) and {f['rss_mb'] / report['state_mb']:.2f} (full) "
          f"of the full state's size")
    hashing = {k: statistics.median(v) for k, v in report["hashing"].items()}
    print(f"\nresume-time hashing, seconds (medians of {RUNS}): " + ", ".join(
        f"{k} {v:.2f}" for k, v in hashing.items()))
    threads = next(k.split("-")[1] for k in hashing if k.startswith("full/verify-") and k != "full/verify-1")
    for kind in ("full", "sharded"):
        print(f"{kind}: parallel/serial {hashing[f'{kind}/parallel'] / hashing[f'{kind}/serial']:.2f}; "
              f"verify {threads} threads / 1 thread "
              f"{hashing[f'{kind}/verify-{threads}'] / hashing[f'{kind}/verify-1']:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]))
    else:
        main()
