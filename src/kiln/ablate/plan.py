"""An ablation planned: every arm's config and every arm x seed run, checked before any work.

Layout under out_dir (each arm's folder is an ordinary Kiln out_dir, each run's too):

    tokenizer/            the one tokenizer every arm uses (trained on a seeded sample drawn evenly from every
                          arm's kept documents), unless the base config names its own (tokenizer.path)
    ARM/docs, ARM/tokenizer, ARM/shards    the arm's data stage, a copy of the shared tokenizer, its shards
    ARM/overlap.json      which eval documents the arm's kept documents contain (exact or near duplicates)
    ARM/seed-N/           a run: tokenizer/ (the same copy), run/ (checkpoints, metrics.jsonl), eval.json;
                          its config trains on ARM/shards (loader.sources), so every seed shares the arm's data
    ablation.json, ablation.html

Fair by construction: every arm is the base config plus its `set:` overrides of the data section (spec.py
refuses any other key), validated as a config is (a typo gets the closest key): the same model, schedule,
token budget and tokenizer for all. Arms whose resolved configs are equal share their data (the first one's
folder) but never a seed: a shared seed would be the same run, and an A/A check would show exactly 0. Arms
never share a `data.dedup.index` (a data stage adds its documents to it: the next arm would be deduplicated
against them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.ablate.spec import PROXIES, TOKENS_PER_PARAM, AblationSpec, arm_overrides
from kiln.config import Config, build_config, merge
from kiln.errors import ConfigError
from kiln.run_layout import RunLayout
from kiln.tokenizer import TOKENIZER_FILE

EVAL = "eval.json"  # in a run's folder: its measurement (kiln.ablate.runner writes it, results reads it)
CONFIG = "config.yaml"  # in a run's folder: its resolved config, so `kiln train ARM/seed-N/config.yaml` trains it


@dataclass
class RunPlan:
    arm: str
    seed: int
    folder: Path  # the run's out_dir: ARM/seed-N
    cfg: Config
    owner: str  # the arm whose run it is (runs are never shared: always `arm`)


@dataclass
class ArmPlan:
    name: str
    overrides: dict[str, Any]  # `set:` as written (dotted keys)
    cfg: Config  # the arm's out_dir is its data folder
    key: str  # hash of the resolved settings: equal keys share data (never a seed)
    owner: str  # the arm whose data folder it uses
    seeds: list[int]
    runs: list[RunPlan] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.cfg.out

    @property
    def layout(self) -> RunLayout:
        """The arm's data folder's docs/, tokenizer/ and shards/."""
        return self.cfg.layout


@dataclass
class Plan:
    file: Path
    spec: AblationSpec
    out: Path
    arms: list[ArmPlan]
    tokenizer: Path  # the tokenizer.json every arm uses
    shared_tokenizer: bool  # True: out_dir/tokenizer, trained by the ablation; False: the base config's own
    proxy: dict[str, Any] | None  # the proxy's settings and token budget, when the file names one

    def arm(self, name: str) -> ArmPlan:
        return next(a for a in self.arms if a.name == name)

    @property
    def baseline(self) -> ArmPlan:
        return self.arm(self.spec.baseline)

    def data_arms(self, names: list[str] | None = None) -> list[ArmPlan]:
        """The arms that own a data folder (one per distinct settings), among `names` (all when None)."""
        wanted = {self.arm(n).owner for n in names} if names else None
        return [a for a in self.arms if a.owner == a.name and (wanted is None or a.name in wanted)]

    def runs(self, names: list[str] | None = None) -> list[RunPlan]:
        """The distinct runs of the arms in `names` (all when None), each once."""
        seen, out = set(), []
        for arm in self.arms:
            for run in arm.runs:
                if (names is None or arm.name in names) and run.folder not in seen:
                    seen.add(run.folder)
                    out.append(run)
        return out


def settings_key(cfg: Config) -> str:
    dumped = cfg.model_dump(mode="json")
    dumped.pop("out_dir")
    return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]


def proxy_settings(spec: AblationSpec, base: dict[str, Any]) -> dict[str, Any] | None:
    """The proxy's overrides of the base config (model, pack.seq_len, train.batch_size/max_steps/lr/
    warmup_steps (5%)/eval_every (the end only), cpu-tiny's train.threads) and its figures: N, tokens per run,
    steps. None without a proxy."""
    if spec.proxy is None:
        return None
    p = PROXIES[spec.proxy]
    tree = {"model": {**p["model"], "ffn_hidden": None}, "pack": {"seq_len": p["seq_len"]},
            "train": {"batch_size": p["batch_size"], "lr": p["lr"], **({"threads": p["threads"]} if "threads" in p
                                                                         else {})}}
    cfg = build_config(merge(base, tree))
    n = count_parameters(cfg)
    tokens = spec.proxy_tokens or TOKENS_PER_PARAM * n
    per_step = p["batch_size"] * p["seq_len"]
    steps = max(1, -(-tokens // per_step))
    tree["train"].update(max_steps=steps, warmup_steps=max(1, steps // 20), eval_every=0)
    return {"name": spec.proxy, "params": n, "tokens": steps * per_step, "steps": steps, "set": tree}


def count_parameters(cfg: Config) -> int:
    """N as `kiln plan` counts it (non-embedding parameters, the output projection included), at the
    tokenizer's vocabulary size, on the meta device (no memory)."""
    import torch

    from kiln.model.build import build_model

    with torch.device("meta"):
        return build_model(cfg.model, cfg.tokenizer.vocab_size, cfg.pack.seq_len).num_params(non_embedding=True)


