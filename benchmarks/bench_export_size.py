"""`kiln export --hf` of a sharded ~1 B checkpoint: its peak host memory, and transformers' loss on the export
against `kiln eval`'s (issue 39's last "done when" line).

1. A real `kiln train` on 2 gloo ranks (torchrun, parallel.mode fsdp, checkpoint.format sharded, one step of
   batch 2, micro-batch 1, one OpenMP thread a rank) writes the checkpoint of a Llama of KILN_BENCH_DIM (2048),
   16 heads (8 KV heads), SwiGLU, the prepared tokenizer's vocabulary of 4,096 and KILN_BENCH_LAYERS (20) layers:
   0.94 B parameters. AdamW state, gradients and weights are ~16 bytes a parameter over the 2 ranks (~14 GB used).
2. `kiln export --hf CKPT DIR` runs in a fresh process that samples its own /proc/self/status every 2 ms (as
   tests/test_load_memory.py's MEASURE): the peak VmHWM (resident memory, with the pages of the memory-mapped
   safetensors files read) and the peak RssAnon (anonymous memory only: what the process itself holds).
   Limit: 1.5 GB plus the export's largest tensor, on the whole process (torch and Kiln imported included).
3. transformers loads the export (`AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)`) and computes the
   mean loss over the windows of seq_len + 1 tokens that `kiln eval CKPT --text FILE` reads (the start of
   README.md, KILN_BENCH_CHARS = 2500 characters; tests/test_export.py's method); equal within rel 1e-4: pass.

The prepared out_dir is `kiln run examples/tiny.yaml --until pack` in a temporary folder (KILN_BENCH_WORK keeps
it there and reuses it and the checkpoint).

    python -m benchmarks export_size                       # 0.94 B: ~6 min on 2 cores, ~14 GB of memory
    KILN_BENCH_LAYERS=2 KILN_BENCH_DIM=256 python -m benchmarks export_size   # a quick check of the benchmark
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = int(os.environ.get("KILN_BENCH_LAYERS", "20"))
DIM = int(os.environ.get("KILN_BENCH_DIM", "2048"))
CHARS = int(os.environ.get("KILN_BENCH_CHARS", "2500"))
WORK = os.environ.get("KILN_BENCH_WORK")
GB = 1e9
LIMIT = 1.5 * GB
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

MEASURE = """
import json, sys, threading

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

peak = [0]
def sample():  # the anonymous memory's peak (no kernel high-water mark for it): every 2 ms
    while True:
        peak[0] = max(peak[0], status("RssAnon:"))
        threading.Event().wait(0.002)
threading.Thread(target=sample, daemon=True).start()

import torch, kiln.ops.export
from kiln import cli
before_anon, before_rss = status("RssAnon:"), status("VmRSS:")
code = cli.main(["export", "--hf", *sys.argv[1:]])
threading.Event().wait(0.01)
print(json.dumps({"code": code, "hwm": status("VmHWM:"), "anon": max(peak[0], status("RssAnon:")),
                  "before_rss": before_rss, "before_anon": before_anon}))
"""


def run(cmd: list[str], what: str, timeout: int = 7200, **kwargs) -> subprocess.CompletedProcess:
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  {what}: {time.time() - t:.0f} s", flush=True)
    return proc


def prepare(work: Path) -> Path:
    """The tiny example's shards in work/out, and a config training the benchmark's model on them for one step
    under FSDP with a sharded checkpoint."""
    out = work / "out"
    if not (out / "shards" / "manifest.json").is_file():
        run([sys.executable, "-m", "kiln", "run", str(ROOT / "examples" / "tiny.yaml"), f"out_dir={out}",
             "--until", "pack"], "kiln run examples/tiny.yaml --until pack")
    config = work / "export_size.yaml"
    config.write_text(f"""out_dir: {out}
seed: 1234
data: {{inputs: [{ROOT / 'examples' / 'data' / 'sample.warc.gz'}], workers: 2, min_chars: 500}}
tokenizer: {{vocab_size: 4096}}
pack: {{seq_len: 256, val_fraction: 0.1}}
model: {{dim: {DIM}, n_layers: {LAYERS}, n_heads: 16, n_kv_heads: 8}}
train: {{max_steps: 1, batch_size: 2, micro_batch_size: 1, lr: 1.0e-4, warmup_steps: 0, dtype: fp32,
         eval_every: 0, eval_batches: 1}}
