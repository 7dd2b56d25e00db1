"""torchft replica groups (parallel.fault_tolerance: torchft): the data-parallel replicas of a job as groups that
leave and join at step granularity while the others keep stepping.

Each replica group is one Kiln training (one process or one torchrun) with its own group-local world: inside it
everything Kiln has (DDP, FSDP2/HSDP, TP, PP) is unchanged. Across groups a torchft `Manager` (one per rank,
group rank 0 serving it) asks the lighthouse for a quorum of live groups and reconfigures a process group over
them (gloo on CPUs, NCCL on GPUs). The data-parallel world is then groups x the group's own data-parallel ranks:
rank = participating group rank x group dp_world + dp_rank, so HSDP's replicate dimension (and DDP's ranks)
extends across groups, and the loader splits the same global batch over whoever is in the quorum
(loader.split_batch). Gradients are all-reduced inside a group first (its own DDP/HSDP), then averaged across
groups in one flat all-reduce that also carries the loss and the data position (every group must be at the
same one); the step commits only when torchft's `should_commit` says every group's part arrived, else it is
taken again on the groups left (parts/replicas.py). A group that joins heals from a live peer (weights,
optimizer, every part's state) through torchft's checkpoint transport, not from a checkpoint.

Group 0 writes {out_dir}/run (metrics.jsonl, checkpoints); group N writes run/replicas/group-N
(run_layout.replica_run_of): Kiln's checkpoints still guard the job against losing every group.

`Outer` runs torchft's LocalSGD or DiLoCo (train.outer) on the inner optimizer; its state (DiLoCo's global
weights and outer momentum) travels in full checkpoints beside the optimizer's moments, by parameter name.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch

from kiln.config import Config, OuterConfig, TorchftConfig
from kiln.errors import ConfigError, KilnError
from kiln.run_layout import replica_run_of
from kiln.train.parallel.dist import Dist, broadcast_object

GROUP_ENV = "KILN_REPLICA_GROUP"
LOST = "replica_lost"  # the skip reason of a step a lost group kept from committing
OUTER_KEYS = ("outer_original", "outer_momentum")  # what Outer adds to a parameter's optimizer state


def local_part_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP2/TP DTensor's local shard, a view), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def replica_group(cfg: TorchftConfig) -> int:
    """This group's number: parallel.torchft.group, else KILN_REPLICA_GROUP; a one-line error without either."""
    if cfg.group is not None:
        return cfg.group
    value = os.environ.get(GROUP_ENV)
    if value is None or not value.isdigit():
        raise ConfigError(f"parallel.fault_tolerance=torchft needs this replica group's number: set "
                          f"parallel.torchft.group or {GROUP_ENV}=N (0 for the group that writes {{out_dir}}/run)")
    return int(value)


def group_run_dir(cfg: Config):
    """The run folder this process writes: the run's own, or under torchft group N's run/replicas/group-N."""
    if cfg.parallel.fault_tolerance != "torchft" or replica_group(cfg.parallel.torchft) == 0:
        return cfg.layout.run
    return replica_run_of(cfg.layout.run, replica_group(cfg.parallel.torchft))


