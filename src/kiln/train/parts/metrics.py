"""The `step` record of metrics.jsonl, with telemetry's figures and alerts at log steps, and the console line."""

from __future__ import annotations

import time
from typing import Callable

from kiln.config import TrainConfig
from kiln.train.metrics import mfu, peak_memory_gb
from kiln.train.parallel import Dist
from kiln.train.parts.outcome import Outcome


class StepLog:
    """Every step: loss, lr, grad norms, timings, tokens/s, MFU, memory, data position, skips and budget spent;
    at log steps the telemetry sample (every rank: the ranks' figures meet in one all-gather) and its alerts;
    a `skip` event with the data position (so `kiln shards inspect` can show the batch); the console line."""

    def __init__(self, train: TrainConfig, d: Dist, flops_per_token: float, peak: float | None, telemetry,
                 loader, escalation, budget, event: Callable[[dict], None], log: Callable[[str], None]) -> None:
        self.cfg, self.d, self.flops_per_token, self.peak, self.telemetry = train, d, flops_per_token, peak, telemetry
        self.loader, self.escalation, self.budget, self.event, self.log = loader, escalation, budget, event, log
        self.console = None  # a TrainConsole on rank 0 while the loop runs

    def post_step(self, o: Outcome) -> None:
        measured, result = o.measured, o.result
        if self.telemetry is not None:
            self.telemetry.observe(o.dt, measured["time_comm_s"])
        record = self.record(o)
        log_step = o.step % self.cfg.log_every == 0 or o.step == self.cfg.max_steps
        alerts = []
        if self.telemetry is not None and log_step:
            fields, alerts = self.telemetry.sample(o.step, o.tokens)
            record.update(fields)
        self.event(record)
        for alert in alerts:
            self.event(alert)
            if self.d.is_main:
                self.log(f"warning: step {o.step}: {alert['message']}")
        if result["skip_reason"]:
            self.event({"event": "skip", "step": o.step, "reason": result["skip_reason"], "loss": measured["loss"],
                        "grad_norm": result["grad_norm"], "data_position": self.loader.state.position,
                        "epoch": self.loader.state.epoch})
        if self.console is not None:  # the live line, and a printed one every log_every steps
            self.console.step(record, result["skip_reason"])

    def record(self, o: Outcome) -> dict:
        measured, tps = o.measured, o.tokens / o.dt
        moe = {k: v for k, v in measured.items() if k.startswith("moe/")}
        result = {k: v for k, v in o.result.items() if k != "skip_reason"}
        return {"event": "step", "step": o.step, "loss": measured["loss"], "lr": o.lr, **result, **moe,
                "tokens_per_s": tps, "step_time_s": o.dt, "tokens_seen": o.tokens_seen, "world": self.d.world,
                "wall_time": time.time(),
                "mfu": mfu(self.flops_per_token, tps, self.peak, self.d.world),
                "mem_peak_gb": peak_memory_gb(self.d.device),
                "time_data_s": measured["time_data_s"], "time_fwd_bwd_s": measured["time_fwd_bwd_s"],
                "time_optim_s": o.result["time_optim_s"], "time_comm_s": measured["time_comm_s"],
                "skipped_steps": self.escalation.skipped_steps, "epoch": self.loader.state.epoch,
                "data_position": self.loader.state.position,
                "device_hours": self.budget.device_hours, "cost_so_far": self.budget.cost,
                "cost_per_1k_steps": self.budget.cost / o.step * 1000}

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
            self.console = None
