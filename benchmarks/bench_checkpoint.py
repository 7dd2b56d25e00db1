"""Checkpoint save/load throughput against torch.save/torch.load of the same state, and the training stall of
async against sync saving, in the same run.

State: a 58 M-parameter Llama (d=512, 8 layers, vocabulary 32,000) after one AdamW step, so the optimizer
holds exp_avg and exp_avg_sq for every weight: ~700 MB of tensors.

  kiln        write_checkpoint(): model.safetensors + optimizer.pt + rng.pt + state.json + config + tokenizer,
              every file fsync'd, sha256 of every file into manifest.json, rename, parent fsync.
              load_checkpoint(verify=True): re-hash every file, then safetensors + torch.load(weights_only=True);
              also verify=False (what resume uses after latest_valid has verified the folder).
  torch       torch.save({"model", "optimizer"}) to one file, flushed and fsync'd (as durable as Kiln's);
              torch.load(weights_only=True).

MB/s = the state's tensor bytes / seconds, so both sides are charged for the same payload. Medians of RUNS
rounds, the two sides alternating (order flipped every round); the files are in the page cache when read.

Stall: a training loop on the same model (batch 1 x 128 tokens, 2 threads) saves through `Saver` exactly as
`Checkpointer._write` does (async: the snapshot is cloned at the step boundary, then written by the thread). The
stall is the time from the step boundary until the loop may run its next step; for async saves the loop's
step time while the background write runs is reported against its step time with no save in flight.

    python -m benchmarks checkpoint
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.llama import Llama
from kiln.checkpoint import load_checkpoint, rng_state, write_checkpoint
from kiln.train.checkpoint import Saver, snapshot

VOCAB, ARGS = 32_000, ModelConfig(dim=512, n_layers=8, n_heads=8)
RUNS, THREADS = 5, 2
STALL_STEPS = 4


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def train_step(model: Llama, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    tokens = torch.randint(0, VOCAB, (1, 129))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def kiln_save(root: Path, step: int, model_state, optim_state, tokenizer: Path) -> Path:
    return write_checkpoint(root, step, model_state, optim_state, [rng_state()], {"step": step, "tokens_seen": 0},
                            "seed: 0\n", tokenizer, {"config_hash": "0" * 16})


def torch_save(path: Path, model_state, optim_state) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model_state, "optimizer": optim_state}, f)
        f.flush()
        os.fsync(f.fileno())


def kiln_round(times: dict[str, list[float]], root: Path, step: int, model_state, optim_state, tokenizer: Path) -> None:
    t0 = time.perf_counter()
    folder = kiln_save(root, step, model_state, optim_state, tokenizer)
    times["kiln save"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    load_checkpoint(folder, verify=True)
    times["kiln load (verify)"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    load_checkpoint(folder, verify=False)
    times["kiln load (no verify)"].append(time.perf_counter() - t0)


def torch_round(times: dict[str, list[float]], path: Path, model_state, optim_state) -> None:
    t0 = time.perf_counter()
    torch_save(path, model_state, optim_state)
    times["torch save"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    torch.load(path, map_location="cpu", weights_only=True)
    times["torch load"].append(time.perf_counter() - t0)


def throughput(tmp: Path, model: Llama, opt: torch.optim.Optimizer, tokenizer: Path) -> dict[str, list[float]]:
    model_state = {k: v.detach() for k, v in model.state_dict().items()}
    optim_state = opt.state_dict()
    mb = (tensor_bytes(model_state) + tensor_bytes(optim_state)) / 1e6
    print(f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {mb:.0f} MB of tensors")
    times: dict[str, list[float]] = {k: [] for k in ("kiln save", "torch save", "kiln load (verify)",
                                                      "kiln load (no verify)", "torch load")}
    for r in range(RUNS):
        ckpt_root, pt = tmp / f"kiln-{r}", tmp / f"torch-{r}.pt"
        if r % 2:  # alternate which side goes first
            torch_round(times, pt, model_state, optim_state)
        kiln_round(times, ckpt_root, r, model_state, optim_state, tokenizer)
        if not r % 2:
            torch_round(times, pt, model_state, optim_state)
        shutil.rmtree(ckpt_root)  # keep the disk from filling; the next round writes afresh
        pt.unlink()
    return {k: [mb / t for t in v] for k, v in times.items()}


def stall(tmp: Path, model: Llama, opt: torch.optim.Optimizer, tokenizer: Path, async_save: bool,
          step: int) -> dict[str, float]:
    """One save in the middle of a loop, as Checkpointer._write does it: the stall and the step times around it."""
    saver = Saver(async_save, log=lambda *_: None)
    quiet_steps = [train_step(model, opt) for _ in range(STALL_STEPS)]
    t0 = time.perf_counter()
    model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    optim_state = opt.state_dict()
    if async_save:  # the snapshot must not change while the thread writes
        model_state, optim_state = snapshot(model_state), snapshot(optim_state)
    root = tmp / f"stall-{int(async_save)}-{step}"
    saver.last_write_s = None
    wait = saver.save(lambda: kiln_save(root, step, model_state, optim_state, tokenizer))
    stalled = time.perf_counter() - t0
    busy_steps = []
    while async_save and saver.last_write_s is None:  # steps while the background write runs
        busy_steps.append(train_step(model, opt))
    saver.wait()
    shutil.rmtree(root)
    return {"stall_s": stalled, "saver_wait_s": wait, "write_s": saver.last_write_s,
            "step_s": statistics.median(quiet_steps),
            "step_during_save_s": statistics.median(busy_steps) if busy_steps else float("nan"),
            "steps_during_save": len(busy_steps)}


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = Llama(ARGS, vocab_size=VOCAB, max_seq_len=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    train_step(model, opt)  # the optimizer state exists from the first step on
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ckpt-") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = tmp / "tokenizer.json"
        tokenizer.write_text("{}")
        rates = throughput(tmp, model, opt, tokenizer)
        print(f"\n{'':24} {'median MB/s':>11}  runs")
        for k, v in rates.items():
            print(f"{k:24} {statistics.median(v):11.0f}  " + ", ".join(f"{x:.0f}" for x in v))
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"save kiln/torch: {med['kiln save'] / med['torch save']:.2f}; load kiln/torch: "
              f"{med['kiln load (verify)'] / med['torch load']:.2f} verified, "
              f"{med['kiln load (no verify)'] / med['torch load']:.2f} unverified")

        results: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(3):
            for a in ((False, True) if r % 2 == 0 else (True, False)):
                results[a].append(stall(tmp, model, opt, tokenizer, a, r))
        print(
            f"\n{'save':6} {'stall s':>8} {'write s':>8} {'step s (no save)':>17} "
            f"{'step s (during save)':>21} {'steps during':>13}"
        )
        for a, rs in results.items():
            m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"{'async' if a else 'sync':6} {m['stall_s']:8.3f} {m['write_s']:8.3f} {m['step_s']:17.3f} "
                  f"{m['step_during_save_s']:21.3f} {m['steps_during_save']:13.0f}")


if __name__ == "__main__":
    main()
