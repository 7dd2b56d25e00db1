"""`kiln preflight CONFIG`: a smoke version of the run before the real one.

A few optimizer steps of the real Trainer on a slice of the train split (`preflight.data_fraction`, at least
the steps' worth of samples), in a temporary run folder under out_dir, then the signals that catch most
launch failures (SEEDS, "bring-up in stages"): the loader keeps up with the step, the device computes rather
than waits, memory has headroom, the gradient norm is finite and neither exploding nor vanishing, and a
checkpoint is written and loads back with the same tensors. The measured step time goes to
`{out_dir}/preflight.json`, where `kiln plan` finds it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import uuid
from pathlib import Path

import numpy as np
import torch

from kiln.config import Config, build_config
from kiln.errors import KilnError
from kiln.manifest import read_manifest, staging_dir, write_atomic, write_manifest
from kiln.ops.check import Check, guarded, print_checks
from kiln.pages import read_records
from kiln.shards.format import IDX_ENTRY, ShardHeader, read_header, write_shard
from kiln.shards.reader import ShardSet
from kiln.run_layout import RunLayout


def write_slice(shards: Path, out: Path, counts: dict[str, int]) -> None:
    """A shards folder holding the first `counts[split]` samples of each split (the index is left empty)."""
    manifest = read_manifest(shards)
    fields = {k: v for k, v in manifest.items() if k not in ("files", "documents", "fingerprint")}
    fields["splits"] = {}
    with staging_dir(out) as tmp:
        for split, n in counts.items():
            samples = ShardSet(shards, split)
            if n and not len(samples):  # the smoke run trains, and evaluates at its first and last step
                fix = "raise pack.val_fraction" if split == "val" else "add documents"
                raise KilnError(f"{shards}: the {split} split has no samples, and the smoke run needs {n}; "
                                f"{fix} and run `kiln pack` again")
            rows = [samples.sample(i) for i in range(min(n, len(samples)))]
            tokens = np.concatenate(rows) if rows else np.empty(0, dtype=np.uint16)
            first = read_header(shards / manifest["splits"][split]["files"][0])
            (tmp / split).mkdir()
            write_shard(
                tmp / split / "00000.bin",
                tokens,
                ShardHeader(first.token_bytes, first.vocab_size, first.sample_len, len(tokens), first.tokenizer_sha256),
                np.empty(0, dtype=IDX_ENTRY),
            )
            fields["splits"][split] = {"files": [f"{split}/00000.bin"], "tokens": len(tokens), "samples": len(rows)}
        write_manifest(tmp, **fields, documents=0, preflight_slice_of=str(shards))


def smoke_config(cfg: Config, out: Path) -> Config:
    p = cfg.preflight
    data = cfg.model_dump(mode="json")
    data["out_dir"] = str(out)
    # The update-ratio measurement copies every parameter: the smoke run reaches one, so its peak counts it.
    data["train"] |= {"max_steps": p.steps, "eval_every": 0,
                      "update_ratio_every": min(cfg.train.update_ratio_every, p.steps)}
    data["checkpoint"] |= {"every": p.steps, "keep_last": 1}
    return build_config(data)


def _device_memory_gb() -> float:
    """What the peak is judged against: the GPU's memory, or the host's RAM on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def judge(
    cfg: Config, steps: list[dict], loader_tps: float, model_state: dict, ckpt_folder: Path | None
) -> list[Check]:
    """The five signals, from the smoke run's step records, the loader probe and the checkpoint it wrote."""
    p = cfg.preflight
    timed = steps[1:] or steps  # the first step pays for allocation and warm-up
    step_time = statistics.median(s["step_time_s"] for s in timed)
    train_tps = statistics.median(s["tokens_per_s"] for s in timed)
    return [_loader_check(p, loader_tps, train_tps), _utilisation_check(cfg, timed, loader_tps, step_time),
            _memory_check(p, steps), _grad_norm_check(p, steps), _checkpoint_check(model_state, ckpt_folder)]


def _loader_check(p, loader_tps: float, train_tps: float) -> Check:
    ratio = loader_tps / train_tps
    return Check(
        "loader",
        ratio >= p.min_loader_ratio,
        f"loader {loader_tps:,.0f} tokens/s = {ratio:.1f}× the {train_tps:,.0f} tokens/s a step consumes",
        ""
        if ratio >= p.min_loader_ratio
        else "move shards to local disk or page cache; the device will wait for data",
    )


def _utilisation_check(cfg: Config, timed: list[dict], loader_tps: float, step_time: float) -> Check:
    p = cfg.preflight
    if all(isinstance(s.get("time_data_s"), (int, float)) for s in timed):
        waiting = statistics.median(s["time_data_s"] / s["step_time_s"] for s in timed)
        how = "data wait measured by the trainer"
    else:
        waiting = cfg.train.batch_size * cfg.pack.seq_len / loader_tps / step_time
        how = "data wait estimated from the loader probe"
    busy = 1 - waiting
    mfu = [s["mfu"] for s in timed if isinstance(s.get("mfu"), (int, float))]
    detail = f"device busy {busy:.0%} of the step ({how})" + (f"; MFU {statistics.median(mfu):.1%}" if mfu else "")
    return Check(
        "utilisation",
        busy >= p.min_utilisation,
        detail,
        "" if busy >= p.min_utilisation else "the step waits for data: raise loader throughput or the batch",
    )