def make_plan(spec: AblationSpec, base: dict[str, Any], file: Path) -> Plan:
    """Every arm's config and run, checked (one line naming the arm and key on the first problem)."""
    out = Path(spec.out_dir)
    if (base.get("loader") or {}).get("sources"):
        raise ConfigError(f"{spec.base}: loader.sources is set; an ablation trains each arm on its own shards, "
                          "so remove it from the base config")
    proxy = proxy_settings(spec, base)
    base = merge(base, proxy["set"]) if proxy else base
    own = (base.get("tokenizer") or {}).get("path")
    tokenizer = Path(own) if own else RunLayout(out).tokenizer / TOKENIZER_FILE
    arms: list[ArmPlan] = []
    for arm_spec in spec.arms:
        tree = arm_overrides(arm_spec, file.resolve().parent)
        try:
            cfg = build_config(merge(merge(base, tree), {"tokenizer": {"path": str(tokenizer)}}))
        except ConfigError as exc:
            raise ConfigError(f"{file}: arm {arm_spec.name!r}: {exc}") from None
        key = settings_key(cfg)
        owner = next((a.owner for a in arms if a.key == key), arm_spec.name)
        cfg = build_config(merge(cfg.model_dump(mode="json"), {"out_dir": str(out / owner)}))
        arms.append(ArmPlan(arm_spec.name, dict(arm_spec.set), cfg, key, owner, spec.seeds_of(arm_spec.name)))
    _check_independent(arms, file)
    plan = Plan(file, spec, out, arms, tokenizer, not own, proxy)
    _plan_runs(plan)
    return plan


def _check_independent(arms: list[ArmPlan], file: Path) -> None:
    """Refuse arms whose runs would not be their own: equal settings and a seed in common (the same run twice),
    or two data folders adding to one data.dedup.index (the later one deduplicated against the earlier)."""
    every_seed = sorted({s for a in arms for s in a.seeds})
    for k, arm in enumerate(arms):
        for other in arms[:k]:
            common = sorted(set(arm.seeds) & set(other.seeds))
            if arm.key == other.key and common:
                fresh = list(range(every_seed[-1] + 1, every_seed[-1] + 1 + len(arm.seeds)))
                raise ConfigError(f"{file}: arms {other.name!r} and {arm.name!r} have the same settings and seed(s) "
                                  f"{', '.join(map(str, common))} in common: those runs would be one run, and an A/A "
                                  f"check would show a difference of exactly 0; give {arm.name!r} seeds of its own "
                                  f"(seeds: {fresh}) or remove it")
            index, theirs = arm.cfg.data.dedup.index, other.cfg.data.dedup.index
            if arm.owner != other.owner and index and theirs and Path(index).resolve() == Path(theirs).resolve():
                raise ConfigError(f"{file}: arms {other.name!r} and {arm.name!r} share data.dedup.index {index}: each "
                                  f"arm's data stage adds its documents to it, so {arm.name!r} would be "
                                  f"deduplicated against the documents of {other.name!r}; give each arm its own "
                                  "(set: {data.dedup.index: ...}) or remove it from the base config")


def _plan_runs(plan: Plan) -> None:
    for arm in plan.arms:  # no two arms share a run (_check_independent)
        for seed in arm.seeds:
            folder = plan.out / arm.name / f"seed-{seed}"
            cfg = build_config(merge(arm.cfg.model_dump(mode="json"), {
                "seed": seed, "out_dir": str(folder), "loader": {"sources": [{"path": str(arm.layout.shards)}]}}))
            arm.runs.append(RunPlan(arm.name, seed, folder, cfg, arm.name))