parallel: {{mode: fsdp}}
checkpoint: {{every: 1, format: sharded}}
""")
    return config


def safetensors_shapes(folder: Path) -> dict[str, tuple[list[int], str]]:
    """Every tensor's shape and dtype in the export's .safetensors files, read from their headers only."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def hf_loss(hf_dir: Path, text: str, seq_len: int) -> tuple[float, int]:
    """transformers' mean loss over the windows `kiln eval --text` reads (seq_len + 1 tokens, sharing one)."""
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]  # <|eos|> first, as in training
    window = seq_len + 1
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, window - 1):
            w = torch.tensor([ids[i: i + window]])
            total += F.cross_entropy(model(w[:, :-1]).logits[0], w[0, 1:], reduction="sum").item()
            count += w.shape[1] - 1
    return total / count, count


def main() -> None:
    work = Path(WORK) if WORK else Path(tempfile.mkdtemp(prefix="kiln-export-size-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        config = prepare(work)
        checkpoints = work / "out" / "run" / "checkpoints"
        ckpt = checkpoints / "step-00000001"
        if not (ckpt / "manifest.json").is_file():
            shutil.rmtree(work / "out" / "run", ignore_errors=True)
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "kiln", "train", str(config)], "kiln train (2 gloo FSDP ranks, 1 step, sharded checkpoint)")
        files = sorted(p.name for p in ckpt.iterdir())
        print(f"  checkpoint {ckpt.name}: {len(files)} files, "
              f"{sum(p.stat().st_size for p in ckpt.iterdir()) / GB:.2f} GB ({', '.join(files[:8])}...)")

        hf_dir = work / "hf"
        shutil.rmtree(hf_dir, ignore_errors=True)
        proc = run([sys.executable, "-c", MEASURE, str(ckpt), str(hf_dir)], "kiln export --hf (fresh process)")
        mem = json.loads(proc.stdout.strip().splitlines()[-1])
        shapes = safetensors_shapes(hf_dir)
        params = sum(math.prod(s) for s, _ in shapes.values())
        largest_name, (largest_shape, dtype) = max(shapes.items(), key=lambda kv: math.prod(kv[1][0]))
        largest = math.prod(largest_shape) * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
        limit = LIMIT + largest
        hwm_ok, anon_ok = mem["hwm"] <= limit, mem["anon"] <= limit

        text = (ROOT / "README.md").read_text(encoding="utf-8")[:CHARS]
        (work / "eval.txt").write_text(text, encoding="utf-8")
        ours = json.loads(run([sys.executable, "-m", "kiln", "eval", str(ckpt), "--text", str(work / "eval.txt")],
                              "kiln eval --text").stdout.strip().splitlines()[-1])
        t = time.time()
        theirs, tokens = hf_loss(hf_dir, text, 256)
        print(f"  transformers load + loss: {time.time() - t:.0f} s", flush=True)
        rel = abs(theirs - ours["loss"]) / abs(ours["loss"])
        loss_ok = rel <= 1e-4 and tokens == ours["tokens"]

        print(f"\nmodel: d={DIM}, {LAYERS} layers, {params / 1e9:.3f} B parameters ({params:,}), "
              f"export {sum(p.stat().st_size for p in hf_dir.glob('*.safetensors')) / GB:.2f} GB")
        print(f"largest tensor: {largest_name} {largest_shape} {dtype}: {largest / 1e6:.1f} MB")
        print(f"limit: 1.5 GB + largest tensor = {limit / GB:.3f} GB (the whole export process)")
        print(f"before the export (torch, Kiln imported): VmRSS {mem['before_rss'] / GB:.3f} GB, "
              f"RssAnon {mem['before_anon'] / GB:.3f} GB")
        print(f"peak VmHWM   {mem['hwm'] / GB:.3f} GB (with the mapped files' pages)  {'PASS' if hwm_ok else 'FAIL'}")
        print(f"peak RssAnon {mem['anon'] / GB:.3f} GB (anonymous memory)            {'PASS' if anon_ok else 'FAIL'}")
        print(f"loss: kiln eval {ours['loss']:.6f}, transformers {theirs:.6f} over {tokens} tokens "
              f"(kiln eval {ours['tokens']}): rel {rel:.1e} <= 1e-4  {'PASS' if loss_ok else 'FAIL'}")
        print(f"issue 39 line (VmHWM and loss): {'PASS' if hwm_ok and loss_ok else 'FAIL'}")
    finally:
        if not WORK:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
