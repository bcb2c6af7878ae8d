"""Optimizer offload: fp32 master shards, fp32 gradient shards and optimizer states on the ``cpu``
or ``nvme`` tier (ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1 "infinity offload engine"; ZeRO-Offload,
Ren et al. ATC'21, §4 for the CPU step).

``cpu``: the master and gradient shards are allocated in CPU memory; the user's optimizer steps them
there (its states are created next to them); the updated master is copied into the compute-dtype
shard on the device after the step.

``nvme``: the same tensors, but between uses their bytes live in swap files, one
:class:`~lightning_zinf.offload.swapped.SwapRecord` per group and kind (its fp32 master, its
gradient shard, and all the per-element states one optimizer keeps for it, back to back), and the
tensors themselves are empty; in memory they are views of a staging buffer. A gradient shard stays
in staging memory, unwritten, from backward to the step that consumes it (written only when staging
memory runs short or a checkpoint swaps it out: :meth:`SwapRecord.hold
<lightning_zinf.offload.swapped.SwapRecord.hold>`). The optimizer step runs one sub-group of
flat groups at a time: swap in its master, gradient and states, step them with the user's
optimizer restricted to their fragments, copy the master into the compute shard, swap the master
and states out (the gradient is consumed: dropped, not written). With ``overlap`` the next
sub-group is read while the current one steps and the previous one's writes complete in the
background (the swapper's threads release the GIL).
"""

from __future__ import annotations

import collections
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor

from lightning_zinf.config import OffloadConfig
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.optim import local_grad_sq_norm
from lightning_zinf.engine.transfer import is_accelerator
from lightning_zinf.offload.host import first_that_fit
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.stepping import StepPipeline
from lightning_zinf.offload.swapped import SwapRecord, SwapSpace, record_layout

__all__ = ["OptimizerOffload"]

log = logging.getLogger(__name__)


