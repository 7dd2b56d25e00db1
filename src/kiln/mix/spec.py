"""The mix file (`kiln mix MIX.yaml`): its typed keys, read and checked before any work.

Keys are typed and strict as an ablation file's (kiln.ablate.spec, whose eval, statistics and proxy keys it
shares): a typo stops with the closest valid key, a bad value with the key and why. Relative paths (base,
out_dir, each source's inputs and path keys in its `set:`, the eval sets) are relative to the mix file's folder.

Each source is, to kiln.ablate, an arm with no runs of its own: the base config plus `data.inputs` and its
`set:` (data.* only), its own data stage and shards, one tokenizer for all (`as_ablation`). Pure pydantic
and YAML: importing this loads no torch (validating a file does: the task metrics' names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from kiln.ablate.spec import (ARM_NAME, RESERVED, AblationSpec, ArmSpec, EvalSpec, StatisticsSpec, _absolute,
                              _check_seeds, _typo_first)
from kiln.config import Section, TaskConfig, explain_error, read_config_file
from kiln.errors import ConfigError

# What kiln mix writes directly in out_dir (plan.json is kiln.ablate's PLAN_FILE: the same ownership rule).
RESULTS, PAGE = "mix.json", "mix.html"
PAGE_MARKER = "<!-- written by kiln mix -->\n"  # mix.html's first line: what lets a later run replace it
SOURCES, SWARM, VERIFY = "sources", "swarm", "verify"  # out_dir's folders: the sources, the swarm, the proof
ARMS = ("natural", "proposed", "best-swarm")  # the verification's arms; natural is the baseline
SWARM_PER_SOURCE = 4  # swarm's default: this many runs per source
CONCENTRATION = 1.0  # the Dirichlet's default concentration per source (see `concentration`)


class SourceSpec(Section):
    inputs: list[str] = Field(description="the source's data.inputs (paths, globs, Hub folders, URLs)")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of the base config's data "
                                "section for this source alone: {data.quality.fineweb.enabled: false}")

    @field_validator("inputs")
    @classmethod
    def _some_inputs(cls, inputs: list[str]) -> list[str]:
        if not inputs:
            raise ValueError("inputs is empty: list the source's files or globs")
        return inputs

    @field_validator("set")
    @classmethod
    def _data_only(cls, tree: dict[str, Any]) -> dict[str, Any]:
        for key in tree:
            if str(key).split(".")[0] != "data" or str(key) == "data.inputs":
                raise ValueError(f"set: {key!r} is not a data.* key (other than data.inputs, which is `inputs`): a "
                                 "source changes only its data; the model, schedule and budget are the base config's")
        return tree


class MixSpec(Section):
    base: str = Field(description="a Kiln config every run starts from (its data section: each source's too)")
    out_dir: str = Field(description="where the sources, the swarm, the verification, mix.json and mix.html go")
    sources: dict[str, SourceSpec] = Field(description="{name: {inputs, set}}: each through the data stage, packed "
                                           "apart; a run mixes their shards by weight (loader.sources)")
    proxy: Literal["cpu-tiny", "20m", "150m", "400m", "1b"] | None = Field(
        None, description="sets the model, sequence length, batch and token budget (kiln ablate's scales)")
    proxy_tokens: int | None = Field(None, ge=1, description="training tokens per run; null = the proxy's default")
    swarm: int | None = Field(None, ge=1, description="proxy runs on sampled mixtures; null = "
                              f"{SWARM_PER_SOURCE} per source")
    concentration: float = Field(CONCENTRATION, gt=0, description="the swarm's Dirichlet: parameters = "
                                 "concentration x number of sources x each source's natural token share (1: "
                                 "uniform on the simplex when the shares are equal; larger: closer to natural)")
    max_epochs: float = Field(4.0, gt=0, description="no source is repeated more often than this in any run "
                              "(swarm, proposal, verification): its weight <= max_epochs x its tokens / the budget")
    swarm_seed: int = Field(0, description="the seed of the swarm's draws and of every swarm run's training")
    seeds: list[int] = Field(default_factory=lambda: [1, 2, 3], description="the verification's seeds: each arm "
                             "(natural, proposed, best-swarm) trained once per seed")
    eval: EvalSpec = Field(description="what every run is measured on: text sets and tasks")
    target: dict[str, float] = Field(description="what to minimise: {text set: weight} (a weighted mean of bits "
                                     "per byte), or {TASK/acc: 1} (a task's accuracy, maximised)")
    statistics: StatisticsSpec = Field(default_factory=StatisticsSpec)

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds: list[int]) -> list[int]:
        _check_seeds(seeds)
        return seeds

    @field_validator("sources")
    @classmethod
    def _names(cls, sources: dict[str, SourceSpec]) -> dict[str, SourceSpec]:
        if len(sources) < 2:
            raise ValueError(f"give at least two sources to mix, got {len(sources)}")
        for name in sources:
            if not ARM_NAME.match(name) or name in RESERVED:
                raise ValueError(f"source name {name!r} must be a folder name (letters, digits, '.', '_', '-'; at "
                                 f"most 64) and not {', '.join(sorted(RESERVED))}")
        return sources

    @model_validator(mode="after")
    def _consistent(self) -> "MixSpec":
        if not self.eval.text and not self.eval.tasks:
            raise ValueError("eval: give at least one text set or task to measure the runs on")
        if self.proxy_tokens and not self.proxy:
            raise ValueError("proxy_tokens needs a proxy (cpu-tiny, 20m, 150m, 400m or 1b)")
        check_target(self.target, self.eval)
        need = min_swarm(len(self.sources))
        if self.swarm is not None and self.swarm < need:
            raise ValueError(f"swarm {self.swarm} is smaller than the fit needs: {len(self.sources)} sources need at "
                             f"least {need} runs (a weight per source, and runs held out to check it); give swarm: "
                             f"{max(need, SWARM_PER_SOURCE * len(self.sources))}")
        if self.swarm_seed in self.seeds:
            raise ValueError(f"swarm_seed {self.swarm_seed} is also a verification seed: the best swarm run would be "
                             "measured again on the very run that picked it; give swarm_seed another value")
        return self

    @property
    def runs_in_swarm(self) -> int:
        return self.swarm if self.swarm is not None else SWARM_PER_SOURCE * len(self.sources)


def min_swarm(sources: int) -> int:
    """Runs the log-linear fit needs: one weight per source, then two more to hold runs out (cross-validation)."""
    return sources + 2


def check_target(target: dict[str, float], evals: EvalSpec) -> None:
    """The target names eval text sets (bits per byte, each with a weight > 0) or one task metric."""
    from kiln.scoring.mc import METRICS as TASK_METRICS  # (it loads torch: not at import)

    if not target:
        raise ValueError("target is empty: name the eval text sets to minimise, {SET: weight}")
    tasks = {f"{t.name}/{m}" for t in evals.tasks for m in TASK_METRICS}
    for name, weight in target.items():
        if name not in evals.text and name not in tasks:
            known = ", ".join([*evals.text, *sorted(tasks)])
            raise ValueError(f"target {name!r} names no eval set: give a text set or TASK/METRIC of eval ({known})")
        if weight <= 0:
            raise ValueError(f"target {name!r} has weight {weight}: a weight is > 0")
    if any(name in tasks for name in target) and len(target) > 1:
        raise ValueError("target mixes a task's accuracy with other metrics: give text sets (bits per byte, "
                         "averaged by weight) or one TASK/METRIC")


def read_spec(path: str | Path) -> tuple[MixSpec, dict[str, Any]]:
    """The mix file, validated, with base, out_dir and the eval sets made absolute (each source's inputs and
    `set:` stay as written: kiln.ablate.spec.arm_overrides anchors them); and the base config's mapping. Any
    error is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"mix file {path} does not exist; see `kiln mix --help` for an example")
    raw = read_config_file(path)
    folder = path.resolve().parent
    try:
        spec = MixSpec(**raw)
    except ValidationError as err:
        raise ConfigError(f"{path}: {explain_error(_typo_first(err), MixSpec, 'key')}") from None
    spec = spec.model_copy(update={  # each source's inputs and set: stay as written (as_ablation's arms)
        "base": _absolute(spec.base, folder), "out_dir": _absolute(spec.out_dir, folder),
        "eval": EvalSpec(text={k: _absolute(v, folder) for k, v in spec.eval.text.items()},
                         tasks=[TaskConfig(name=t.name, path=_absolute(t.path, folder)) for t in spec.eval.tasks])})
    return spec, read_config_file(spec.base)


def as_ablation(spec: MixSpec) -> AblationSpec:
    """The sources as kiln.ablate sees them: one arm each (out_dir/sources/NAME), the first the baseline, one
    seed (the swarm's); the arms' own runs are never planned by kiln mix (kiln.mix.driver clears them)."""
    arms = [ArmSpec(name=name, set={"data.inputs": s.inputs, **s.set}) for name, s in spec.sources.items()]
    return AblationSpec(base=spec.base, out_dir=str(Path(spec.out_dir) / SOURCES), seeds=[spec.swarm_seed],
                        baseline=arms[0].name, arms=arms, eval=spec.eval, proxy=spec.proxy,
                        proxy_tokens=spec.proxy_tokens, statistics=spec.statistics)
