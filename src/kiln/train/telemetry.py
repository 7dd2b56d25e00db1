"""Hardware telemetry inside the training loop, and the alerts it raises.

At every `train.log_every` step (and the last) each rank samples, cheaply and without touching the GPU's
stream:
  - NVML, when a driver is present: utilisation, memory used, temperature, power, SM and memory clocks,
    throttle reasons, PCIe and NVLink throughput (where the GPU reports them; a missing figure is left out);
  - the CUDA caching allocator (`torch.cuda.memory_stats`): allocated, reserved, the fragmentation between
    them, the peak reserved, allocation retries (cudaMalloc failed, the cache was flushed and retried: a
    step that ran slow for memory) and OOMs;
  - its own step times since the last log step.
Under torchrun the ranks' figures meet in one small all-gather (a few floats per rank) at log steps only,
never at other steps. Rank 0 adds its own hardware figures and the ranks' spread to the step record in
metrics.jsonl and writes each alert as an `{"event": "alert", "kind": ...}` record and a console warning:

  straggler        a rank whose compute time (the step before it waits in the step's all-reduce) stays above
                   telemetry.straggler_ratio x the median rank's for telemetry.straggler_windows log windows,
                   named by rank and host
  throttle         a bad throttle reason (nvml.BAD_THROTTLE: thermal, power brake) that appears mid-run
  throughput       tokens/s more than telemetry.jump_fraction below its rolling median (a rise needs no action:
                   it is not an alert)
  alloc_retries    a rank's allocation retries grew since the last log step

Memory: bounded by telemetry.rolling_windows numbers plus one log window of step times per rank.
What a GPU run confirms: which NVML figures the driver reports, and that on GPUs, where the host runs
ahead of the kernels, the compute time still singles out the slow rank (the others wait in the all-reduce).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kiln.config import TelemetryConfig
from kiln.hardware import BAD_THROTTLE
from kiln.train.parallel import Dist, all_gather_objects

GB = 2**30
# The per-rank figures gathered at log steps, in this order (NaN where a rank has none).
GATHERED = ("compute_s", "step_s", "throttle", "alloc_retries")


def nvml_handle(nvml, device: torch.device):
    """This process's GPU in NVML, found by UUID: NVML numbers every GPU of the node, whatever
    CUDA_VISIBLE_DEVICES shows the process; by index when the UUID is not available."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # NVMLError_* (no such UUID, not supported) or a device without one: by index instead
        return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def nvml_fields(nvml, handle) -> dict[str, float]:
    """What NVML reports of one GPU right now; a figure the GPU or driver does not report is left out."""
    def read(fn: Callable[[], float]) -> float | None:
        try:
            return fn()
        except Exception:  # NVMLError_NotSupported and friends: this GPU does not report it
            return None

    n, h = nvml, handle
    fields = {
        "gpu_util_pct": read(lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
        "gpu_mem_used_gb": read(lambda: n.nvmlDeviceGetMemoryInfo(h).used / GB),
        "gpu_temp_c": read(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        "gpu_power_w": read(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000),
        "gpu_sm_clock_mhz": read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
        "gpu_mem_clock_mhz": read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
        "gpu_throttle_reasons": read(lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
        # KB/s over NVML's last 20 ms sample window
        "pcie_tx_mb_s": read(lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) / 1000),
        "pcie_rx_mb_s": read(lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) / 1000),
    }
    nvlink = read(lambda: n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                                         n.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]))
    if nvlink and all(getattr(v, "nvmlReturn", 0) == 0 for v in nvlink):
        # cumulative KiB since the driver loaded: the trainer's record keeps the counter, a plot differentiates
        fields["nvlink_tx_gb"], fields["nvlink_rx_gb"] = (v.value.ullVal / 2**20 for v in nvlink)
    return {k: v for k, v in fields.items() if v is not None}


def allocator_fields(stats: dict[str, Any]) -> dict[str, float]:
    """The caching allocator's numbers from torch.cuda.memory_stats()."""
    allocated = stats.get("allocated_bytes.all.current", 0) / GB
    reserved = stats.get("reserved_bytes.all.current", 0) / GB
    return {"mem_allocated_gb": allocated, "mem_reserved_gb": reserved, "mem_fragmentation_gb": reserved - allocated,
            "mem_reserved_peak_gb": stats.get("reserved_bytes.all.peak", 0) / GB,
            "mem_alloc_retries": stats.get("num_alloc_retries", 0), "mem_ooms": stats.get("num_ooms", 0)}


def throttle_names(reasons: int) -> list[str]:
    return [why for bit, why in BAD_THROTTLE.items() if reasons & bit]


