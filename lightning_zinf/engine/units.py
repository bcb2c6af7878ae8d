"""The unit state machine: gather, wait, release, and the gradients' reduce-scatter queue.

A unit's parameters are in one of three states (ZeRO-3, Rajbhandari et al., SC'20, §5.3; FSDP2's
``FSDPParamGroup`` plays the same part, Zhao et al., VLDB'23, §3):

- ``released``: only this rank's shard of each flat group is resident (on its tier);
- ``in flight``: a gather was issued (swap-in from NVMe, hpZ secondary partition or qwZ codes
  included) and its buffers are allocated;
- ``gathered``: the full parameters are in place for compute (or, for reading, in their own dtype).

:class:`UnitStates` makes these transitions and decides nothing about *when*: the schedule
(:mod:`lightning_zinf.engine.schedule`) asks for a unit, prefetches the next ones and says when
forward or backward is done with one; the facade (:class:`~lightning_zinf.ZeroEngine`) asks for
exact gathers (state dicts, ``gathered()``). A unit is released only when nothing holds it: no
forward in progress, not held for backward, not prefetched and unused, not kept for the next decode
step. Gradients leave through :meth:`UnitStates.reduce`: one reduce-scatter in flight at a time,
accumulated into the rank's gradient shard when the next one starts or at the end of backward.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_zinf.comm import Collectives, Handle
from lightning_zinf.config import PrefetchConfig
from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.buffers import BufferPool
from lightning_zinf.engine.copies import DeviceCopies
from lightning_zinf.engine.exposure import GatherExposure
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.ranges import phase, phased
from lightning_zinf.engine.transfer import HeldUntilWait, Transfers
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload

__all__ = ["Unit", "UnitStates", "RELEASED", "INFLIGHT", "GATHERED", "COALESCE_BYTES", "in_backward"]

RELEASED, INFLIGHT, GATHERED = "released", "inflight", "gathered"

#: Groups whose gradient slices may wait in landing buffers for their host-side add at once.
_MAX_LANDING = 2

#: Most bytes of gather buffer per coalesced collective (:meth:`UnitStates.gather_exact`; at most two
#: such collectives are in flight at once), and
#: the largest group packed. Coalescing saves per-collective latency (a kernel launch and a
#: rendezvous each on NCCL, a round trip on gloo), which dominates small gathers; a gather of tens
#: of MiB is bandwidth-bound, and packing it would only add a copy of its bytes and a transient
#: buffer of its size. The persistent units (of at most ``persistence_threshold`` = 100k
#: elements each by default) fit in one collective unless there are hundreds of them.
COALESCE_BYTES = 32 << 20


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a checkpointed module is then
    being recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, held weakly (the agreement must not keep the unit states, and through them the
    model's shards, alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return bound(*args) if bound is not None else None

    return call


class Unit:
    """A unit at run time: its flat groups, its gather state and what holds it gathered.

    Attributes:
        index: Position in :attr:`ZeroEngine.units` (the id recorded in traces).
        name: The owning module's qualified name.
        module: The owning module (a block's, or the module whose own parameters these are).
        groups: One :class:`FlatGroup` per (dtype, requires_grad) among its parameters.
        numel: Parameter elements in the unit.
        persistent: Stays gathered for the whole run (small units and the root's own parameters).
        trainable_groups: How many of ``groups`` are trainable; ``has_frozen``: some parameter of
            the unit requires no gradient (:meth:`count_kinds`).
        state: ``"released"``, ``"inflight"`` or ``"gathered"``.
        forward_depth: Forward calls (and exact holds) in progress that use the unit.
        held: Held gathered for backward (from its first output gradient until it is reduced;
            under ``sharding="grad_op"`` from a forward that records a graph through it, until
            its backward is done with it or, when no backward has started, the next settle).
        reduced_groups: Trainable groups whose gradients are complete in this backward (each is
            then reduce-scattered).
        pending_backward: Forward uses whose input-side post-backward node has not run yet.
        kept: Stays gathered between forward passes (``keep_gathered``).
        reuse: The forward call in progress uses it again soon after, by the trace: kept gathered
            after the call, as if gathered ahead (:meth:`Schedule._acquire
            <lightning_zinf.engine.schedule.Schedule._acquire>`, :meth:`UnitStates.keep_ahead`).
        run: A run of sibling modules that each gather it (:mod:`~lightning_zinf.engine.grouping`):
            kept gathered from one member's forward to the next when the trace says so.
    """

    def __init__(self, index: int, name: str, groups: list[FlatGroup], persistent: bool,
                 module: Optional[nn.Module] = None, run: bool = False) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.run = run
        self.groups = groups
        self.numel = sum(g.numel for g in groups)
        self.persistent = persistent
        self.count_kinds()
        self.state = RELEASED
        self.handles: list[Handle] = []
        self.acquired: list[FlatGroup] = []  # groups whose NVMe shards this gather brought in
        self.acquired_read = False  # ... their exact shards (a gather for reading), not compute copies
        self.quantized = False  # the last gather was qwZ-quantized
        self.forward_depth = 0
        self.held = False
        self.reduced_groups = 0
        self.pending_backward = 0
        self.kept = False
        self.reuse = False

    def count_kinds(self) -> None:
        """Recount :attr:`trainable_groups` and :attr:`has_frozen` from the groups' flags (at
        construction, and at a pass boundary after ``requires_grad`` changed)."""
        self.trainable_groups = sum(g.trainable for g in self.groups)
        self.has_frozen = not all(w for g in self.groups for w in g.wants_grad)

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the unit's full parameter buffers now (0 when released)."""
        return sum(g.gathered_nbytes for g in self.groups)


class UnitStates:
    """Moves units between released, in flight and gathered, and gradients through reduce-scatter.

    Args:
        units: The engine's units, by index.
        comm: The engine's collectives (for hpZ and qwZ).
        ledger: Where gathered bytes are accounted (category ``"gathered"``; the device copies of
            host-tier shards, :class:`~lightning_zinf.engine.copies.DeviceCopies`, ``"staged"``).
        pool: Gradient and reduce buffers.
        agreement: Told of every gather and reduce-scatter before it is issued.
        prefetch: Its ``overlap_reduce`` (a reduce-scatter may stay in flight while backward
            goes on).
        param_offload: NVMe parameter offload, or None.
        offload: Optimizer offload, or None (gradient shards on the host).
        transfers: The device's copy streams (those the gathers of offloaded shards copy on).

    Attributes:
        peak_gathered_bytes: The most bytes of full (gathered or in-flight) parameter buffers at
            once over the run.
        gathered_ahead: Units gathered by prefetch over the run.
        keep_budget: Bytes of units that may stay gathered between forward passes (``0``: none).
        keeping_suspended: Units are being read (``StateAccess``): none is kept meanwhile, whatever
            the budget.
        before_release_kept: Called before kept units are released (the engine puts back the
            forward hooks a pass that kept every unit took out).
        kept_changed: Called with a unit that a ``keep_gathered`` budget has just kept, or no
            longer keeps (the schedule's trace then counts it as gathering nothing).
        copies: The device copies of host-tier shards: every gather goes through it, and the
            schedule copies shards ahead with it.
        exposure: The engine's :class:`~lightning_zinf.engine.exposure.GatherExposure` until it has
            measured (then ``None``): issuing and waiting for gathers ask it for the time.
    """

    def __init__(self, units: list[Unit], *, comm: Collectives, ledger: MemoryLedger, pool: BufferPool,
                 agreement: RankAgreement, prefetch: PrefetchConfig, param_offload: Optional[ParamOffload],
                 offload: Optional[OptimizerOffload], transfers: Transfers) -> None:
        self.units = units
        self.comm = comm
        self.ledger = ledger
        self.pool = pool
        self.agreement = agreement
        self.overlap_reduce = prefetch.overlap_reduce
        self.param_offload = param_offload
        self.offload = offload
        self.transfers = transfers
        self.peak_gathered_bytes = 0
        self.gathered_ahead = 0
        self.keep_budget = 0
        self.keeping_suspended = False  # units are being read: none is kept (StateAccess._stop_keeping)
        # Called before kept units are released (the schedule puts back the forward hooks a pass
        # that kept every unit took out).
        self.before_release_kept: Callable[[], None] = lambda: None
        self.kept_changed: Callable[[Unit], None] = lambda unit: None
        agreement.serve_with(_weakly(self.serve))
        self._groups = [g for u in units for g in u.groups]
        self._group_index = {id(g): i for i, g in enumerate(self._groups)}
        self._live: dict[int, Unit] = {}  # units gathered or in flight, by index
        self._ahead: dict[int, Unit] = {}  # prefetched and not asked for yet
        self.exposure: Optional[GatherExposure] = None  # set by the engine
        self._ahead_numel = 0  # their elements (read at every acquire: not a sum over them)
        # Reduce-scatters in flight, each with the bytes of its collectives' own buffers.
        self._pending: list[tuple[Handle, list[Tensor], list[bool], FlatGroup, int]] = []
        self._in_transit: list[FlatGroup] = []  # gradient slices on their way to host-side shards
        self.copies = DeviceCopies(ledger)

    # --- gather -----------------------------------------------------------------------------------
    # The ranges named zinf.* show the engine's phases in a profiler trace (as FSDP2's FSDP::*):
    # gather, release, reduce_scatter here; swap_in/swap_out (offload.swapped) and before_step/after_step
    # (the engine) elsewhere; the optimizer update itself is torch's Optimizer.step range.
    @phased("zinf.gather")
    def start_gather(self, unit: Unit, exact: bool = False, read: bool = False) -> None:
        """Issue the gather of a released (or re-gathered) ``unit`` for compute; with qwZ quantized
        unless ``exact`` (persistent units). ``read``: exactly, in the parameters' own dtype (for
        users reading and editing values).

        Raises:
            RuntimeError: the ranks are about to gather different units (:class:`RankAgreement`).
        """
        began = self.exposure.wait_begins() if self.exposure is not None else None
        before, exact = self._open(unit, exact or read, read)
        # Exact gathers come from the shards: a secondary partition may hold qwZ-quantized values.
        with self._copies_done_on_error():
            unit.handles = [self.copies.start_gather(g, unit.quantized, from_secondary=not exact, read=read)
                            for g in unit.groups]
        self._opened(unit, before)
        if began is not None:  # issuing takes the compute's time too (the host's, on the CPU)
            self.exposure.wait_ends(unit.name, began)

    @contextmanager
    def _copies_done_on_error(self) -> Iterator[None]:
        """If issuing gathers raises under NVMe parameter offload, wait for the copies issued so far."""
        try:
            yield
        except BaseException:
            if self.param_offload is not None:
                # The swapped-in shards go back to the staging pool at the next settle, and their
                # copies' handles are lost: the copies already issued (the failing group's may have
                # no handle yet) must be done before the pool reuses or unmaps their buffers.
                self.transfers.host_wait_h2d()
            raise

    def _open(self, unit: Unit, exact: bool, read: bool, agree: bool = True) -> tuple[int, bool]:
        """The start of a gather of ``unit``: agreed with the other ranks (unless ``agree`` is off:
        a gather served for another rank, agreed already), shards swapped in from NVMe, qwZ
        decided. A gather other ranks did not ask for too is exact (their partitions, a qwZ row or
        an hpZ secondary partition, may differ from this rank's). Returns the unit's gathered bytes
        before it (for :meth:`_opened`) and whether the gather is exact."""
        if self.offload is not None and self.offload.in_flight:
            # An optimizer step in the background: this unit's part done, before any collective
            # of the gather (a step that raised raises here, on every rank where it failed).
            self.offload.wait_stepped([self._group_index[id(g)] for g in unit.groups])
        if agree:
            exact = self.agreement.note_gather(unit) or exact
        if self.param_offload is not None:
            # A group gathered from its hpZ secondary partition or from the qwZ row a generation
            # phase keeps, or stored quantized, needs no shard from NVMe: this is where a shard is
            # swapped in.
            unit.acquired = [g for g in unit.groups
                             if (exact or (g.secondary is None and g.qwz_row is None)) and g.codes is None]
            unit.acquired_read = read
            for group in unit.acquired:
                self.param_offload.acquire(group, read)
        unit.quantized = self.comm.qwz_block is not None and not exact and not unit.persistent
        return unit.gathered_nbytes, exact

    def _opened(self, unit: Unit, before: int) -> None:
        """The end of issuing ``unit``'s gather (its handles set): in flight, and accounted."""
        unit.state = INFLIGHT
        self._live[unit.index] = unit
        self._account(unit.gathered_nbytes - before)

    def _account(self, nbytes: int) -> None:
        self.ledger.add("gathered", nbytes)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.ledger.now["gathered"])

    @phased("zinf.gather")
    def _start_exact_coalesced(self, units: list[Unit]) -> int:
        """Issue exact gathers for compute of ``units`` (persistent units after a step or a load).
        Their groups whose shards are plain device-resident tensors (:meth:`FlatGroup.exact_source`)
        go in one collective per compute dtype, packed in buckets of at most :data:`COALESCE_BYTES`
        of gather buffer, as DeepSpeed's ZeRO-3 re-gathers its persistent parameters together
        after each step (its stage 3 ``_post_step``): one collective's latency instead of one per
        group. The others (stored quantized, offloaded, larger than a bucket) each take their own,
        as :meth:`start_gather` issues it. Every rank packs the same groups in the same order:
        what decides it (tiers, storage format, sizes, dtypes) is the same on all ranks.

        Returns:
            The most bytes of transient packing buffers alive at once (two buckets'), accounted
            under ``"gathered"`` until the caller has waited for every unit and removes them.
        """
        buckets: dict[torch.dtype, list[tuple[int, list[Unit], list[Tensor], list[Tensor]]]] = {}
        opened: list[tuple[Unit, int]] = []
        try:
            for unit in units:
                opened.append((unit, self._open(unit, exact=True, read=False)[0]))
                unit.handles = []
                for group in unit.groups:
                    source = group.exact_source()
                    nbytes = group.padded_numel * group.compute_dtype.itemsize
                    if source is None or nbytes > COALESCE_BYTES:
                        with self._copies_done_on_error():
                            unit.handles.append(self.copies.start_gather(group, from_secondary=False))
                        continue
                    open_buckets = buckets.setdefault(group.compute_dtype, [])
                    if not open_buckets or open_buckets[-1][0] + nbytes > COALESCE_BYTES:
                        open_buckets.append((0, [], [], []))
                    filled, owners, outs, sources = open_buckets[-1]
                    open_buckets[-1] = (filled + nbytes, owners, outs, sources)
                    if unit not in owners:
                        owners.append(unit)
                    outs.append(group.open_gather())
                    sources.append(source)
            transient, issued, sizes = 0, [], []
            for dtype, open_buckets in buckets.items():
                for _, owners, outs, sources in open_buckets:
                    if len(issued) >= 2:
                        # At most two buckets' packing buffers at once (the wait orders the stream,
                        # it does not block the host under NCCL): the buckets bound each collective,
                        # this bounds their sum.
                        issued[-2].wait()
                    handle = self.comm.all_gather_coalesced(outs, sources, async_op=True)
                    issued.append(handle)
                    sizes.append(self.comm.coalesced_nbytes(sum(s.numel() for s in sources), dtype))
                    transient = max(transient, sum(sizes[-2:]))
                    for unit in owners:
                        unit.handles.append(handle)  # waited for once: the other units' waits return at once
        except BaseException:
            self._abandon(opened, [unit for unit in units if all(unit is not o for o, _ in opened)])
            raise
        # In flight only once every gather of theirs is issued: a unit marked so without its bucket's
        # handle would be taken, at its wait, for gathered with the previous step's values.
        for unit, before in opened:
            self._opened(unit, before)
        self._account(transient)
        return transient

    def _abandon(self, opened: list[tuple[Unit, int]], unopened: list[Unit]) -> None:
        """After an error while issuing coalesced gathers: every unit asked for is released, since
        its buffer may hold the previous step's values (or nothing), once the gathers already
        issued into it are done; each is gathered again from the shards when next needed."""
        for unit, before in opened:
            for handle in unit.handles:
                self.copies.waited(handle)
                handle.wait()
            if self.param_offload is not None:  # the swapped-in shards go back, once their copies are done
                self.transfers.host_wait_h2d()
                for group in unit.acquired:
                    self.param_offload.drop(group, unit.acquired_read)
                unit.acquired = []
            for group in unit.groups:
                group.release()
            self._account(-before)
            unit.handles, unit.state = [], RELEASED
            self._live.pop(unit.index, None)
        for unit in unopened:
            if unit.state == GATHERED:
                self._account(-unit.gathered_nbytes)
                for group in unit.groups:
                    group.release()
                unit.state = RELEASED
                self._live.pop(unit.index, None)

    # --- serving other ranks (lightning_zinf.engine.negotiation) ----------------------------------------
    def serve(self, code: int, exact: bool) -> None:
        """Take part in a collective another rank asked for and this rank did not (its code: a
        unit's index, or ``-1 - group index``), so that rank gets it with every rank's share: a
        gather (``exact``: from the shards, no qwZ or hpZ secondary partition) whose result is
        dropped, or a reduce-scatter to which this rank contributes zeros and whose slice it
        accumulates, as DDP's mean gives a rank that did not use the parameter. Agreed already: it
        is not agreed again, only recorded by the caller."""
        if code < 0:
            self._serve_reduce(self._groups[-1 - code])
        else:
            self._serve_gather(self.units[code], exact)

    def _serve_gather(self, unit: Unit, exact: bool) -> None:
        if unit.state == RELEASED:  # a gather as any other, released at once
            before, exact = self._open(unit, exact, read=False, agree=False)
            with self._copies_done_on_error():
                unit.handles = [self.copies.start_gather(g, unit.quantized, from_secondary=not exact) for g in unit.groups]
            self._opened(unit, before)
            self.wait_gather(unit)
            self.maybe_release(unit)
            return
        # In use here (a forward or backward in progress holds it): the same collectives into
        # scratch buffers, the unit's own buffers left as they are.
        quantized = self.comm.qwz_block is not None and not exact and not unit.persistent
        if self.offload is not None and self.offload.in_flight:
            self.offload.wait_stepped([self._group_index[id(g)] for g in unit.groups])
        acquired = []
        if self.param_offload is not None:
            acquired = [g for g in unit.groups if (exact or (g.secondary is None and g.qwz_row is None)) and g.codes is None]
            for group in acquired:
                self.param_offload.acquire(group, False)
        try:
            for group in unit.groups:
                handle, _ = group.gather_scratch(quantized, from_secondary=not exact)
                handle.wait()
        finally:
            if acquired:
                self.transfers.host_wait_h2d()
                for group in acquired:
                    self.param_offload.drop(group, False)

    def _serve_reduce(self, group: FlatGroup) -> None:
        self.drain_reduces()  # one reduce-scatter in flight at most, as in reduce()
        self._start_reduce(group, zeros=True)

    def wait_gather(self, unit: Unit) -> None:
        """Wait for ``unit``'s gather if it is in flight (it is then gathered); hand its swapped-in
        shards back to the staging pool."""
        if unit.state != INFLIGHT:
            return
        began = self.exposure.wait_begins() if self.exposure is not None else None
        for handle in unit.handles:
            self.copies.waited(handle)
            handle.wait()
        if began is not None:
            self.exposure.wait_ends(unit.name, began)
        for group in unit.groups:
            group.finish_gather()
            # Not from a gather for reading in another dtype: the secondary partition feeds compute.
            if self.comm.hpz is not None and not unit.persistent and group.secondary is None and group.holds_compute:
                group.keep_secondary()
        if self.param_offload is not None:
            # The shards' staging buffers go back to the pool: the copies reading them must be done
            # (waited for on the device only, so far). Issued a unit or more ago, they usually are.
            for handle in unit.handles:
                if isinstance(handle, HeldUntilWait):
                    handle.wait_on_host()
            for group in unit.acquired:
                self.param_offload.drop(group, unit.acquired_read)
            unit.acquired = []
        unit.handles, unit.state = [], GATHERED

    def gather_exact(self, units: list[Unit], read: bool = False) -> None:
        """Gather ``units`` exactly and wait, for compute (persistent units) or for reading
        (``read``): a released or gathered unit is (re-)gathered from the current shards, except
        one gathered for reading that is asked for reading again; one in flight is waited for, and
        gathered again if its gather was quantized (qwZ) or in the other dtype. Gathers for compute
        are coalesced (:meth:`_start_exact_coalesced`); gathers for reading go unit by unit."""
        todo = []
        for unit in units:
            fits = not unit.quantized and all(g.holds_exact if read else g.holds_compute for g in unit.groups)
            if unit.state == INFLIGHT:
                if fits:
                    continue
                self.wait_gather(unit)
            elif unit.state == GATHERED and read and fits:
                continue
            todo.append(unit)
        transient = 0
        if read:  # one by one: gathering the whole model at once would need twice its bytes
            for unit in todo:
                self.start_gather(unit, exact=True, read=True)
        elif todo:
            transient = self._start_exact_coalesced(todo)
        for unit in units:
            self.wait_gather(unit)
        self._account(-transient)

    def step_pending(self, unit: Unit) -> bool:
        """An offloaded optimizer step running in the background has yet to rewrite some of
        ``unit``'s shards (nothing may copy them ahead before)."""
        return self.offload is not None and self.offload.in_flight and any(self.offload.rewrites(g) for g in unit.groups)

    def prefetch(self, unit: Unit) -> None:
        """Start gathering a released ``unit`` ahead of its use; it stays gathered until
        :meth:`claim` or the next :meth:`settle`."""
        self.start_gather(unit)
        self._count_ahead(unit)
        self.gathered_ahead += 1

    def keep_ahead(self, unit: Unit) -> None:
        """Keep ``unit`` gathered after a forward use that the trace says it is used again soon
        after (:attr:`Unit.reuse`): it counts as gathered ahead (prefetch gathers that much less
        ahead) until :meth:`claim` or the next :meth:`settle`. A unit something else holds is left
        to that."""
        if unit.state != GATHERED or unit.persistent or unit.kept or unit.held:
            self.maybe_release(unit)
            return
        self._count_ahead(unit)

    def _count_ahead(self, unit: Unit) -> None:
        if unit.index not in self._ahead:
            self._ahead_numel += unit.numel
        self._ahead[unit.index] = unit

    def claim(self, unit: Unit) -> None:
        """``unit`` is being used: if it was prefetched, it no longer counts as ahead."""
        if self._ahead.pop(unit.index, None) is not None:
            self._ahead_numel -= unit.numel

    def is_ahead(self, unit: Unit) -> bool:
        """Whether ``unit`` was prefetched and not claimed yet."""
        return unit.index in self._ahead

    def any_ahead(self) -> bool:
        """Whether some unit was prefetched and not claimed yet."""
        return bool(self._ahead)

    def any_released(self) -> bool:
        """Whether some unit is released (neither gathered nor in flight): with none, there is
        nothing to gather ahead (a generation phase keeping the whole model)."""
        return len(self._live) < len(self.units)

    def ahead_numel(self) -> int:
        """Parameter elements of the units prefetched and not claimed yet."""
        return self._ahead_numel

    # --- release ----------------------------------------------------------------------------------
    def maybe_release(self, unit: Unit) -> None:
        """Release ``unit`` if nothing holds it: gathered, not persistent, no forward in progress,
        not held for backward, not prefetched; within a ``keep_gathered`` budget it is kept
        instead, while it fits."""
        if unit.kept:
            return
        if (
            unit.state == GATHERED
            and not unit.persistent
            and unit.forward_depth == 0
            and not unit.held
            and unit.index not in self._ahead
        ):
            if (self.keep_budget and not self.keeping_suspended
                    and self.kept_bytes() + unit.gathered_nbytes <= self.keep_budget):
                unit.kept = True  # for the next forward pass of this keep_gathered block
                self.kept_changed(unit)
                return
            with phase("zinf.release"):
                for group in unit.groups:
                    self.ledger.add("gathered", -group.gathered_nbytes)
                    group.release()
            unit.state = RELEASED
            self._live.pop(unit.index, None)

    def release_after_backward(self, unit: Unit) -> None:
        """Release a unit held for backward once autograd is done with it: every trainable group
        reduced (every node that used a trainable parameter has run) and, for a unit with frozen
        groups, the identity node of every forward use run. A frozen unit whose inputs need no
        gradient has no such node and stays held until the end of backward."""
        if unit.held and unit.pending_backward <= 0 and unit.reduced_groups >= unit.trainable_groups:
            unit.reduced_groups, unit.held = 0, False
            self.maybe_release(unit)

    def release_kept(self) -> None:
        """Finish what is in flight and release every unit kept (the end of a ``keep_gathered``
        block; a read of the weights inside one, after which the forward passes gather again)."""
        self.before_release_kept()
        self.settle()
        budget, self.keep_budget = self.keep_budget, 0  # released, not kept again at once
        try:
            for unit in self.units:
                if unit.kept:
                    unit.kept = False
                    self.kept_changed(unit)
                self.maybe_release(unit)
        finally:
            self.keep_budget = budget

    def kept_bytes(self) -> int:
        """Bytes of the units kept gathered between forward passes."""
        return sum(u.gathered_nbytes for u in self._live.values() if u.kept)

    def holds_storage_of(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is a view of a gathered (or in-flight) unit's parameter buffers."""
        return any(g.holds_storage_of(tensor) for u in self._live.values() for g in u.groups)

    def settle(self, boundary: bool = False) -> None:
        """Finish every collective in flight and release what no pass is using.

        At a pass boundary (``boundary``) no module is running, so use counts left over from a
        forward that raised (and was caught by user code) are cleared rather than keeping stale
        units gathered, and gradient buffers left by an abandoned backward are discarded.
        Outside a backward, units a ``grad_op`` forward holds for its backward are released too
        (their backward, if it comes, gathers them again, as under full sharding): settling
        precedes reads and edits of the weights, steps, the end of ``keep_gathered`` and
        ``release_all``, none of which may leave them gathered.
        """
        self.drain_reduces()
        self.finish_host_grads()
        self._ahead.clear()
        self._ahead_numel = 0
        self.copies.drop_ahead()
        # Between passes every unit's counters are reset; otherwise only units gathered or in flight
        # (``_live``) have anything to finish, so that a checkpoint's or a state dict's per-unit
        # calls cost O(1) each, not O(units).
        backward = in_backward()
        for unit in self.units if boundary else list(self._live.values()):
            # A unit read inside its own forward (gathered() regathers it exactly, for reading) is
            # released after that forward, not kept for its next use with the read's buffers.
            unit.reuse = False
            if boundary:
                unit.forward_depth, unit.held, unit.reduced_groups, unit.pending_backward = 0, False, 0, 0
                for group in unit.groups:
                    group.discard_grads(self.pool)
            elif unit.held and not backward:
                # A read for the user would replace the compute gather (bf16) of a unit that stays
                # held, and the next forward would compute with it.
                unit.held, unit.reduced_groups = False, 0
            self.wait_gather(unit)
            self.maybe_release(unit)
        if boundary and self.param_offload is not None:
            self.param_offload.settle_all()

    # --- gradients --------------------------------------------------------------------------------
    @phased("zinf.reduce_scatter")
    def reduce(self, group: FlatGroup) -> None:
        """Reduce-scatter ``group``'s flat gradient (mean over ranks, in the reduce dtype) towards
        this rank's gradient shard; finished by the next call, :meth:`drain_reduces` or at once
        without ``overlap_reduce``.

        Raises:
            RuntimeError: the ranks are about to reduce different groups (:class:`RankAgreement`).
        """
        self.agreement.note_reduce(self._group_index[id(group)])
        # One reduce-scatter in flight at most (FSDP2's order): the previous one is finished before
        # this one takes its buffers, so one unit's reduce buffers (a full-size cast to the reduce
        # dtype under mixed precision) are alive at a time.
        self.drain_reduces()
        self._start_reduce(group, zeros=False)

    def _start_reduce(self, group: FlatGroup, zeros: bool) -> None:
        handle, buffers, got = group.start_reduce_zeros(self.pool) if zeros else group.start_reduce(self.pool)
        # The collectives' own buffers (quantized codes), accounted until the wait.
        transient = self.comm.reduce_transient_nbytes(group.shard_numel, group.reduce_dtype)
        self.ledger.add("reduce_pending", transient)
        self._pending.append((handle, buffers, got, group, transient))
        if not self.overlap_reduce:
            self.drain_reduces()

    def drain_reduces(self) -> None:
        """Finish the reduce-scatters in flight and accumulate them into the gradient shards."""
        while self._pending:
            self._finish_reduce(self._pending.pop(0))

    def finish_host_grads(self) -> None:
        """Wait on the host for the gradient slices copied towards host-side gradient shards, and
        add those accumulating onto earlier micro-batches (the copy stream is in order: after the
        first wait the others have completed)."""
        for group in self._in_transit:
            group.finish_host_grads()
        self._in_transit = []

    def _finish_reduce(self, pending: tuple[Handle, list[Tensor], list[bool], FlatGroup, int]) -> None:
        handle, buffers, got, group, transient = pending
        try:
            handle.wait()
        finally:
            self.ledger.add("reduce_pending", -transient)
        index = self._group_index[id(group)]
        if self.offload is not None:
            self.offload.before_accumulate(index)
        # Landing buffers of earlier groups accumulating onto a previous micro-batch are added once
        # their copies have arrived, without blocking; the host waits only to keep at most
        # _MAX_LANDING groups' landing buffers alive.
        landing = [g for g in self._in_transit if g is not group and g.host_adds_pending]
        for i, earlier in enumerate(landing):
            if earlier.host_grads_arrived or len(landing) - i >= _MAX_LANDING:
                earlier.finish_host_grads()
        kept = group.accumulate(buffers[0], got)
        self._in_transit = [g for g in self._in_transit if g.grads_in_transit and g is not group]
        if group.grads_in_transit:
            self._in_transit.append(group)
        if group.swapped_optimizer:
            self.finish_host_grads()  # the shard is swapped out next: its bytes must be here
        if self.offload is not None:
            self.offload.after_accumulate(index)
        if kept:
            self.pool.forget(buffers[0])
        for buffer in buffers[1:] if kept else buffers:
            self.pool.give(buffer)
