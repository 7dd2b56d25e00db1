"""Parallel training: the process group and collectives (dist.py), and the one ordered function that turns a plain
model into what the engine trains (parallelize.py). The process-group names are re-exported here, where the CLI
and the probes import them."""

from kiln.train.parallel.dist import (Dist, all_gather_objects, all_reduce_, all_reduce_mean, all_reduce_sum,
                                      broadcast_object, full_value, group_norms, init_distributed,
                                      local_device_index, set_step_timeout, shutdown)

__all__ = ["Dist", "all_gather_objects", "all_reduce_", "all_reduce_mean", "all_reduce_sum", "broadcast_object",
           "full_value", "group_norms", "init_distributed", "local_device_index", "set_step_timeout", "shutdown"]