class Telemetry:
    """One per rank. `observe` every step (a list append); `sample` at log steps (every rank: it gathers)
    returns (fields for the step record, alert events)."""

    def __init__(self, d: Dist, cfg: TelemetryConfig, nvml=None, memory_stats: Callable[[], dict] | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.d, self.cfg, self.log = d, cfg, log
        self.nvml = nvml
        self.handle = nvml_handle(nvml, d.device) if nvml is not None else None
        cuda = d.device.type == "cuda"
        self.memory_stats = memory_stats or ((lambda: torch.cuda.memory_stats(d.device)) if cuda else None)
        self.hosts = all_gather_objects(d, d.host)  # once: the names alerts give
        self.compute_s: list[float] = []
        self.step_s: list[float] = []
        self.slow_windows = [0] * d.world  # consecutive windows each rank was a straggler
        self.throttled = [False] * d.world  # a bad throttle reason was on at the last sample
        self.retries: list[float | None] = [None] * d.world
        self.rates: deque[float] = deque(maxlen=cfg.rolling_windows)

    @classmethod
    def create(cls, d: Dist, cfg: TelemetryConfig, log: Callable[[str], None] = print) -> Telemetry | None:
        if not cfg.enabled:
            return None
        nvml = None
        if d.device.type == "cuda":
            from kiln.hardware import load_nvml

            nvml = load_nvml()
        return cls(d, cfg, nvml, log=log)

    def observe(self, step_s: float, comm_s: float) -> None:
        """This rank's step: its wall time and the part spent before the step's all-reduce."""
        self.step_s.append(step_s)
        self.compute_s.append(max(step_s - comm_s, 0.0))

    def sample(self, step: int, tokens_per_step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        local: dict[str, Any] = {}
        if self.handle is not None:
            local |= nvml_fields(self.nvml, self.handle)
        if self.memory_stats is not None:
            local |= allocator_fields(self.memory_stats())
        nan = float("nan")
        mine = [statistics.median(self.compute_s) if self.compute_s else nan,
                statistics.median(self.step_s) if self.step_s else nan,
                float(local["gpu_throttle_reasons"]) if "gpu_throttle_reasons" in local else nan,
                float(local["mem_alloc_retries"]) if "mem_alloc_retries" in local else nan]
        self.compute_s, self.step_s = [], []
        ranks = _gather_floats(self.d, mine)
        fields = dict(local)
        compute = [r[0] for r in ranks]
        known = [c for c in compute if not math.isnan(c)]
        if self.d.world > 1 and known:
            slowest = max(range(self.d.world), key=lambda r: -1.0 if math.isnan(compute[r]) else compute[r])
            fields |= {"rank_compute_median_s": statistics.median_low(known), "rank_compute_max_s": max(known),
                       "slowest_rank": slowest}
        alerts = self._stragglers(step, compute) + self._throttles(step, ranks) + self._retries(step, ranks)
        step_s = None if math.isnan(ranks[0][1]) else statistics.median(r[1] for r in ranks)
        if step_s:
            alerts += self._throughput(step, tokens_per_step / step_s)
        return fields, alerts

    # --- alerts ------------------------------------------------------------------------------

    def _alert(self, step: int, kind: str, rank: int | None, message: str, **numbers) -> dict[str, Any]:
        where = {} if rank is None else {"rank": rank, "host": self.hosts[rank]}
        return {"event": "alert", "step": step, "kind": kind, **where, "message": message, **numbers}

    def _stragglers(self, step: int, compute: list[float]) -> list[dict]:
        known = [c for c in compute if not math.isnan(c)]
        if self.d.world < 2 or len(known) < 2:
            return []
        median = statistics.median_low(known)  # a real rank's time (of 2 ranks, the faster one's)
        alerts = []
        for r, c in enumerate(compute):
            slow = not math.isnan(c) and median > 0 and c > self.cfg.straggler_ratio * median
            self.slow_windows[r] = self.slow_windows[r] + 1 if slow else 0
            if self.slow_windows[r] == self.cfg.straggler_windows:  # once per slow spell
                alerts.append(self._alert(step, "straggler", r,
                                          f"rank {r} on host {self.hosts[r]} is a straggler: {c * 1000:.0f} ms of "
                                          f"compute a step against the median rank's {median * 1000:.0f} ms "
                                          f"({c / median:.2f}x) for {self.slow_windows[r]} log windows",
                                          compute_s=c, median_compute_s=median))
        return alerts

    def _throttles(self, step: int, ranks: list[list[float]]) -> list[dict]:
        alerts = []
        for r, row in enumerate(ranks):
            reasons = 0 if math.isnan(row[2]) else int(row[2])
            bad = throttle_names(reasons)
            if bad and not self.throttled[r]:
                alerts.append(self._alert(step, "throttle", r, f"rank {r} on host {self.hosts[r]}: the GPU is "
                                          f"throttled mid-run ({', '.join(bad)})", reasons=reasons))
            self.throttled[r] = bool(bad)
        return alerts

    def _retries(self, step: int, ranks: list[list[float]]) -> list[dict]:
        alerts = []
        for r, row in enumerate(ranks):
            now, before = row[3], self.retries[r]
            if math.isnan(now):
                continue
            if before is not None and now > before:
                alerts.append(self._alert(step, "alloc_retries", r,
                                          f"rank {r} on host {self.hosts[r]}: {now - before:.0f} more CUDA allocation "
                                          f"retries ({now:.0f} in all): memory is nearly full and fragmented; lower "
                                          "train.micro_batch_size or turn on parallel.activation_checkpointing",
                                          retries=now, new_retries=now - before))
            self.retries[r] = now
        return alerts

    def _throughput(self, step: int, tokens_per_s: float) -> list[dict]:
        alerts = []
        if len(self.rates) >= 3:
            median = statistics.median(self.rates)
            change = tokens_per_s / median - 1
            if change < -self.cfg.jump_fraction:  # only a fall is for the user to act on
                alerts.append(self._alert(step, "throughput", None,
                                          f"tokens/s fell {-change:.0%} from its "
                                          f"rolling median ({tokens_per_s:,.0f} against {median:,.0f})",
                                          tokens_per_s=tokens_per_s, median_tokens_per_s=median))
        self.rates.append(tokens_per_s)
        return alerts


def _gather_floats(d: Dist, values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on each): one all-gather of a small tensor."""
    if d.world == 1:
        return [values]
    mine = torch.tensor(values, dtype=torch.float64, device=d.device)
    out = [torch.empty_like(mine) for _ in range(d.world)]
    dist.all_gather(out, mine)
    return torch.stack(out).tolist()

