"""The task engine: independent tasks on a local process pool or on Ray, each result handed back as it finishes.

The data stage (`kiln.data`), its dedup stages and pack (`kiln.shards`) all run on it; it knows nothing of
documents or tokens.
  executor.py  run_tasks (a local pool or Ray), the engine's name for logs, the Ray address check
  workers.py   what every worker process does first: end with the driver, ignore SIGINT, poll the parent
  raywatch.py  a Ray cluster that stops answering is said in one line, not waited on for ever
"""

from kiln.tasks.executor import engine, run_tasks

__all__ = ["engine", "run_tasks"]
