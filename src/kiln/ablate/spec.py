"""The ablation file (`kiln ablate ABLATION.yaml`): its typed keys, read and checked before any work.

Keys are typed and strict like a Kiln config's (kiln.config): a typo stops with the closest valid key, a bad
value with the key and why. Relative paths (base, out_dir, the eval sets, and path keys inside an arm's `set:`)
are relative to the ablation file's folder. Pure pydantic and YAML: importing this loads no torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kiln.config import Section, TaskConfig, dotted_tree, explain_error, read_config_file, resolve_paths
from kiln.errors import ConfigError

ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# What kiln ablate writes directly in out_dir: the plan `kiln ablate report DIR` reads back, the results, the page.
PLAN_FILE, RESULTS, PAGE = "plan.json", "ablation.json", "ablation.html"
RESERVED = {"tokenizer", PLAN_FILE, RESULTS, PAGE}  # out_dir/tokenizer is the shared tokenizer
# Keys an arm may not set: the ablation sets them (out_dir per run, seed from `seeds`).
NOT_PER_ARM = ("out_dir", "seed")
# The one section an arm may change: an arm changes the data, never the model, schedule, token budget,
# tokenizer, guards or parallelism (all the base config's, the same for every arm).
PER_ARM = ("data",)

# Proxy scales: the model, the sequence length, the batch (sequences per step), the peak learning rate (and for
# cpu-tiny the torch threads).
# The token budget is about 20 tokens per parameter (Chinchilla; DCLM's "1x"), parameters counted as
# `kiln plan` counts N (non-embedding, the output projection included), unless `proxy_tokens` is given.
PROXIES: dict[str, dict[str, Any]] = {
    "cpu-tiny": {"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}, "seq_len": 128,
                 "batch_size": 8, "lr": 3e-3, "threads": 1},  # one thread: a tiny step holds up on a busy CPU
    "20m": {"model": {"dim": 384, "n_layers": 12, "n_heads": 6, "n_kv_heads": 6}, "seq_len": 1024,
            "batch_size": 64, "lr": 3e-3},
    "150m": {"model": {"dim": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8}, "seq_len": 2048,
             "batch_size": 128, "lr": 2e-3},
    "400m": {"model": {"dim": 1280, "n_layers": 20, "n_heads": 20, "n_kv_heads": 10}, "seq_len": 2048,
             "batch_size": 256, "lr": 1.5e-3},
    "1b": {"model": {"dim": 2048, "n_layers": 20, "n_heads": 16, "n_kv_heads": 8}, "seq_len": 2048,
           "batch_size": 512, "lr": 1e-3},
}
TOKENS_PER_PARAM = 20


class ArmSpec(Section):
    name: str = Field(description="the arm's name, also its folder under out_dir")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of the base config's data "
                                "section, as on the command line: {data.quality.fineweb.enabled: false}")
    seeds: list[int] | None = Field(None, description="this arm's own seeds (an A/A check); null = the file's seeds")

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        if not ARM_NAME.match(name) or name in RESERVED:
            raise ValueError(f"arm name {name!r} must be a folder name (letters, digits, '.', '_', '-'; at most 64) "
                             f"and not {', '.join(sorted(RESERVED))}")
        return name

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None:
            _check_seeds(seeds)
        return seeds


def _check_seeds(seeds: list[int]) -> None:
    if not seeds:
        raise ValueError("the seed list is empty: give at least one seed, 3 or more to measure seed-to-seed noise")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat a seed: a repeated seed is the same run, not another sample")


class EvalSpec(Section):
    text: dict[str, str] = Field(default_factory=dict, description="named text sets, bits per byte on each: a JSONL "
                                 'of {"text"} rows, a folder of UTF-8 files (one document each) or a docs folder')
    tasks: list[TaskConfig] = Field(default_factory=list, description="multiple-choice tasks (kiln eval --mc's "
                                    "format): [{name, path}]")

    @model_validator(mode="after")
    def _something_to_measure(self) -> "EvalSpec":
        names = list(self.text) + [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"eval sets and tasks need distinct names, got {names}")
        bad = [n for n in names if not ARM_NAME.match(n)]
        if bad:
            raise ValueError(f"eval set name {bad[0]!r} must be letters, digits, '.', '_' or '-'")
        return self


class StatisticsSpec(Section):
    resamples: int = Field(2000, ge=200, description="bootstrap replicates (each draws seed pairs and documents)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="of the intervals; 1 - confidence is the test's level")
    power: float = Field(0.8, gt=0.5, lt=1, description="min_detectable: the difference found this often")
    seed: int = Field(0, description="the bootstrap's random seed (results are reproducible)")


class AblationSpec(Section):
    base: str = Field(description="a Kiln config every arm starts from")
    out_dir: str = Field(description="where every arm's data and runs, ablation.json and ablation.html go")
    seeds: list[int] = Field(description="each arm is trained once per seed; the i-th seed of an arm is paired with "
                             "the i-th of the baseline")
    baseline: str = Field(description="the arm every other arm is compared with")
    arms: list[ArmSpec] = Field(description="[{name, set, seeds}]")
    eval: EvalSpec = Field(description="what every run is measured on: text sets and tasks")
    proxy: Literal["cpu-tiny", "20m", "150m", "400m", "1b"] | None = Field(
        None, description="sets the model, sequence length, batch and token budget; null = the base config's")
    proxy_tokens: int | None = Field(None, ge=1, description="the proxy's training tokens per run; null = about "
                                     f"{TOKENS_PER_PARAM} per parameter")
    statistics: StatisticsSpec = Field(default_factory=StatisticsSpec)

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds: list[int]) -> list[int]:
        _check_seeds(seeds)
        return seeds

    @model_validator(mode="after")
    def _arms(self) -> "AblationSpec":
        names = [a.name for a in self.arms]
        if len(names) < 2:
            raise ValueError(f"arms: give at least two arms (a baseline and one to compare), got {len(names)}")
        seen = {n for n in names if names.count(n) > 1}
        if seen:
            raise ValueError(f"two arms are named {sorted(seen)[0]!r}: every arm needs a name of its own")
        if self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not an arm; the arms are {', '.join(names)}")
        if not self.eval.text and not self.eval.tasks:
            raise ValueError("eval: give at least one text set or task to measure the runs on")
        if self.proxy_tokens and not self.proxy:
            raise ValueError("proxy_tokens needs a proxy (cpu-tiny, 20m, 150m, 400m or 1b)")
        pairs = len(self.seeds_of(self.baseline))
        for arm in self.arms:
            if len(self.seeds_of(arm.name)) != pairs:
                raise ValueError(f"arm {arm.name!r} has {len(self.seeds_of(arm.name))} seeds and the baseline {pairs}: "
                                 "an arm's i-th seed is paired with the baseline's i-th, so give as many")
            for key in arm.set:
                if str(key).split(".")[0] in NOT_PER_ARM:
                    raise ValueError(f"arm {arm.name!r} sets {key!r}: the ablation sets out_dir and seed itself "
                                     "(give seeds in `seeds:`)")
                if str(key).split(".")[0] not in PER_ARM:
                    raise ValueError(f"arm {arm.name!r} sets {key!r}: an arm may change only the data (data.*); the "
                                     "model, schedule, token budget, tokenizer, guards and parallelism are the same "
                                     "for every arm: put it in the base config, or compare it in another ablation")
        return self

    def seeds_of(self, arm: str) -> list[int]:
        spec = next(a for a in self.arms if a.name == arm)
        return spec.seeds if spec.seeds is not None else self.seeds


def read_spec(path: str | Path) -> tuple[AblationSpec, dict[str, Any]]:
    """The ablation file, validated, with base, out_dir and the eval sets made absolute (an arm's `set:` stays
    as written: `arm_overrides` anchors it); and the base config's mapping (its paths anchored at its own
    folder), ready for each arm's overrides. Any error is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ablation file {path} does not exist; see `kiln ablate --help` for an example")
    raw = read_config_file(path)  # YAML errors come out as one line; the path keys of a config do not occur here
    folder = path.resolve().parent
    try:
        spec = AblationSpec(**raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {explain_error(_typo_first(err), AblationSpec, 'key')}") from None
    spec = spec.model_copy(update={
        "base": _absolute(spec.base, folder), "out_dir": _absolute(spec.out_dir, folder),
        "eval": EvalSpec(text={k: _absolute(v, folder) for k, v in spec.eval.text.items()},
                         tasks=[TaskConfig(name=t.name, path=_absolute(t.path, folder)) for t in spec.eval.tasks])})
    return spec, read_config_file(spec.base)


def _typo_first(err: ValidationError) -> ValidationError:
    """A required key missing beside an unknown one is most likely that key misspelt (`basline:`): the unknown
    key's error comes first, so the message names it with the closest valid key."""
    errors = err.errors()
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown and any(e["type"] == "missing" for e in errors):
        return ValidationError.from_exception_data(err.title, unknown[:1])
    return err


def _absolute(value: str, folder: Path) -> str:
    return resolve_paths({"out_dir": value}, folder)["out_dir"]


def arm_overrides(arm: ArmSpec, folder: Path) -> dict[str, Any]:
    """The arm's `set:` as a nested tree, its path keys (PATH_KEYS: data.inputs, ...) anchored at `folder`."""
    try:
        return resolve_paths(dotted_tree(arm.set), folder)
    except ConfigError as exc:
        raise ConfigError(f"arm {arm.name!r}: {exc}") from None
