"""Encoding MB/s of `kiln pack` against calling `tokenizers` `encode_batch` directly, in the same run.

The corpus is the bundled sample crawl run through `kiln data` (documents
repeated under new ids to ~3 MB of text), with a byte-level BPE tokenizer of
4,096 trained on it. Each measurement runs in a fresh process whose
`RAYON_NUM_THREADS` fixes the tokenizer's threads (the pool is sized once
per process):
  encode_batch  one `Tokenizer.encode_batch` over all texts, ids taken out (`.ids`)
  kiln pack     the whole `pack()`: encode, split, pack, write shards, sha256 manifest
Rows: 1 thread each; 2 threads each; and `kiln pack` with `pack.workers=2`
processes of 1 thread each (process start-up included). Medians of 3 runs.

    python -m benchmarks encode
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = 3
REPEAT = int(os.environ.get("KILN_BENCH_REPEAT", "2"))  # copies of the sample corpus; more amortise process start-up
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
from pathlib import Path
mode, docs_file, tok_dir, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
docs = [json.loads(line) for line in open(docs_file, encoding="utf-8")]
mb = sum(len(d["text"].encode()) for d in docs) / 1e6
if __name__ == "__main__":
    if mode == "encode_batch":
        from kiln.tokenizer import load_tokenizer
        tok = load_tokenizer(tok_dir)
        t0 = time.perf_counter()
        ids = [e.ids for e in tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)]
    else:
        from kiln.config import PackConfig
        from kiln.shards.pack import pack
        t0 = time.perf_counter()
        pack(docs, Path(tok_dir), Path(out), PackConfig(seq_len=2048, workers=workers), progress=False)
    print(json.dumps({"mb": mb, "s": time.perf_counter() - t0}))
"""


def prepare(tmp: Path) -> tuple[Path, Path]:
    from kiln.config import build_config
    from kiln.data.docs import read_docs
    from kiln.stages import run_data_stage, run_tokenizer_stage

    cfg = build_config({"out_dir": str(tmp / "out"), "data": {"inputs": [str(ROOT / "examples/data/sample.warc.gz")],
                        "min_chars": 200}, "tokenizer": {"vocab_size": 4096}})
    run_data_stage(cfg, lambda *_: None)
    run_tokenizer_stage(cfg, lambda *_: None)
    docs_file = tmp / "docs.jsonl"
    with open(docs_file, "w", encoding="utf-8") as f:
        for r in range(REPEAT):
            for d in read_docs(cfg.out / "docs"):
                f.write(json.dumps({**d, "id": f"{d['id']}-{r}"}, ensure_ascii=False) + "\n")
    return docs_file, cfg.out / "tokenizer"


def measure(mode: str, threads: int, workers: int, docs_file: Path, tok: Path, tmp: Path) -> float:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(docs_file), str(tok), str(tmp / f"shards-{mode}"),
                          str(workers)], env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["mb"] / r["s"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-encode-") as t:
        tmp = Path(t)
        docs_file, tok = prepare(tmp)
        mb = sum(len(json.loads(line)["text"].encode()) for line in open(docs_file, encoding="utf-8")) / 1e6
        rows = [
            ("encode_batch", 1, 1),
            ("kiln pack", 1, 1),
            ("encode_batch", 2, 1),
            ("kiln pack", 2, 1),
            ("kiln pack", 1, 2),
        ]
        results: dict[tuple, list[float]] = {r: [] for r in rows}
        for _ in range(RUNS):
            for mode, threads, workers in rows:  # interleaved, so load from elsewhere hits every row alike
                results[(mode, threads, workers)].append(measure("encode_batch" if mode == "encode_batch" else "pack",
                                                                 threads, workers, docs_file, tok, tmp))
        med = {r: statistics.median(v) for r, v in results.items()}
        print(f"corpus: {mb:.1f} MB of text, vocab 4096; median of {RUNS} runs")
        print(f"{'what':14} {'threads':>7} {'procs':>5} {'MB/s':>7} {'vs encode_batch, same threads':>30} "
              f"{'vs kiln pack, 1 thread':>23}")
        for mode, threads, workers in rows:
            base = med[("encode_batch", threads if workers == 1 else 2, 1)]
            rate = med[(mode, threads, workers)]
            print(f"{mode:14} {threads:7} {workers:5} {rate:7.2f} {rate / base:30.2f} "
                  f"{rate / med[('kiln pack', 1, 1)]:23.2f}")


if __name__ == "__main__":
    main()
