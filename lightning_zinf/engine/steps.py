"""The optimizer step: the user's optimizers re-pointed at this rank's fp32 master shards, the
work before and after each of their steps, and gradient clipping over the ranks.

:meth:`OptimizerSteps.shard_optimizer` re-points an optimizer (:meth:`ShardedOptimizers.adopt <lightning_zinf.engine.sharded.ShardedOptimizers.adopt>`)
and hooks its steps: before one, the collectives in flight are settled, the ranks' agreement is
verified and an offloaded optimizer steps sub-group by sub-group; after one
(:meth:`OptimizerSteps.after_step`), the stepped masters are cast into the compute shards and the
persistent units holding them gathered again (ZeRO stage 3: Rajbhandari et al., SC'20, §5.3).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_zinf.comm import Collectives
from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.negotiation import OPTIMIZER_STEP
from lightning_zinf.engine.optim import clip_grad_norm_
from lightning_zinf.engine.sharded import ShardedOptimizers
from lightning_zinf.engine.ranges import phased
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.engine.units import Unit, UnitStates
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.preflight import ensure_space
from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """The engine's sharded optimizers and their steps (the engine's
    :meth:`~lightning_zinf.ZeroEngine.shard_optimizer`, :meth:`~lightning_zinf.ZeroEngine.after_step`,
    :meth:`~lightning_zinf.ZeroEngine.clip_grad_norm_` and
    :meth:`~lightning_zinf.ZeroEngine.master_fragments` delegate here).

    Args:
        units: The engine's units.
        comm: The engine's collectives.
        states: The unit state machine (persistent units are gathered again after a step).
        agreement: The rank agreement (verified before every step).
        transfers: The engine's copy queue.
        device: The compute device.
        shard_device: Where the parameter shards live (the host with parameter offload).
        param_offload: The NVMe tier of the parameter shards, or ``None``.
        offload: The offloaded optimizer, or ``None``.
        swapper: The swap files' swapper (NVMe offload), or ``None``.
        nvme_path: ``OffloadConfig.nvme_path`` (where the swap files go).
        sharded: The engine's sharded optimizers (what stands for each parameter in them, their
            plain layouts, ``add_param_group``).
        settle: Finishes every collective and swap in flight (the engine's; ``boundary=True`` at a
            step boundary).
        tracer: The prefetch trace (the order an offloaded step in the background steps groups in).
    """

    def __init__(self, units: list[Unit], *, comm: Collectives, states: UnitStates, agreement: RankAgreement,
                 transfers: Transfers, device: torch.device, shard_device: torch.device,
                 param_offload: Optional[ParamOffload], offload: Optional[OptimizerOffload],
                 swapper: Optional[NvmeSwapper], nvme_path: Optional[str], sharded: ShardedOptimizers,
                 settle: Callable[..., None], tracer: Tracer) -> None:
        self.units = units
        self.comm = comm
        self.states = states
        self.agreement = agreement
        self.transfers = transfers
        self.device = device
        self._shard_device = shard_device
        self.param_offload = param_offload
        self.offload = offload
        self.swapper = swapper
        self._nvme_path = nvme_path
        self.sharded = sharded
        self.optimizers = sharded.optimizers
        self._settle = settle
        self.tracer = tracer

    @property
    def groups(self) -> list[FlatGroup]:
        """All flat groups, unit by unit."""
        return [g for u in self.units for g in u.groups]

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-point a freshly built optimizer at this rank's fp32 master shards (in place), and
        run :meth:`after_step` for the flat groups it steps after each of its steps (a step post-hook).

        See :meth:`ShardedOptimizers.adopt <lightning_zinf.engine.sharded.ShardedOptimizers.adopt>` for
        the rules and errors: the optimizer may hold frozen parameters (stepped once unfrozen), and
        its ``add_param_group`` takes the model's parameters. With ``optimizer="nvme"`` every rank
        first checks that the swap files this optimizer adds (fp32 masters, gradient shards, its
        per-element states) fit in ``nvme_path``
        (:func:`~lightning_zinf.offload.preflight.ensure_space`; collective), and raises
        :class:`~lightning_zinf.offload.SwapError` before writing any of them if they do not.
        """
        if self.offload is not None and self.offload.nvme:
            self.offload.plan_host(optimizer)  # (before the preflight: kept groups need no files)
            self.swapper.planned_bytes = ensure_space(
                self.comm, self._nvme_path, self.offload.planned_bytes(optimizer),
                "fp32 masters, gradient shards and optimizer states", before=self._swap_file_bytes())
        self.sharded.adopt(optimizer)
        if self.offload is not None and self.offload.nvme:
            self.offload.wrap_zero_grad(optimizer)
        if self.offload is not None:
            self._wait_before_state_access(optimizer)
        optimizer.register_step_pre_hook(lambda opt, *_: self._before_step(opt))
        # The groups it steps: those holding a master fragment it was given (an unfreeze or
        # add_param_group may add some).
        optimizer.register_step_post_hook(lambda opt, *_: self.after_step(self.sharded.stepped(opt),
                                                                          self.sharded.held_flags(opt)))
        return optimizer

    def _wait_before_state_access(self, optimizer: torch.optim.Optimizer) -> None:
        """An offloaded step may still run in the background (``overlap_step``): the optimizer's
        ``state_dict``, ``load_state_dict`` and ``add_param_group`` first wait for it. With the
        states on NVMe, whose tensors are empty between steps (swapped out), ``state_dict`` reads
        them in one flat group at a time and returns copies of them (torch's returns the tensors
        themselves), and ``load_state_dict`` loads copies of the given states (torch keeps the
        given tensors, which the swap records would empty between steps) and writes them to the
        swap files one flat group at a time."""
        for name in ("state_dict", "load_state_dict", "add_param_group"):
            method = getattr(optimizer, name)

            def waiting(*args, _method=method, _name=name, **kwargs):
                self.offload.wait_all()
                if not self.offload.nvme or _name == "add_param_group":
                    return _method(*args, **kwargs)
                if _name == "state_dict":
                    return self._read_states(optimizer, _method(*args, **kwargs))
                (state_dict,) = args or (kwargs.pop("state_dict"),)
                result = _method(_copied_states(state_dict), **kwargs)
                for group in self.sharded.stepped(optimizer):
                    with self.offload.resident([optimizer], write_back=True, groups=[group]):
                        pass  # the loaded states replace the records' on the way out
                return result

            setattr(optimizer, name, waiting)

    def _read_states(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """``optimizer.state_dict()``'s result with each parameter's state copied from memory, one
        flat group's records in memory at a time (torch's per-parameter entries are the
        optimizer's own dicts, whose swapped tensors are empty between steps)."""
        index = {id(p): n for n, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        state = dict(state_dict["state"])
        for group in self.sharded.stepped(optimizer):
            with self.offload.resident([optimizer], write_back=False, groups=[group]):
                for fragment in group.fragments:
                    n = index.get(id(fragment))
                    if n is not None and n in state:
                        state[n] = _cloned(state[n])
        return {**state_dict, "state": state}

    def prepare_step(self) -> None:
        """When a backward starts: an NVMe-offloaded optimizer reads the state its next step needs
        first (:meth:`OptimizerOffload.read_ahead_step
        <lightning_zinf.offload.optimizer.OptimizerOffload.read_ahead_step>`), behind the backward."""
        if self.offload is not None and self.offload.nvme:  # (the order only when it may be used)
            self.offload.read_ahead_step(self._step_order())

    def _step_order(self) -> list[list[int]]:
        """Group indices unit by unit, in the order the next forward needs them: persistent units
        first (gathered again right after the step), then the units of the pass that just ran
        in the order it first gathered them, then the others."""
        index = {id(g): i for i, g in enumerate(self.groups)}
        traced = [self.units[u] for u in self.tracer.unit_order() if u < len(self.units)]
        ordered = [u for u in self.units if u.persistent] + traced + list(self.units)
        return [[index[id(g)] for g in unit.groups] for unit in dict.fromkeys(ordered)]

    def _swap_file_bytes(self) -> int:
        """Bytes of this rank's swap files now (records with a file, in memory or not)."""
        return sum(part.file_bytes() for part in (self.param_offload, self.offload) if part is not None)

    @phased("zinf.before_step")
    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._settle()
        # Ranks that ran different modules meet here, and check their collectives since the last check.
        self.agreement.meet_and_verify(OPTIMIZER_STEP, "the agreement check before an optimizer step")
        if self.offload is not None:
            if self._shard_device != self.device:
                self.transfers.host_wait_h2d()  # the step rewrites host-tier shards a gather may read
            # Sub-group by sub-group, each one's updated shards copied out while the next steps,
            # in the background with overlap_step; the optimizer's own step then has nothing left.
            self.offload.step(optimizer, self._step_order())

    def master_fragments(self) -> list[Tensor]:
        """This rank's fp32 master fragments (1-D), as the sharded optimizer holds them (those of
        groups frozen again included: they have no gradient); an offloaded step in flight is
        completed first."""
        if self.offload is not None:
            self.offload.wait_all()
        return [f for g in self.groups for f in g.fragments]

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip gradient shards by the global L2 norm over all ranks; returns the norm (0-d fp32).

        With NVMe optimizer offload the gradients may be on disk: the norm comes from the squared
        norms recorded as they were accumulated, and the scaling is applied as each sub-group is
        swapped in for the step.
        """
        if self.offload is not None:
            self.offload.wait_all()  # a step still in flight steps the fragments read below
        if self.offload is not None and self.offload.nvme:
            self._settle()
            norm = self.comm.sum_over_shards(self.offload.global_grad_sq_norm()).sqrt()  # on the host
            self.offload.clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            return norm
        return clip_grad_norm_(self.master_fragments(), max_norm, self.comm)

    @phased("zinf.after_step")
    def after_step(self, groups: Optional[Sequence[FlatGroup]] = None,
                   held: Optional[Sequence[Sequence[bool]]] = None) -> None:
        """After ``optimizer.step()`` (called by the hook :meth:`shard_optimizer` installs, with the
        flat groups that optimizer steps: those holding a master fragment it was given): for
        ``groups``, cast the masters into the compute shards, mark the gradients consumed and drop
        the stale hpZ secondary partitions; then re-gather the persistent units that hold one of them.

        Other groups are left alone, so that several models or optimizers in one engine do not
        disturb each other: another optimizer's gradients keep accumulating across this step, as
        in plain torch, and frozen groups keep their secondary partitions (a step cannot change
        them; loads and edits drop them, :meth:`state_resident`). A group holding parameters of
        two optimizers has only the stepped parameters' gradients consumed (:meth:`FlatGroup.after_step
        <lightning_zinf.engine.flat.FlatGroup.after_step>`), except with its optimizer on NVMe.

        Args:
            groups: The groups the optimizer that stepped holds, or ``None`` (after a load): every group.
            held: Per group of ``groups``, per parameter, whether that optimizer holds it
                (:meth:`ShardedOptimizers.held_flags
                <lightning_zinf.engine.sharded.ShardedOptimizers.held_flags>`); ``None``: every one.
        """
        self._settle(boundary=True)
        if self._shard_device != self.device:
            self.transfers.host_wait_h2d()  # host-tier shards are rewritten below
        stepped = self.groups if groups is None else groups
        for position, group in enumerate(stepped):
            # An offloaded optimizer rewrote the shards of what it stepped already (OptimizerOffload.step).
            rewrites = self.param_offload is not None and group.master is not None and not group.host_state
            if rewrites:
                self.param_offload.will_overwrite(group)
            group.after_step(None if held is None else held[position])
            if rewrites:
                self.param_offload.changed(group)
        # Updated shards copied from host-side masters (in order, on the copy stream) are read by
        # compute from here on: order it after them, without waiting on the host.
        self.transfers.wait_on_device(self.transfers.record())
        changed = {id(g) for g in stepped}
        with self.agreement.lockstep():  # every rank met at the step's pre-hook
            self.states.gather_exact([u for u in self.units if u.persistent and any(id(g) in changed for g in u.groups)])


def _copied_states(state_dict: dict) -> dict:
    """``state_dict`` with each per-parameter state tensor cloned (the param groups as given)."""
    return {**state_dict, "state": {index: _cloned(values) for index, values in state_dict["state"].items()}}


def _cloned(values: dict) -> dict:
    """One parameter's optimizer state with its tensors cloned (scalars as they are)."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in values.items()}