class ReplicaGroups:
    """This rank's torchft Manager: quorum, the cross-group all-reduce, the commit, healing's state functions."""

    def __init__(self, cfg: TorchftConfig, d: Dist) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        except ModuleNotFoundError:
            from kiln.install import install_hint

            raise KilnError(f"parallel.fault_tolerance=torchft needs torchft: {install_hint('ft')}") from None
        lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError("parallel.fault_tolerance=torchft needs the lighthouse's URL: set "
                              "parallel.torchft.lighthouse or TORCHFT_LIGHTHOUSE (start one with "
                              "`torchft_lighthouse --min_replicas 1`)")
        self.group, self.d = replica_group(cfg), d
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if d.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.pg, self._store = pg, None
        if d.world == 1:  # no torchrun store to share: this group serves its own (other groups connect to it)
            self._store = torch.distributed.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            host, port = os.environ.get("KILN_FT_HOST") or socket.gethostname(), self._store.port
        else:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_groups,
                               use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
                               rank=d.rank, world_size=d.world, store_addr=host, store_port=port,
                               lighthouse_addr=lighthouse, replica_id=f"kiln_group_{self.group}", init_sync=False,
                               hostname=os.environ.get("KILN_FT_HOST") or socket.gethostname())
        self.bytes = 0  # bytes this rank handed to cross-group all-reduces (the communication volume)
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # LocalSGD / DiLoCo's all-reduces are counted too
        self.committed: bool | None = None  # the last should_commit's answer (theirs too)
        should_commit = self.manager.should_commit

        def remembered(*args, **kwargs) -> bool:
            self.committed = should_commit(*args, **kwargs)
            return self.committed

        self.manager.should_commit = remembered
        self.outer: Outer | None = None

    def register(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        self.manager.register_state_dict_fn(key, load, save)

    def quorum(self, step: int | None = None) -> None:
        """Wait for a quorum of live groups (this group heals first when it is behind the quorum's step)."""
        if step is not None:
            self.at_step(step)
        self.manager.start_quorum()

    def at_step(self, step: int) -> None:
        """torchft's step := Kiln's (train.outer): torchft counts committed syncs, the same for groups at other
        steps between two syncs; with Kiln's step a group behind (an older checkpoint, a joining group) heals
        from the one ahead at the next quorum."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def members(self) -> list[int]:
        """The participating groups' numbers (torchft numbers a group's ranks group x group world + rank)."""
        ranks = getattr(self.pg, "_global_ranks", None) or [self.group * self.d.world]
        return sorted({r // self.d.world for r in ranks})

    def data_parallel(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        """(rank, world) of this rank among every participating group's data-parallel ranks."""
        rank = self.manager.participating_rank() or 0
        return rank * dp_world + dp_rank, max(self.manager.num_participants(), 1) * dp_world

    def average_(self, flat: torch.Tensor) -> bool:
        """Average `flat` over the participating groups in place; False when a group was lost during it."""
        self.manager.allreduce(flat).wait()
        return self.manager.errored() is None

    def should_commit(self) -> bool:
        return self.manager.should_commit()

    def state_dict(self) -> dict[str, Any]:
        return {"manager": self.manager.state_dict(), **(self.outer.state_dict() if self.outer else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])
        if self.outer is not None:
            self.outer.load_state_dict(state)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class Outer:
    """train.outer: torchft's LocalSGD or DiLoCo on the inner optimizer (its step hooks sync every H steps)."""

    def __init__(self, cfg: OuterConfig, groups: ReplicaGroups, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.model, self.outer_opt = model, None
        if cfg.algorithm == "diloco":  # the DiLoCo paper's outer step: Nesterov SGD on the averaged pseudo-gradient
            self.outer_opt = torch.optim.SGD(model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                             nesterov=True)
            self.sync = DiLoCo(groups.manager, [model], optimizer, self.outer_opt, sync_every=cfg.sync_every,
                               pin_memory=False)
        else:
            self.sync = LocalSGD(groups.manager, model, optimizer, sync_every=cfg.sync_every)
        self.sync.__enter__()  # registers the hooks on the inner optimizer's step
        self.groups, self.algorithm, self.synced, self._bytes = groups, cfg.algorithm, None, groups.bytes
        self.outer_steps = 0  # committed syncs (torchft's own step is Kiln's under train.outer: at_step)
        optimizer.register_step_post_hook(self._after_step)  # after the sync's own hook

    def _after_step(self, *_) -> None:
        if self.sync._local_step == 0:  # the sync's hook synchronised in this step
            bytes_, self._bytes = self.groups.bytes - self._bytes, self.groups.bytes
            self.outer_steps += bool(self.groups.committed)
            self.synced = {"algorithm": self.algorithm, "committed": self.groups.committed, "bytes": bytes_,
                           "outer_step": self.outer_steps}

    @property
    def in_sync(self) -> bool:
        """Inside a sync (its quorum: the inner steps counted, the all-reduce to come)."""
        return self.sync._local_step >= self.sync._sync_every

    def join_sync(self) -> None:
        """The rest of the sync this group healed into (a group joining mid-run: its first quorum is the others'
        sync): the same all-reduce, commit and outer step as theirs, from the state they sent."""
        if self.outer_opt is not None:
            fragment = self.sync._fragments[self.sync._current_fragment()]
            fragment.prepare_sync()
            fragment.perform_sync()
        else:
            self.sync._perform_sync()
        self.sync._local_step = 0
        self._after_step()

    def skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """A step the guards skipped still counts in the sync schedule, so every group syncs at the same step."""
        self.sync._step_pre_hook(optimizer, (), {})
        self.sync._step_post_hook(optimizer, (), {})
        self._after_step()

    def state_dict(self) -> dict[str, Any]:
        return {"local_step": self.sync._local_step, "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync._local_step = state.get("local_step", 0)
        self.outer_steps = state.get("outer_steps", state.get("manager", {}).get("step", 0))

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{parameter name: {outer_original, outer_momentum}}: DiLoCo's global weights and outer momentum."""
        if self.outer_opt is None:
            return {}
        original = self.sync._fragments[0].original_parameters
        out = {}
        for name, p in self.model.named_parameters():
            entry = {"outer_original": original[name].detach().cpu().clone()}
            if "momentum_buffer" in self.outer_opt.state.get(p, {}):
                entry["outer_momentum"] = local_part_of(self.outer_opt.state[p]["momentum_buffer"]).cpu().clone()
            out[name] = entry
        return out

    def load_tensors(self, by_name: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.outer_opt is None or not by_name:
            return
        original = self.sync._fragments[0].original_parameters
        for name, p in self.model.named_parameters():
            entry = by_name.get(name, {})
            if "outer_original" in entry:
                original[name].copy_(entry["outer_original"])
            if "outer_momentum" in entry:
                self.outer_opt.state[p]["momentum_buffer"] = entry["outer_momentum"].to(p.device).clone()


class FaultTolerant:
    """What torchft adds to a data-parallel kind (parallelize.fault_tolerant): the cross-group all-reduce in the
    step's agreement, the commit as the first guard, and the outer state in full checkpoints."""

    replicas: ReplicaGroups
    position = 0  # the loader position of this step's batch (parts/replicas.py): every group must be at it

    def agree_(self, t: torch.Tensor) -> torch.Tensor:
        """The group's own agreement, then (every step unless train.outer) gradients and loss averaged across the
        participating groups in one flat all-reduce, with the data position as a check."""
        t = super().agree_(t)
        if self.replicas.outer is not None:
            return t
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [local_part_of(p.grad) if p.grad is not None else torch.zeros_like(local_part_of(p))
                 for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]
                         + [torch.tensor([t[0].item(), float(self.position % 2**23)], device=t.device)])
        if self.replicas.average_(flat):
            if flat[-1].item() != float(self.position % 2**23):
                raise KilnError(f"replica group {self.replicas.group}: the groups of the quorum are at other data "
                                "positions than this one's; start every group from the same run (out_dir)")
            offset = 0
            for p, g in zip(params, grads):
                local = flat[offset: offset + g.numel()].view_as(g).to(g.dtype)
                offset += g.numel()
                if p.grad is None:
                    p.grad = local.clone() if not hasattr(p, "to_local") else None
                else:
                    local_part_of(p.grad).copy_(local)
            t[0] = flat[-2]
        return t

    def step_guards(self) -> list:
        return [self, *super().step_guards()]

    def check(self, loss: float, grad_norm: float) -> str | None:
        """The first guard: a step whose cross-group all-reduce a lost group spoiled does not commit."""
        if self.replicas.outer is not None:
            return None
        return None if self.replicas.should_commit() else LOST

    def full_states(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        model_sd, optim_sd = super().full_states(optimizer)
        if self.replicas.outer is not None and optim_sd:
            for name, entry in self.replicas.outer.tensors().items():
                optim_sd["state"].setdefault(name, {}).update(entry)
        return model_sd, optim_sd

    def load(self, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        outer = {name: {k: s.pop(k) for k in OUTER_KEYS if k in s}
                 for name, s in (optim_sd or {}).get("state", {}).items() if isinstance(name, str)}
        super().load(optimizer, model_sd, optim_sd)
        if self.replicas.outer is not None:
            if self.d.world > 1 and not self.every_rank_reads:
                outer = broadcast_object(self.d, outer)
            self.replicas.outer.load_tensors(outer)
