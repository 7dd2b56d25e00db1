"""Kiln: from raw web crawls to a trained language model."""

import os as _os

__version__ = "0.1.0"

# MKL's strict conditional numerical reproducibility, before torch's first BLAS call (MKL reads it then): a
# result no longer depends on the thread count, so `train.threads: auto` may change it mid-run, and a resume may
# use another count, with bitwise-equal losses. Without it, CPUs with AMX / AVX-512 kernels split a reduction by
# thread and the losses part after a few steps (tests/test_threads.py). A user's own MKL_CBWR wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
