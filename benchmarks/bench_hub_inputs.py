"""A `datasets.save_to_disk` folder read as `kiln data` reads it: peak memory at N and 10N rows.

The folder is what save_to_disk writes (Arrow IPC stream files of 1,000-row record batches, state.json listing
them, dataset_info.json), made with pyarrow's stream writer directly so that 10 million rows need no 10-million
row table in the generating process either: rows of ~110 bytes (an id and a sentence of text), in files of
1M rows. Each measurement runs in a fresh process: `kiln.data.sources.expand_inputs` on the folder, then
every file through `kiln.data.sources.read_arrow` (the reader a data task runs), counting documents and text
bytes; peak RSS is the process's ru_maxrss. The baseline reads the same folder the way a script does when it
does not stream: each file's whole table (`read_all`), held until the end.

    python -m benchmarks hub_inputs
    KILN_BENCH_ROWS=1000000,10000000 python -m benchmarks hub_inputs   # the default
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [int(n) for n in os.environ.get("KILN_BENCH_ROWS", "1000000,10000000").split(",")]
FILE_ROWS, BATCH_ROWS = 1_000_000, 1_000


def write_saved_dataset(folder: Path, rows: int) -> None:
    """A save_to_disk folder of `rows` rows (text, id), written a batch at a time."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    schema = pa.schema([("text", pa.string()), ("id", pa.string())])
    names = []
    n_files = -(-rows // FILE_ROWS)
    for k in range(n_files):
        name = f"data-{k:05d}-of-{n_files:05d}.arrow"
        names.append({"filename": name})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for start in range(k * FILE_ROWS, min((k + 1) * FILE_ROWS, rows), BATCH_ROWS):
                ids = range(start, min(start + BATCH_ROWS, rows, (k + 1) * FILE_ROWS))
                writer.write_batch(pa.record_batch([
                    [f"Document {i} says something about row {i * 7919 % 100003} of the corpus here." for i in ids],
                    [f"doc-{i}" for i in ids]], schema=schema))
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps(
        {"features": {"text": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "string", "_type": "Value"}}}))


def worker(folder: str, how: str) -> dict:
    from kiln.data.document import ReadReport
    from kiln.data.sources import expand_inputs, read_arrow

    t0 = time.perf_counter()
    files = expand_inputs([folder])
    docs = chars = 0
    held = []
    for f in files:
        if how == "kiln":
            for doc in read_arrow(f, ReadReport(), ("text", "id", "url")):
                docs += 1
                chars += len(doc.text)
        else:
            import pyarrow as pa

            table = pa.ipc.open_stream(f).read_all()
            held.append(table)
            docs += table.num_rows
            chars += sum(len(t) for t in table.column("text").to_pylist())
    return {"docs": docs, "chars": chars, "seconds": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(folder: Path, how: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_hub_inputs", "--worker", str(folder), how],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-bench-hub-") as tmp:
        results = []
        for rows in ROWS:
            folder = Path(tmp) / f"saved-{rows}"
            t0 = time.perf_counter()
            write_saved_dataset(folder, rows)
            size = sum(p.stat().st_size for p in folder.iterdir())
            print(f"{rows:,} rows: wrote {size / 1e6:,.0f} MB in {time.perf_counter() - t0:.0f} s", flush=True)
            for how in ("kiln", "read_all"):
                r = measure(folder, how)
                assert r["docs"] == rows, r
                results.append((rows, how, r))
                print(f"  {how:8} {r['docs']:,} docs in {r['seconds']:.0f} s, peak RSS {r['peak_rss_mb']:,.0f} MB",
                      flush=True)
        print(f"\n{'rows':>12} {'reader':8} {'docs/s':>9} {'peak RSS MB':>12}")
        for rows, how, r in results:
            print(f"{rows:12,} {how:8} {r['docs'] / r['seconds']:9,.0f} {r['peak_rss_mb']:12,.0f}")
        for how in ("kiln", "read_all"):
            peaks = [r["peak_rss_mb"] for _, h, r in results if h == how]
            print(f"{how}: peak RSS at {ROWS[-1]:,} rows / at {ROWS[0]:,} rows = {peaks[-1] / peaks[0]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
    else:
        main()
