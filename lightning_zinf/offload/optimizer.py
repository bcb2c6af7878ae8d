"""Optimizer offload: fp32 master shards, fp32 gradient shards and optimizer states on the ``cpu``
or ``nvme`` tier (ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1 "infinity offload engine"; ZeRO-Offload,
Ren et al. ATC'21, §4 for the CPU step).

``cpu``: the master and gradient shards are allocated in CPU memory; the user's optimizer steps them
there (its states are created next to them); the updated master is copied into the compute-dtype
shard on the device after the step.

``nvme``: the same tensors, but between uses their bytes live in swap files and their storage is
shrunk to zero bytes (views made while resident stay valid, as for gathered parameters). A gradient
shard is swapped out as soon as backward has accumulated into it. The optimizer step runs one
sub-group of flat groups at a time: swap in its master, gradient and states, step them with the
user's optimizer restricted to their fragments, copy the master into the compute shard, swap the
master and states out (the gradient is consumed: dropped, not written). With ``overlap`` the next
sub-group is read while the current one steps and the previous one's writes complete in the
background (the swapper's threads release the GIL).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

from lightning_zinf.config import OffloadConfig
from lightning_zinf.engine.flat import FlatGroup

__all__ = ["OptimizerOffload"]


class _Swapped:
    """A CPU tensor whose bytes move between memory and one swap file.

    States: resident (storage allocated, maybe a write in flight) or out (zero bytes of storage,
    the file holds the bytes), maybe with a read in flight after :meth:`swap_in`.
    """

    def __init__(self, tensor: Tensor, key: str, swapper) -> None:
        self.tensor, self.key, self.swapper = tensor, key, swapper
        self.nbytes = tensor.numel() * tensor.element_size()
        self.resident = True
        self._write = None
        self._read = None

    def swap_out(self, write: bool = True) -> None:
        """Start writing the bytes (``write``) and free the storage once written (:meth:`settle`)."""
        if not self.resident:
            return
        if write:
            self._write = self.swapper.write(self.key, self.tensor)
        else:
            self._release()

    def settle(self) -> None:
        """Complete whatever transfer is in flight (raises the swapper's error if it failed)."""
        if self._write is not None:
            self._write.wait()
            self._write = None
            self._release()
        if self._read is not None:
            self._read.wait()
            self._read = None

    def swap_in(self, read: bool = True) -> None:
        """Make the storage exist again; ``read``: start reading the file into it (:meth:`settle`
        completes it). A tensor whose write is still in flight keeps its bytes and needs no read."""
        if self._write is not None:
            self._write.wait()  # the bytes never left memory; the file is now current too
            self._write = None
            return
        if self.resident:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self.resident = True
        if read:
            self._read = self.swapper.read(self.key, self.tensor)

    def _release(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        self.resident = False


class OptimizerOffload:
    """Places (and, for ``nvme``, swaps) the optimizer side of every trainable flat group.

    Args:
        groups: The engine's flat groups (frozen ones are ignored), in the engine's order; a group's
            index there names its swap files.
        config: The offload settings (``config.optimizer`` is ``"cpu"`` or ``"nvme"``).
        swapper: The rank's :class:`~lightning_zinf.offload.NvmeSwapper` (``nvme`` only).

    Raises:
        ValueError: ``nvme`` without a swapper.
    """

    def __init__(self, groups: list[FlatGroup], config: OffloadConfig, swapper=None) -> None:
        if config.optimizer == "nvme" and swapper is None:
            raise ValueError("NVMe optimizer offload needs a swapper.")
        self.config = config
        self.nvme = config.optimizer == "nvme"
        self.swapper = swapper
        self.groups = groups
        self.trainable = [i for i, g in enumerate(groups) if g.trainable]
        self._masters: dict[int, _Swapped] = {}
        self._grads: dict[int, _Swapped] = {}
        self._states: dict[int, list[_Swapped]] = {}
        self.clip_coef: Optional[Tensor] = None

    # --- placement --------------------------------------------------------------------------------
    def place_masters(self) -> None:
        """Create every trainable group's fp32 master on the CPU (separate from the compute shard),
        and with ``nvme`` swap it out. Idempotent; call before the optimizer is sharded."""
        cpu = torch.device("cpu")
        for i in self.trainable:
            group = self.groups[i]
            if group.master is not None:
                continue
            group.make_master(state_device=cpu, separate=True)
            if self.nvme:
                group.track_grad_norm = True
                group.master_synced_by_offload = True
                swapped = self._masters[i] = _Swapped(group.master, f"g{i}.master", self.swapper)
                swapped.swap_out()
        self.settle_all()

    # --- gradients during backward ----------------------------------------------------------------
    def before_accumulate(self, index: int) -> None:
        """Make group ``index``'s gradient shard resident for :meth:`FlatGroup.accumulate`: read it
        back when accumulating onto earlier micro-batches, only allocate it when starting over."""
        if not self.nvme:
            return
        group = self.groups[index]
        swapped = self._grads.get(index)
        if swapped is not None:
            swapped.swap_in(read=not group.fresh_accumulation)
            swapped.settle()

    def after_accumulate(self, index: int) -> None:
        """Swap group ``index``'s gradient shard out (written behind; freed once on disk)."""
        if not self.nvme:
            return
        group = self.groups[index]
        if index not in self._grads:
            self._grads[index] = _Swapped(group.grad_shard, f"g{index}.grad", self.swapper)
        self._grads[index].swap_out()

    # --- clipping and the step --------------------------------------------------------------------
    def global_grad_sq_norm(self) -> Tensor:
        """This rank's share of the squared gradient norm (fp32, 0-d, CPU), from the per-fragment
        norms recorded at accumulation (``nvme``: the gradients themselves may be on disk). Summed
        fragment by fragment in the order :func:`~lightning_zinf.engine.optim.clip_grad_norm_` sums
        resident gradients, so clipping gives bit-identical results with and without offload."""
        total = torch.zeros((), dtype=torch.float32)
        for i in self.trainable:
            group = self.groups[i]
            for fragment, sq in zip(group.fragments, group.grad_sq_norms):
                if fragment.grad is not None:
                    total += sq
        return total

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` sub-group by sub-group with swapping (``nvme``), then leave its
        fragments without gradients so its own (hooked) step that follows does nothing.

        The user's optimizer does the arithmetic: its step function runs on the resident fragments
        only (its param groups restricted for the call), so its hyper-parameters, LR schedule and
        state layout are unchanged.
        """
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        todo = [
            i for i in self.trainable
            if any(id(f) in owned and f.grad is not None for f in self.groups[i].fragments)
        ]
        subgroups = self._subgroups(todo)
        raw_step = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)
        if subgroups:
            self._bring_in(subgroups[0])
        for k, members in enumerate(subgroups):
            for i in members:
                self._settle_group(i)
            if self.config.overlap and k + 1 < len(subgroups):
                self._bring_in(subgroups[k + 1])
            fragments = {id(f): f for i in members for f in self.groups[i].fragments if f.grad is not None}
            if self.clip_coef is not None:
                for f in fragments.values():
                    f.grad.mul_(self.clip_coef)
            _step_restricted(optimizer, raw_step, fragments)
            for i in members:
                self._send_out(optimizer, i)
            if not self.config.overlap:
                self.settle_all()
                if k + 1 < len(subgroups):
                    self._bring_in(subgroups[k + 1])
        self.settle_all()
        self.clip_coef = None
        for i in todo:
            for f in self.groups[i].fragments:
                if id(f) in owned:
                    f.grad = None

    def _subgroups(self, indices: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        size = 0
        for i in indices:
            n = self.groups[i].shard_numel
            if out and size + n <= self.config.sub_group_size:
                out[-1].append(i)
                size += n
            else:
                out.append([i])
                size = n
        return out

    def _bring_in(self, members: list[int]) -> None:
        for i in members:
            self._masters[i].swap_in()
            if i in self._grads:
                self._grads[i].swap_in()
            for state in self._states.get(i, []):
                state.swap_in()

    def _settle_group(self, i: int) -> None:
        for swapped in (self._masters[i], self._grads.get(i), *self._states.get(i, [])):
            if swapped is not None:
                swapped.settle()

    def _send_out(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        group = self.groups[i]
        group.shard.copy_(group.master)  # the compute-dtype shard the next forward gathers
        if not self._states.get(i):  # states the optimizer created in this (first) step
            self._collect_states(optimizer, i)
        self._masters[i].swap_out()
        for state in self._states.get(i, []):
            state.swap_out()
        if i in self._grads:
            self._grads[i].swap_out(write=False)  # consumed by the step

    def settle_all(self) -> None:
        """Complete every transfer in flight (before a checkpoint, at the end of a step)."""
        for swapped in (*self._masters.values(), *self._grads.values(), *(s for v in self._states.values() for s in v)):
            swapped.settle()

    # --- whole state, for checkpoints -------------------------------------------------------------
    @contextmanager
    def resident(self, optimizers: list[torch.optim.Optimizer], write_back: bool) -> Iterator[None]:
        """Every master, gradient and state tensor in memory for the block (checkpoint save/load);
        afterwards swapped out again, rewritten only if ``write_back`` (they were loaded into).

        Collects states the optimizers hold for fragments not yet seen (a checkpoint loaded before
        the first step creates them).
        """
        if not self.nvme:
            yield
            return
        for i in self.trainable:
            self._bring_in([i])
        self.settle_all()
        try:
            yield
        finally:
            for optimizer in optimizers:
                for i in self.trainable:
                    if not self._states.get(i):
                        self._collect_states(optimizer, i)
            for i in self.trainable:
                self._masters[i].swap_out(write=write_back)
                for state in self._states.get(i, []):
                    state.swap_out(write=write_back)
                if i in self._grads:
                    self._grads[i].swap_out(write=write_back)
            self.settle_all()

    def _collect_states(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        group = self.groups[i]
        found = []
        for j, fragment in enumerate(group.fragments):
            for name, value in optimizer.state.get(fragment, {}).items():
                if isinstance(value, Tensor) and value.numel() == fragment.numel() > 0 and value.device.type == "cpu":
                    found.append(_Swapped(value, f"g{i}.p{j}.{name}", self.swapper))
        if found:
            self._states[i] = found

    # --- accounting -------------------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        """Bytes of offloaded state in CPU memory now and in swap files (``cpu``, ``nvme``)."""
        cpu = nvme = 0
        for swapped in (*self._masters.values(), *self._grads.values(), *(s for v in self._states.values() for s in v)):
            if swapped.resident:
                cpu += swapped.nbytes
            else:
                nvme += swapped.nbytes
        return {"cpu": cpu, "nvme": nvme}


def _step_restricted(optimizer: torch.optim.Optimizer, raw_step, fragments: dict[int, Tensor]) -> None:
    """Run the optimizer's own step function (without its hooks) on ``fragments`` only."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in fragments]
        raw_step(optimizer)
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
