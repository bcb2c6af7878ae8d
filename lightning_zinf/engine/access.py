"""State access: the model's parameters and training state read and edited outside forward and
backward, whole or one unit at a time.

:meth:`StateAccess.gathered` gathers every unit with its exact values for a block (FSDP's
``summon_full_params``); :meth:`StateAccess.hold_exact` and :meth:`StateAccess.drop_exact` do the
same for one unit at a time (what the state-dict hooks and full checkpoints traverse; FSDP's full
state dict gathers one FlatParameter at a time the same way: Zhao et al., VLDB'23, §3.4); and
:meth:`StateAccess.state_resident` brings shards, masters, gradient shards and optimizer states
into memory from their tier for checkpoints and edits. Edits are written back into the shards and
fp32 masters on the way out.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Callable, Collection, Iterator, Optional

import torch

from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.engine.units import Unit, UnitStates
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload

__all__ = ["StateAccess"]


class StateAccess:
    """Exact reads and edits of an engine's parameters and training state (the engine's
    :meth:`~lightning_zinf.ZeroEngine.gathered`, :meth:`~lightning_zinf.ZeroEngine.hold_exact` and
    :meth:`~lightning_zinf.ZeroEngine.state_resident` delegate here).

    Args:
        units: The engine's units.
        states: The unit state machine that gathers and releases them.
        agreement: The rank agreement that checks every gather here with the other ranks.
        transfers: The engine's copy queue (host-tier shards are waited on before the host writes them).
        param_offload: The NVMe tier of the parameter shards, or ``None``.
        offload: The offloaded optimizer, or ``None``.
        optimizers: The engine's sharded optimizers (the list itself: it grows as they are sharded).
        settle: Finishes every collective and swap in flight (the engine's).
    """

    def __init__(self, units: list[Unit], *, states: UnitStates, agreement: RankAgreement, transfers: Transfers,
                 param_offload: Optional[ParamOffload], offload: Optional[OptimizerOffload],
                 optimizers: list[torch.optim.Optimizer], settle: Callable[[], None]) -> None:
        self.units = units
        self.states = states
        self.agreement = agreement
        self.transfers = transfers
        self.param_offload = param_offload
        self.offload = offload
        self.optimizers = optimizers
        self._settle = settle
        self._gathered_depth = 0  # nested gathered() blocks

    @property
    def groups(self) -> list[FlatGroup]:
        """All flat groups, unit by unit."""
        return [g for u in self.units for g in u.groups]

    @contextmanager
    def state_resident(self, write_back: bool, groups: Optional[list[FlatGroup]] = None) -> Iterator[None]:
        """The parameter shards, fp32 masters, gradient shards and optimizer states of ``groups``
        (default: all) in memory for the block (with NVMe offload they are in swap files
        otherwise); ``write_back``: they were modified (a load, an edit), so write them out
        afterwards, and drop their hpZ secondary partitions (which hold the old values). For
        checkpoints and edits: one group at a time keeps memory to one group's state."""
        self._wait_for_step()
        self._settle()
        self.transfers.host_wait_h2d()  # the host may write host-tier shards a gather still reads
        groups = self.groups if groups is None else groups
        for group in groups:
            group.settle_host_shard()  # a step's values still on their way from a device master
        with contextlib.ExitStack() as stack:
            for group in groups:
                stack.enter_context(group.shard_resident(write_back))  # frozen groups stored quantized
            if self.param_offload is not None:
                stack.enter_context(self.param_offload.resident([g for g in groups if g.codes is None], write_back))
            if self.offload is not None:
                stack.enter_context(self.offload.resident(self.optimizers, write_back, groups))
            try:
                yield
                if write_back and self.param_offload is not None:  # while the shards are in memory
                    self.param_offload.refresh_copies(groups)  # (a failed load keeps the files as they were)
            finally:
                if write_back:  # host copies and hpZ secondaries follow the shards, loaded in full or not
                    for group in groups:
                        group.shard_changed()
                        group.drop_secondary()

    def _wait_for_step(self) -> None:
        # An offloaded step still running in the background (overlap_step) rewrites shards, masters
        # and states: complete it before anything reads or writes them.
        if self.offload is not None:
            self.offload.wait_all()

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Gather every unit for the duration of the block (like FSDP's ``summon_full_params``),
        with the exact values in the parameters' own dtype (the fp32 masters under a bf16
        policy, not the bf16 copies forward computes with).

        Args:
            write_back: Copy edits made to the full parameters inside the block back into the shards
                on exit. Every rank must make the same edits.
        """
        self._wait_for_step()
        self._settle()
        outermost = self._stop_keeping()
        units = list(self.units)
        for unit in units:
            unit.forward_depth += 1
        self._gathered_depth += 1
        try:
            with self.agreement.checked():
                self.states.gather_exact(units, read=True)
            yield
            if write_back:
                with self.state_resident(write_back=True):
                    for group in self.groups:
                        group.write_back()
        finally:
            self._gathered_depth -= 1
            for unit in units:
                unit.forward_depth -= 1
                self.states.maybe_release(unit)
            if self._gathered_depth == 0:  # an enclosing block still wants the exact values
                self.states.gather_exact([u for u in units if u.persistent])  # back to the compute dtype
            if outermost:
                self.resume_keeping()

    def begin_unit_access(self) -> None:
        """Finish every collective and swap in flight before code reads or writes parameters unit
        by unit (:meth:`hold_exact`); call once per traversal, not per unit."""
        self._wait_for_step()
        self._settle()
        self._stop_keeping()

    def _stop_keeping(self) -> bool:
        """Before units are gathered for reading: release the units a ``keep_gathered`` block
        keeps (an evaluation loop's) and keep none until :meth:`resume_keeping` (a flag: the
        block's budget itself is left alone). A unit gathered for reading holds the exact values
        (under mixed precision in a buffer of the parameters' dtype, not the compute dtype's;
        edits that are not written back), which no later forward may compute with; the next
        forward gathers what it keeps again. Returns whether keeping was on and this call
        stopped it."""
        if self.states.keeping_suspended:
            return False
        self.states.release_kept()
        self.states.keeping_suspended = True
        return True

    def resume_keeping(self) -> None:
        """Keep units again, within whatever ``keep_gathered`` block is open then (the end of a
        read; the engine also calls it at every pass boundary: a traversal that raised, or one that
        reads the full state dict and has no end call, leaves no pass without keeping)."""
        self.states.keeping_suspended = False

    def hold_exact(self, unit: Unit) -> None:
        """Gather ``unit`` with its exact values in the parameters' own dtype (the fp32 masters'
        values under a bf16 policy, as :meth:`gathered`) and keep it gathered until
        :meth:`drop_exact`. Collective: every rank must hold the same units in the same order.
        The per-unit counterpart of :meth:`gathered` (FSDP's full state dict gathers one
        FlatParameter at a time the same way; Zhao et al., VLDB'23, §3.4).

        Raises:
            RuntimeError: the ranks are about to gather different units, or are in different calls
                (the agreement check every gather here makes); nothing stays held.
        """
        unit.forward_depth += 1
        try:
            with self.agreement.checked():
                self.states.gather_exact([unit], read=True)
        except BaseException:
            unit.forward_depth -= 1
            raise

    def drop_exact(self, unit: Unit, write_back: bool) -> None:
        """End a :meth:`hold_exact`: with ``write_back``, copy this rank's slice of the (edited or
        loaded) full values into its shards and fp32 masters first (only the elements that
        changed: unedited masters keep their fp32 bits); then release the unit unless something
        else holds it. A persistent unit stays gathered in the parameters' dtype until
        :meth:`end_unit_access`."""
        try:
            if write_back:
                with self.state_resident(write_back=True, groups=unit.groups):
                    for group in unit.groups:
                        group.write_back()
        finally:
            unit.forward_depth -= 1
            self.states.maybe_release(unit)

    def end_unit_access(self, units: Collection[Unit]) -> None:
        """After a traversal of :meth:`hold_exact` calls: the persistent ones among ``units`` go back
        to their compute-dtype gather (collective, as the holds were)."""
        if self._gathered_depth == 0:  # inside gathered(): its exit does it
            self.states.gather_exact([u for u in units if u.persistent])
            self.resume_keeping()