def _memory_check(p, steps: list[dict]) -> Check:
    from kiln.train.metrics import peak_memory_gb

    # Reserved, not only allocated: the allocator's cache and fragments are what runs out (telemetry, on GPUs).
    peak = max((s[k] for s in steps for k in ("mem_peak_gb", "mem_reserved_peak_gb")
                if isinstance(s.get(k), (int, float))),
               default=peak_memory_gb(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    total = _device_memory_gb()
    ok = peak / total <= p.max_memory_fraction
    return Check(
        "memory",
        ok,
        f"peak {peak:.2f} GiB of {total:.1f} GiB ({peak / total:.0%})",
        "" if ok else "lower train.micro_batch_size, or turn on parallel.activation_checkpointing / fsdp",
    )


def _grad_norm_check(p, steps: list[dict]) -> Check:
    norms = [s["grad_norm"] for s in steps]
    bad = [
        n
        for n in norms
        if not (isinstance(n, (int, float)) and math.isfinite(n) and p.min_grad_norm <= n <= p.max_grad_norm)
    ]
    losses_ok = all(math.isfinite(s["loss"]) for s in steps)
    return Check(
        "grad_norm",
        not bad and losses_ok,
        f"{min(norms):.3g} .. {max(norms):.3g} over {len(norms)} steps; "
        f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}",
        ""
        if not bad and losses_ok
        else f"outside [{p.min_grad_norm:g}, {p.max_grad_norm:g}] or not finite: "
        "check train.lr, model.init_std, the data",
    )


def _checkpoint_check(model_state: dict, ckpt_folder: Path | None) -> Check:
    from kiln.checkpoint import load_checkpoint, verify_checkpoint

    if ckpt_folder is None:
        return Check(
            "checkpoint", False, "the smoke run wrote no checkpoint", "check disk space and permissions of out_dir"
        )
    verify_checkpoint(ckpt_folder)
    loaded = load_checkpoint(ckpt_folder)["model"]
    same = loaded.keys() == model_state.keys() and all(
        torch.equal(loaded[k].cpu(), model_state[k].cpu()) for k in loaded
    )
    return Check(
        "checkpoint",
        same,
        f"{ckpt_folder.name}: {len(loaded)} tensors written, verified and loaded back "
        + ("identical" if same else "DIFFERENT from the model in memory"),
        "" if same else "a checkpoint does not round-trip: report this as a Kiln bug",
    )


def preflight(cfg: Config) -> tuple[dict, list[Check]]:
    from kiln.ops.probes import device_peak, loader_tokens_per_s
    from kiln.checkpoint import list_checkpoints
    from kiln.train.trainer import Trainer

    shards = cfg.layout.shards
    if not (shards / "manifest.json").is_file() or not (cfg.layout.tokenizer / "tokenizer.json").is_file():
        raise KilnError(f"{cfg.out}: no shards or tokenizer yet; run `kiln run CONFIG --until pack` first")
    p = cfg.preflight
    work = cfg.out / f".preflight-{uuid.uuid4().hex[:8]}"  # on the run's own disk, so checkpoint writes are real
    try:
        shutil.copytree(cfg.layout.tokenizer, RunLayout(work).tokenizer)
        n_train = int(read_manifest(shards)["splits"]["train"]["samples"])
        need = p.steps * cfg.train.batch_size
        write_slice(shards, RunLayout(work).shards, {"train": max(need, math.ceil(p.data_fraction * n_train)),
                                              "val": cfg.train.eval_batches * cfg.train.batch_size})
        trainer = Trainer(smoke_config(cfg, work), log=lambda *_: None)
        trainer.run()
        steps = [r for r in read_records(RunLayout(work).run / "metrics.jsonl")[0] if r.get("event") == "step"]
        loader_tps = loader_tokens_per_s(shards, cfg.train.batch_size, cfg.seed, cfg.doctor.probe_seconds)
        ckpts = list_checkpoints(RunLayout(work).checkpoints)
        model_state = {k: v.detach() for k, v in trainer.model.state_dict().items()}
        checks = guarded("signals", lambda: judge(cfg, steps, loader_tps, model_state, ckpts[-1] if ckpts else None))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name, peak, _ = device_peak(cfg.train.dtype)
    timed = steps[1:] or steps
    result = {
        "device": name,
        "world": 1,
        "dtype": cfg.train.dtype,
        "batch_size": cfg.train.batch_size,
        "model_hash": cfg.section_hash("model", "pack"),
        "steps": len(steps),
        "step_time_s": statistics.median(s["step_time_s"] for s in timed),
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "peak_tflops": peak,
        "loader_tokens_per_s": loader_tps,
        "checks": [c.as_dict() for c in checks],
        "ok": all(c.ok for c in checks),
    }
    write_atomic(cfg.out / "preflight.json", json.dumps(result, indent=1))
    return result, checks


def run_preflight(cfg: Config, as_json: bool = False) -> int:
    result, checks = preflight(cfg)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print_checks(checks, title=f"preflight: {result['steps']} steps on {result['device']}, "
                                   f"{result['tokens_per_s']:,.0f} tokens/s, {result['step_time_s']:.3f} s/step")
    return 0 if result["ok"] else 1
