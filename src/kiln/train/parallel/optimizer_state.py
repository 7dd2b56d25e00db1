"""The optimizer state in one form for every layout: keyed by parameter name.

`optimizer.state_dict()` numbers the parameters in the optimizer's order; torch.distributed.checkpoint's full form
(what FSDP2 and tensor parallel give, and what `set_optimizer_state_dict` loads) names them. A state keyed by
number handed to a loader that expects names attaches to no parameter, and AdamW silently starts again from step
1 (issue 45: a multi-rank resume from a full checkpoint did that). So every kind writes names, every loader
accepts both (a full checkpoint of an older Kiln is keyed by number), and the two conversions live here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from kiln.errors import KilnError


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each parameter's name in the optimizer's numbering (its param_groups in order), as
    torch.distributed.checkpoint names it: wrappers' parts (activation checkpointing, compile) left out."""
    names = {id(p): plain_name(n) for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def plain_name(name: str) -> str:
    """A parameter's name without wrappers' parts: the name checkpoints (full and sharded) use."""
    return ".".join(part for part in name.split(".") if part not in ("_checkpoint_wrapped_module", "_orig_mod"))


def numbered(optim_sd: dict) -> bool:
    """Whether the state is keyed by number (`optimizer.state_dict()`), not by name."""
    return any(not isinstance(p, str) for g in optim_sd.get("param_groups", []) for p in g["params"])


def by_name(optim_sd: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state keyed by number (`optimizer.state_dict()`) -> keyed by parameter name; one keyed by
    name is returned as it is. The numbers are the saving optimizer's order, which is this model's."""
    if not numbered(optim_sd):
        return optim_sd
    names = optimizer_names(model, optimizer)
    saved = [p for g in optim_sd["param_groups"] for p in g["params"]]
    if sorted(saved) != list(range(len(names))):
        raise KilnError(f"the checkpoint's optimizer state has {len(saved)} parameters and this model "
                        f"{len(names)}; it was written for another model")
    return {"state": {names[i]: v for i, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}


def by_number(optim_sd: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state keyed by name (or number) -> keyed by this optimizer's numbering, for
    `optimizer.load_state_dict`, which pairs saved and current parameters by position: each group's settings come
    from the saved group, its members from this optimizer, and each entry goes to its parameter by name."""
    optim_sd = by_name(optim_sd, model, optimizer)
    names = optimizer_names(model, optimizer)
    number = {n: i for i, n in enumerate(names)}
    wrong = KilnError("the checkpoint's optimizer state names other parameters, or other groups of them, than "
                      "this model's optimizer; it was written for another model")
    if len(optim_sd["param_groups"]) != len(optimizer.param_groups) or set(optim_sd["state"]) - set(number):
        raise wrong
    groups, first = [], 0
    for saved, group in zip(optim_sd["param_groups"], optimizer.param_groups):
        members = list(range(first, first + len(group["params"])))
        if sorted(saved["params"]) != sorted(names[i] for i in members):
            raise wrong
        groups.append({**saved, "params": members})
        first += len(members)
    return {"state": {number[k]: v for k, v in optim_sd["state"].items()}, "param_groups": groups}


@contextmanager
def settings_kept(optimizer: torch.optim.Optimizer):
    """Around loading a checkpoint's optimizer state: the groups' settings (betas, weight decay, eps) stay this run's,
    as its lr does (the schedule sets it every step); only the state (moments, step counts) comes from the checkpoint.
    Unchanged settings give the same values, so a resume stays bitwise."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)