class OptimizerOffload:
    """Places (and, for ``nvme``, swaps) the optimizer side of every trainable flat group (a group
    unfrozen later is placed when it is: :meth:`place_masters` again).

    Args:
        groups: The engine's flat groups (frozen ones are ignored), in the engine's order; a group's
            index there names its swap files.
        config: The offload settings (``config.optimizer`` is ``"cpu"`` or ``"nvme"``).
        space: The rank's swapper and staging pool (``nvme`` only).
        params: The parameter offload, when shards are on NVMe too (the step rewrites them).

    Raises:
        ValueError: ``nvme`` without a swap space.
    """

    def __init__(
        self, groups: list[FlatGroup], config: OffloadConfig, space: Optional[SwapSpace] = None,
        params: Optional[ParamOffload] = None,
    ) -> None:
        if config.optimizer == "nvme" and space is None:
            raise ValueError("NVMe optimizer offload needs a swap space.")
        self.config = config
        self.nvme = config.optimizer == "nvme"
        self.space = space
        self.params = params
        self.groups = groups
        self._masters: dict[int, SwapRecord] = {}
        self._grads: dict[int, SwapRecord] = {}
        self._states: dict[int, list[SwapRecord]] = {}  # per group, one record per optimizer
        self._state_of: dict[tuple[int, int], tuple[SwapRecord, set[int]]] = {}  # (optimizer, group)
        self._generation = 0
        self._shared: set[int] = set()  # groups whose master is their parameter shard's record
        self._resident_blocks: set[int] = set()  # groups held in memory by a resident() block
        self._host: set[int] = set()  # groups whose records stay in host memory (plan_host)
        self._host_optimizer: Optional[torch.optim.Optimizer] = None  # whose states they keep there
        self._host_frozen: list[int] = []  # frozen groups plan_host chose, moved by place_masters
        self._optimizers: list[torch.optim.Optimizer] = []
        self.clip_coef: Optional[Tensor] = None
        self._pipeline: Optional[StepPipeline] = None  # the step in flight (overlap_step)
        self._index = {id(g): i for i, g in enumerate(groups)}
        self._driving = False  # inside the pipeline's own work (its swaps do not call relieve)
        self._warned_room = False
        if space is not None:
            space.relieve = self._relieve
        self._worker: Optional[ThreadPoolExecutor] = None

    @property
    def trainable(self) -> list[int]:
        """Indices of the groups with an offloaded optimizer side: trainable now, or given a master
        before (a group frozen again keeps its master and states, as torch keeps a frozen
        parameter's), but those stepped on the device (``OffloadConfig.device_bytes``)."""
        return [i for i, g in enumerate(self.groups)
                if (g.trainable or g.master is not None) and not g.optimizer_on_device]

    # --- placement --------------------------------------------------------------------------------
    def place_masters(self, shard_resident: Callable[[FlatGroup], ContextManager[None]],
                      indices: Optional[list[int]] = None) -> None:
        """Create every trainable group's fp32 master on the CPU (separate from the compute shard),
        and with ``nvme`` swap it out; a group stepped on the device (``device_bytes``) gets its
        master there, as without offload. Idempotent; call before the optimizer is sharded.

        Args:
            shard_resident: Keeps a group's parameter shard in memory for the block (it may be on
                NVMe); one group at a time, so that no more than one shard is in memory at once.
            indices: Only these groups (by index), trainable or not (default: the trainable ones).
        """
        self.wait_all()
        for i in self._host_frozen:  # (the choice is final now: masters follow)
            self.params.keep_in_host(self.groups[i])
        self._host_frozen = []
        cpu = torch.device("cpu")
        for i in self.trainable if indices is None else indices:
            group = self.groups[i]
            if group.master is not None:
                continue
            if group.optimizer_on_device:
                group.make_master()
                continue
            with shard_resident(group):
                self._place_master(i, group, cpu)
        self.settle_all()

    def plan_host(self, optimizer: torch.optim.Optimizer) -> None:
        """(``nvme``; the first optimizer sharded, before it is planned and its masters placed.)
        Choose the groups whose records stay in host memory (``OffloadConfig.host_bytes``;
        :func:`~lightning_zinf.offload.host.first_that_fit`): the groups with records on NVMe in
        order, a trainable one costing its master record (or, shared, the parameter shard's), its
        shard and compute copy when parameters are on NVMe too, and the per-element states
        ``optimizer`` keeps for it (:func:`_per_element_states`); a frozen one (a LoRA base) its
        shard and compute copy, which its gathers read at every forward and backward. They move
        when the masters are placed (:meth:`place_masters`); until then the choice is remade at
        each call. After it stays: later optimizers keep their states for those groups on NVMe,
        and groups unfrozen later are placed there too."""
        if not self.nvme or not self.config.host_bytes or any(g.master is not None for g in self.groups):
            return
        self._host_optimizer = optimizer
        states = _per_element_states(optimizer)
        index_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        trainable = set(self.trainable)
        indices, costs = [], []
        for i, group in enumerate(self.groups):
            cost = self.params.host_cost(group) if self.params is not None else 0
            if i in trainable:
                if not self._shares_master(group):
                    cost += record_layout(_fp32_regions("master", group))[1]
                if states is not None and (regions := _state_regions(group, states, index_of)):
                    cost += record_layout(regions)[1]
            elif not cost:
                continue  # frozen with nothing on NVMe (parameters elsewhere, frozen codes)
            indices.append(i)
            costs.append(cost)
        chosen = indices[: first_that_fit(costs, self.config.host_bytes)]
        self._host = {i for i in chosen if i in trainable}
        self._host_frozen = [i for i in chosen if i not in trainable]
        log.info("lightning_zinf: OffloadConfig.host_bytes=%d keeps %d of %d groups' NVMe-tier state (%d bytes) in "
                 "host memory.", self.config.host_bytes, len(chosen), len(costs), sum(costs[: len(chosen)]))

    def _keeps_states(self, optimizer: torch.optim.Optimizer, i: int) -> bool:
        """Whether ``optimizer``'s per-element states for group ``i`` stay in host memory
        (:meth:`plan_host` chose the group, with this optimizer's states counted)."""
        return i in self._host and optimizer is self._host_optimizer

    def _place_master(self, i: int, group: FlatGroup, cpu: torch.device) -> None:
        group.make_master(state_device=cpu, separate=True, swapped=self.nvme)
        if not self.nvme:
            return
        group.swapped_optimizer = True
        if i in self._host and self.params is not None:
            self.params.keep_in_host(group)  # in memory: inside shard_resident
        if self._shares_master(group):
            # An fp32 shard holds exactly the master's values: one record serves both, which
            # saves writing the shard after every step (ZeRO-Infinity keeps one fp32 copy too).
            record = self.params.record(group)  # in memory: inside shard_resident
            for tensor, offset in group.layout("master"):
                record.attach(tensor, "shard", offset)
            self._shared.add(i)
        else:
            record = self._record(f"g{i}.master", group, "master", in_host=i in self._host)
            record.swap_out()  # (kept in host memory: nothing to write)
            record.settle()  # written now: placing every master must not fill memory with writes
        self._masters[i] = record

    def _shares_master(self, group: FlatGroup) -> bool:
        return self.params is not None and group.dtype == torch.float32

    def planned_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """(``nvme``) Bytes of the swap files that attaching ``optimizer`` (not yet sharded: its
        param groups hold the model's parameters) adds: each trainable group's fp32 master (unless
        it shares the parameter shard's record) and gradient shard, placed once, and one record per
        group of the per-element states ``optimizer`` keeps (:func:`_per_element_states`), laid
        out as :meth:`_collect_states` lays them out; none of a group kept in host memory
        (:meth:`plan_host`) but its gradient shard's.
        """
        total = 0
        for i in self.trainable:
            group = self.groups[i]
            if group.master is None:  # placed by the first optimizer attached, with the gradient record
                if not (self._shares_master(group) or i in self._host):
                    total += record_layout(_fp32_regions("master", group))[1]
                total += record_layout(_fp32_regions("grad", group))[1]
        states = _per_element_states(optimizer)
        if states is None:
            return total
        index_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        for i in self.trainable:
            regions = _state_regions(self.groups[i], states, index_of)
            if regions and not self._keeps_states(optimizer, i):
                total += record_layout(regions)[1]
        return total

    # --- gradients during backward ----------------------------------------------------------------
    def before_accumulate(self, index: int) -> None:
        """Make group ``index``'s gradient shard resident for :meth:`FlatGroup.accumulate`: read it
        back when accumulating onto earlier micro-batches, only allocate it when starting over.
        Waits for the group's step in flight, if any (the step reads the gradient shard)."""
        self.wait_stepped([index])
        if not self.nvme:
            return
        group = self.groups[index]
        swapped = self._grads.get(index)
        if swapped is not None:
            swapped.swap_in(read=not group.fresh_accumulation)
            swapped.settle()

    def after_accumulate(self, index: int) -> None:
        """Hold group ``index``'s gradient shard in staging memory unwritten while staging has room
        (:meth:`SwapSpace.room_to_hold`): the step that consumes it reads it there, and it is never
        written unless staging memory is needed first (then it is written behind and read back for
        the step) or a checkpoint swaps it out. Without room it is written behind at once."""
        if not self.nvme:
            return
        if index not in self._grads:
            self._grads[index] = self._record(f"g{index}.grad", self.groups[index], "grad")
        record = self._grads[index]
        if self.space.room_to_hold(record):
            record.hold()
        else:
            record.swap_out()
        self.clip_coef = None  # new gradients since the last clipping
        # Free the gradient shards already on disk without waiting for the rest, so backward never
        # holds more than the shards whose writes are still in flight.
        self.space.reap()

    # --- clipping and the step --------------------------------------------------------------------
    def global_grad_sq_norm(self) -> Tensor:
        """This rank's share of the squared gradient norm (fp32, 0-d, CPU), from the per-fragment
        norms recorded at accumulation (``nvme``: the gradients themselves may be on disk),
        combined in the order and by the function
        (:func:`~lightning_zinf.engine.optim.local_grad_sq_norm`) that
        :func:`~lightning_zinf.engine.optim.clip_grad_norm_` uses for resident gradients, so
        clipping gives bit-identical results with and without offload."""
        self.wait_all()
        norms = [n for i in self.trainable for has, n in zip(self.groups[i].exposed, self.groups[i].grad_norms) if has]
        return local_grad_sq_norm(norms)

    def step(self, optimizer: torch.optim.Optimizer, order: Optional[list[list[int]]] = None) -> None:
        """Step ``optimizer`` sub-group by sub-group (``sub_group_size`` elements at most), and
        copy each sub-group's updated masters into the compute shards as soon as it is stepped: on
        an accelerator those copies run on the copy stream (ZeRO-Infinity §6.2). Stepped fragments
        lose their ``.grad`` (the gradient shard is consumed), so the optimizer's own (hooked)
        step that follows finds none and does nothing.

        With ``overlap_step`` (the default) this only starts the step: it runs in the background
        (:class:`~lightning_zinf.offload.stepping.StepPipeline`), in the order ``order`` gives,
        and :meth:`wait_stepped` (each gather), :meth:`wait_all` (state access, the next step)
        wait for what they need of it. Without, it completes before returning. A step still in
        flight from an earlier call is completed first.

        ``nvme``: each sub-group is swapped in for its step and out after it; its gradients reach
        the optimizer only then. Outside the step ``.grad`` stays ``None``: code between backward
        and step cannot read offloaded gradients (nor unscale them, hence no fp16 loss scaling with
        NVMe optimizer offload). ``cpu``: the gradients are exposed after backward as without
        offload (clipping and loss scaling read them there).

        The user's optimizer does the arithmetic: its step function runs on the fragments of one
        sub-group at a time, with the options its param groups have at this call, so its
        hyper-parameters, LR schedule and state layout are unchanged.

        Args:
            optimizer: The sharded optimizer.
            order: Group indices, unit by unit, in the order the next forward needs them (groups
                missing from it come last); ``None``: the engine's order. With ``overlap_step``
                a sub-group never spans two units, so a unit waits for its own groups only.

        Raises:
            BaseException: what the optimizer's step function raised (here without
                ``overlap_step``, else at the wait that needs the failed sub-group).
        """
        self.wait_all()
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}

        def has_grad(group: FlatGroup) -> list[bool]:
            return group.exposed if self.nvme else [f.grad is not None for f in group.fragments]

        todo = {
            i for i in self.trainable
            if any(id(f) in owned and has for f, has in zip(self.groups[i].fragments, has_grad(self.groups[i])))
        }
        units = _ordered_units(order or [], todo)
        split = self._subgroups(units, split_units=True)
        overlapped = self.config.overlap_step and self._room_to_overlap(split)
        subgroups = split if overlapped else self._subgroups(units, split_units=False)
        ahead = len(subgroups) if not self.nvme else int(self.config.overlap)
        if self._worker is None:
            self._worker = _worker(self.groups[0].device if self.groups else torch.device("cpu"))
        self._pipeline = StepPipeline(self, optimizer, subgroups, owned, self._worker, read_ahead=ahead,
                                      write_behind=2 if self.config.overlap else 0)
        self.pump()
        if not overlapped:
            self.wait_all()

    def read_ahead_step(self, order: list[list[int]]) -> None:
        """(``nvme`` with ``overlap_step``; a backward starts.) Start reading the masters and
        states of the sub-groups a step would step first (two, as the step itself reads ahead),
        so that their reads run behind the backward instead of in front of the next forward,
        which waits for those sub-groups first. Reads ahead of need: given up first under staging
        pressure; wasted if no step follows (gradient accumulation), and then kept for the step.
        The gradients are not read: backward is writing them, and what is still in memory then
        stays for the step (:meth:`keep_resident`). Sub-groups kept in host memory
        (:meth:`plan_host`) need no read: the two read are the first that do."""
        if not (self.nvme and self.config.overlap_step and self.config.overlap) or self._pipeline is not None:
            return
        subgroups = self._subgroups(_ordered_units(order, set(self.trainable)), split_units=True)
        if not subgroups or not self._room_to_overlap(subgroups):
            return
        on_disk = [members for members in subgroups if not all(i in self._host for i in members)]
        for members in on_disk[:2]:
            for i in members:
                for record in (self._masters.get(i), *self._states.get(i, [])):
                    if record is not None:
                        record.swap_in(ahead=True)

    def _room_to_overlap(self, subgroups: list[list[int]]) -> bool:
        """(``nvme``) Whether the staging cap leaves room for a step beside the forward: four of
        its largest sub-groups (one being read, one stepped, two being written; the forward's
        shards read ahead beside them), each counted at 16 bytes per element (an fp32 master,
        gradient and two moments) or its records' size if larger. Below that the step is
        synchronous, as it must be to fit at all under a cap sized for it alone."""
        if not self.nvme or self.space.pool.cap is None:
            return True
        largest = max((max(16 * sum(self.groups[i].shard_numel for i in members),
                           sum(r.nbytes for i in members for r in self._records(i) if not r.in_host))
                       for members in subgroups), default=0)
        if 4 * largest > self.space.pool.cap:
            if not self._warned_room:
                log.info("lightning_zinf: NVMe staging_bytes=%d holds fewer than four optimizer sub-groups of %d bytes: "
                         "the offloaded step runs synchronously (raise staging_bytes to overlap it).", self.space.pool.cap, largest)
                self._warned_room = True
            return False
        return True

    # --- the step in flight -----------------------------------------------------------------------
    def pump(self) -> None:
        """Advance the step in flight without blocking (the engine calls this at each gather)."""
        if self._pipeline is not None:
            self._run(self._pipeline.pump)

    @property
    def in_flight(self) -> bool:
        """An offloaded step runs in the background now (``overlap_step``)."""
        return self._pipeline is not None

    def rewrites(self, group: FlatGroup) -> bool:
        """Whether the step in flight has yet to rewrite ``group``'s shard."""
        pipeline = self._pipeline
        return pipeline is not None and pipeline.pending(self._index.get(id(group), -1))

    def wait_stepped(self, indices: list[int]) -> None:
        """Block until the groups ``indices`` (and those stepped before them) are stepped and sent
        out, if a step is in flight. Raises what the step raised."""
        pipeline = self._pipeline
        if pipeline is None:
            return
        self._run(pipeline.pump)
        for i in indices:
            if self._pipeline is not None and pipeline.pending(i):
                self._run(lambda: pipeline.wait(i))

    def wait_all(self) -> None:
        """Block until the step in flight, if any, is complete. Raises what it raised."""
        if self._pipeline is not None:
            self._run(self._pipeline.wait_all)

    def _run(self, advance: Callable[[], None]) -> None:
        self._driving = True
        try:
            advance()
        except BaseException:
            if self._pipeline is not None:
                self._pipeline.abort()  # nothing left running or claimed
            self._pipeline = None  # the step ended with its error: raised once, here
            raise
        finally:
            self._driving = False
        if self._pipeline is not None and self._pipeline.finished:
            self._pipeline = None

    def _relieve(self) -> bool:
        """(The staging pool is at its cap for a swap of the training loop.) Complete the step in
        flight and its writes, so that its records leave memory; True if there was one."""
        if self._pipeline is None or self._driving:
            return False
        self.wait_all()
        for i in self.trainable:
            self._settle_group(i)
        return True

    def claim(self, members: list[int], ahead: bool) -> None:
        """(``nvme``) Start reading sub-group ``members``' records for the step; kept in memory
        until :meth:`send_out` (not given back by the parameter offload's settling)."""
        for i in members:
            for record in self._records(i):
                record.claimed = True
            for record in self._records(i):
                record.swap_in(ahead=ahead)

    def keep_resident(self, members: list[int]) -> None:
        """(``nvme``) Keep those of ``members``' records that are still in memory (a gradient shard
        whose write behind is in flight) there for the step, instead of reading them back later."""
        for i in members:
            for record in self._records(i):
                if record.resident:
                    record.claimed = True
                    record.keep_ahead()

    def reads_complete(self, members: list[int]) -> bool:
        """(``nvme``) Whether ``members``' records are all in memory with their reads completed (no
        wait). A read ahead skipped or given up under staging pressure leaves a record out: the
        sub-group is then not handed to the worker before the ones ahead of it are done, so two
        sub-groups' records are never forced into memory at once."""
        return all(record.resident and record.read_complete for i in members for record in self._records(i))

    def make_resident(self, members: list[int]) -> None:
        """(``nvme``) ``members``' records in memory now: read again if a read ahead was given up
        under staging pressure, and every read completed."""
        self._bring_in(members)
        for i in members:
            self._settle_group(i)

    def settle(self, members: list[int]) -> None:
        """Complete the transfers of ``members``' records (their writes behind)."""
        for i in members:
            self._settle_group(i)

    def release_unstepped(self, members: list[int]) -> None:
        """(After a failed step) give ``members``' records back unwritten: their files still hold
        the state before the step. A gradient shard held in memory is written (another optimizer
        sharing the group, or an accumulation going on without ``zero_grad``, still reads it)."""
        for i in members:
            for record in self._records(i):
                record.settle()
                record.swap_out(write=False)
                record.claimed = False

    def wrap_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """(``nvme``) Make ``optimizer.zero_grad`` discard the gradients accumulated for its
        fragments. They are on disk and not attached as ``.grad`` outside the step, so there is
        nothing to zero in memory: the next backward simply starts a fresh accumulation (as after
        ``set_to_none=True``; a parameter left without gradient is then not stepped)."""
        original = optimizer.zero_grad
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        indices = [i for i in self.trainable if any(id(f) in owned for f in self.groups[i].fragments)]

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none=True)
            for i in indices:
                self.groups[i].discard_accumulated()
                record = self._grads.get(i)
                if record is not None and not record.claimed:  # (claimed: a step in flight reads it)
                    record.drop()  # held in memory, the bytes are dead: not worth a write

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]

    def _subgroups(self, units: list[list[int]], split_units: bool) -> list[list[int]]:
        """Consecutive groups packed into sub-groups of at most ``sub_group_size`` elements (a
        larger group alone); with ``split_units``, never two units' groups in one."""
        out: list[list[int]] = []
        size = 0
        for unit in units:
            for k, i in enumerate(unit):
                n = self.groups[i].shard_numel
                if out and size + n <= self.config.sub_group_size and (k > 0 or not split_units):
                    out[-1].append(i)
                    size += n
                else:
                    out.append([i])
                    size = n
        return out

    def _record(self, key: str, group: FlatGroup, which: str, in_host: bool = False) -> SwapRecord:
        """A record holding ``group``'s master or gradient shard, its fragments bound into it."""
        record = SwapRecord(self.space, key, _fp32_regions(which, group), in_host=in_host)
        for tensor, offset in group.layout(which):
            record.bind(tensor, which, offset)
        record.adopt()
        return record

    def _records(self, i: int) -> list[SwapRecord]:
        return [r for r in (self._masters.get(i), self._grads.get(i), *self._states.get(i, [])) if r is not None]

    def _bring_in(self, members: list[int], ahead: bool = False) -> None:
        for i in members:
            for record in self._records(i):
                record.swap_in(ahead=ahead)

    def _settle_group(self, i: int) -> None:
        for record in self._records(i):
            record.settle()

    def send_out(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        """After group ``i``'s step: its new values where the next forward reads them (the compute
        shard on the device, a host or NVMe compute copy, its shard's record), and with ``nvme``
        its master and states written out (behind) and its consumed gradient dropped."""
        group = self.groups[i]
        if i not in self._shared:  # a shared record: the stepped master is the shard already
            if self.params is not None:
                self.params.will_overwrite(group)
            # The compute-dtype shard the next forward gathers (on the device: through the copy
            # stream, overlapping the next sub-group's step; compute waits for it on the device).
            if group.master is not group.shard:  # stepped in place beside a host copy
                group.transfers.wait_on_device(group.transfers.copy_to_device(group.shard, group.master))
            group.shard_changed()
        if self.params is not None:
            self.params.changed(group)
        if not self.nvme:
            return
        self._collect_states(optimizer, i)  # states the optimizer created in this step, if any
        self._masters[i].swap_out()
        for state in self._states.get(i, []):
            state.swap_out()
        if i in self._grads:
            if any(group.exposed):  # fragments another optimizer steps still need their gradients
                self._grads[i].swap_out()
            else:  # consumed: never written if it stayed in memory
                self._grads[i].drop()
        for record in self._records(i):
            record.claimed = False

    def settle_all(self) -> None:
        """Complete the step in flight and every transfer in flight (before a checkpoint, at the
        end of training)."""
        self.wait_all()
        for i in self.trainable:
            self._settle_group(i)

    # --- whole state, for checkpoints -------------------------------------------------------------
    @contextmanager
    def resident(
        self, optimizers: list[torch.optim.Optimizer], write_back: bool, groups: Optional[list[FlatGroup]] = None
    ) -> Iterator[None]:
        """Every master, gradient and state tensor of ``groups`` (default: all) in memory for the block (checkpoint save/load);
        afterwards swapped out again, and rewritten only if ``write_back`` (they were loaded into;
        the optimizers' state tensors may then be new objects, which are picked up).
        """
        self.wait_all()
        if not self.nvme:
            yield
            return
        chosen = {id(g) for g in groups} if groups is not None else None
        # Groups an enclosing block holds stay as that block leaves them (it writes them or not).
        indices = [i for i in self.trainable if (chosen is None or id(self.groups[i]) in chosen)
                   and i not in self._resident_blocks]
        self._resident_blocks.update(indices)
        try:
            with self.space.uncapped():
                for i in indices:
                    self._bring_in([i])
                for i in indices:
                    self._settle_group(i)
                try:
                    yield
                except BaseException:
                    write_back = False  # a failed load: the files keep the state from before
                    raise
                finally:
                    if write_back:  # a load may have replaced the optimizers' state tensors
                        for optimizer in optimizers:
                            for i in indices:
                                self._collect_states(optimizer, i)
                    for i in indices:
                        for record in self._records(i):
                            record.swap_out(write=write_back)
                    for i in indices:
                        self._settle_group(i)
        finally:  # (a failed swap too: a later block must bring these groups in itself)
            self._resident_blocks.difference_update(indices)

    def _collect_states(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        """Keep the per-element state ``optimizer`` holds for group ``i``'s fragments (tensors of the
        fragment's shape; scalars such as Adam's step count stay in memory) in one record, laid out
        like the master: state ``name`` of the fragment at shard offset ``lo`` is at ``lo`` of
        region ``name``. Rebuilt when the optimizer holds other tensors than the record's (its first
        step created them, or a checkpoint load replaced them); they must be in memory then."""
        group = self.groups[i]
        o = next((k for k, opt in enumerate(self._optimizers) if opt is optimizer), None)
        if o is None:
            o = len(self._optimizers)
            self._optimizers.append(optimizer)
        found: list[tuple[dict, str, int]] = []
        for fragment, (lo, _) in zip(group.fragments, group.owned_ranges()):
            state = optimizer.state.get(fragment, {})
            for name, value in list(state.items()):
                if not isinstance(value, Tensor) or value.shape != fragment.shape:
                    continue
                if fragment.numel() > 0:
                    found.append((state, name, lo))
                elif value._base is not None:  # an empty view of a loaded flat state keeps it alive
                    state[name] = value.new_empty(value.shape)
        ids = {id(state[name]) for state, name, _ in found}
        old = self._state_of.get((o, i))
        if old is not None and not found:  # a load left no state here: retire the record
            self._states[i].remove(old[0])
            old[0].discard()
            del self._state_of[(o, i)]
            return
        if not found or (old is not None and old[1] == ids):
            return
        regions: dict[str, torch.dtype] = {}
        for state, name, _ in found:
            regions.setdefault(f"{name}.{state[name].dtype}", state[name].dtype)
        self._generation += 1
        record = SwapRecord(self.space, f"g{i}.o{o}.state{self._generation}",
                            [(region, dtype, group.shard_numel) for region, dtype in regions.items()],
                            in_host=self._keeps_states(optimizer, i))
        for state, name, lo in found:
            value = state[name]
            if value._base is not None or value.device.type != "cpu":
                # A view (a loaded checkpoint's) would keep its base alive: own a copy.
                value = state[name] = value.to("cpu", copy=True)
            record.bind(value, f"{name}.{value.dtype}", lo)
        record.adopt()
        states = self._states.setdefault(i, [])
        if old is not None:
            states.remove(old[0])
            old[0].discard()
        states.append(record)
        self._state_of[(o, i)] = (record, {id(state[name]) for state, name, _ in found})

    # --- accounting -------------------------------------------------------------------------------
    def file_bytes(self) -> int:
        """(``nvme``) Bytes of the records that have swap files (written or not yet): all but
        those kept in host memory and the masters counted by the parameter offload."""
        return sum(record.nbytes for i in self.trainable for record in self._records(i)
                   if not record.in_host and not (record is self._masters.get(i) and i in self._shared))

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of offloaded state in staging memory now and in swap files (``cpu``, ``nvme``)."""
        cpu = nvme = 0
        for i in self.trainable:
            for record in self._records(i):
                if record is self._masters.get(i) and i in self._shared:
                    continue  # counted by the parameter offload
                if record.resident:
                    cpu += record.nbytes
                else:
                    nvme += record.nbytes
        return {"cpu": cpu, "nvme": nvme}


def _ordered_units(order: list[list[int]], chosen: set[int]) -> list[list[int]]:
    """The groups of ``chosen`` unit by unit in ``order`` (group indices per unit), those ``order``
    leaves out after them one by one in index order; no empty unit."""
    units = [[i for i in unit if i in chosen] for unit in order]
    listed = {i for unit in units for i in unit}
    return [unit for unit in units + [[i] for i in sorted(chosen - listed)] if unit]


def _worker(device: torch.device) -> ThreadPoolExecutor:
    """The thread that runs the offloaded step's arithmetic. Its current accelerator device is the
    engine's: a new thread starts on device 0, and an optimizer's step may touch the current
    stream (torch's graph-capture check), which would create a context on another rank's device."""
    if is_accelerator(device) and device.index is not None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-step",
                                  initializer=torch.accelerator.set_device_index, initargs=(device.index,))
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-step")


def _fp32_regions(which: str, group: FlatGroup) -> list[tuple[str, torch.dtype, int]]:
    """The one region of ``group``'s master or gradient record."""
    return [(which, torch.float32, group.shard_numel)]


def _state_regions(group: FlatGroup, states: list[list[tuple[str, torch.dtype]]],
                   index_of: dict[int, int]) -> list[tuple[str, torch.dtype, int]]:
    """The regions of ``group``'s state record (as :meth:`OptimizerOffload._collect_states` lays
    it out) for an optimizer keeping ``states`` per param group (:func:`_per_element_states`),
    whose param groups hold the parameters ``index_of`` maps (by id) to their param group."""
    regions: dict[str, torch.dtype] = {}
    for p, (lo, hi) in zip(group.params, group.owned_ranges()):
        if id(p) in index_of and hi > lo:  # an empty fragment keeps no state in the record
            for name, dtype in states[index_of[id(p)]]:
                regions.setdefault(f"{name}.{dtype}", dtype)
    return [(key, dtype, group.shard_numel) for key, dtype in regions.items()]


def _per_element_states(optimizer: torch.optim.Optimizer) -> Optional[list[list[tuple[str, torch.dtype]]]]:
    """Per param group of ``optimizer``, the ``(name, dtype)`` of each state tensor its step keeps
    per element (what :meth:`OptimizerOffload._collect_states` swaps: Adam's ``exp_avg`` and
    ``exp_avg_sq``, SGD's ``momentum_buffer``...), found without touching ``optimizer``: a shallow
    copy of it with its own empty state and the same param group options steps (its own step
    function, no hooks) a 16-element fp32 parameter per group with zero gradients, the kind of
    fragment the engine gives it. ``None``, with a log line, when that step fails: the optimizer's
    states then go uncounted by the preflight.
    """
    probes = [torch.zeros(16, requires_grad=True) for _ in optimizer.param_groups]
    twin = copy.copy(optimizer)  # the same class and attributes; its own state and param groups below
    twin.state = collections.defaultdict(dict)
    twin.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p]}
                         for g, p in zip(optimizer.param_groups, probes)]
    try:
        for p in probes:
            p.grad = torch.zeros_like(p)
        getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)(twin)  # without its hooks
    except Exception as err:  # any step of a user's optimizer class
        log.warning("NVMe preflight: could not step a copy of %s to see which states it keeps (%r); its "
                    "optimizer states are not counted in the free-space check.", type(optimizer).__name__, err)
        return None
    return [[(name, value.dtype) for name, value in twin.state.get(p, {}).items()
             if isinstance(value, Tensor) and value.shape == p.shape] for p in probes]
