"""Flat buffers: one unit's parameters of one dtype laid end to end, and this rank's shard of them.

Layout (ZeRO stage 3, Rajbhandari et al. SC'20 §5; ZeRO-Infinity §5.1.1 bandwidth-centric
partitioning): the ``numel`` elements of the group's parameters are concatenated in order and padded
with zeros to ``W * shard_numel`` elements, ``shard_numel = ceil(numel / W)`` rounded up to a
multiple of :data:`SHARD_ALIGN`. Rank ``r`` owns
elements ``[r * shard_numel, (r + 1) * shard_numel)``. Every parameter is split across all ranks, so
a gather uses every rank's link at once.

A gather all-gathers the shards into ``full`` and points each parameter's ``.data`` at its slice of
``full``. A release sets ``.data`` to an empty tensor and shrinks ``full``'s storage to zero bytes;
tensors autograd saved during forward (``weight.t()`` and the like) are views of that storage, so
they hold no memory while released and see the re-gathered values in backward.

Precision (:class:`~lightning_zinf.MixedPrecisionConfig`): shards stay in the parameters' own dtype
(``dtype``); gathers for compute cast the shard to ``compute_dtype`` before the all-gather and fill
``full`` in that dtype, so a bf16 policy moves and holds half of fp32's bytes. Gathers for reading
(:meth:`~lightning_zinf.ZeroEngine.gathered`) fill a second buffer in ``dtype`` instead, so users
see and edit the exact values.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zinf.comm import Collectives, Handle
from lightning_zinf.engine.buffers import BufferPool, GatherPool
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.transfer import CopiedAhead, Transfers
from triton_kernels import dequantize, quantize

__all__ = ["FlatGroup", "SHARD_ALIGN", "keeps_compute_copy", "shard_numel"]

#: Shards are whole runs of this many elements, so every shard starts 32-byte aligned (bf16) in
#: the gather buffer and the quantization kernels see 16-divisible sizes: on a GPU both the
#: collectives and the kernels then move 16-byte vectors (``tests/test_kernel_compile.py`` shows
#: the kernels fall back to 2-byte accesses and up to 3x the registers otherwise). Costs at most
#: ``W * 15`` elements per group.
SHARD_ALIGN = 16


def shard_numel(numel: int, world: int) -> int:
    """Elements of each rank's shard of a flat buffer of ``numel`` elements over ``world`` ranks:
    ``ceil(numel / world)`` rounded up to a multiple of :data:`SHARD_ALIGN`."""
    return -(-numel // (world * SHARD_ALIGN)) * SHARD_ALIGN


def keeps_compute_copy(dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether an offloaded shard of ``dtype`` gathered in ``compute_dtype`` gets a compute copy
    (:attr:`FlatGroup.compute_shard`): a floating-point ``compute_dtype`` narrower than ``dtype``."""
    return compute_dtype.is_floating_point and compute_dtype.itemsize < dtype.itemsize


class FlatGroup:
    """One unit's parameters of one dtype and one ``requires_grad`` value (when built), sharded over ranks.

    Args:
        names: Qualified parameter names (for messages and checkpoints), same order as ``params``.
        params: The parameters; all of one dtype and ``requires_grad``; real (not meta) tensors.
        source: Their values, flattened and concatenated (``numel`` elements, any device), or
            ``None`` to read them from ``params``.
        comm: The data-parallel collectives.
        device: The compute device: where the gather buffer lives, and by default everything else.
        shard_device: Where the parameter shard lives (the CPU under parameter offload).
        storage_dtype: Dtype of the shard, and of the parameters in gathers for reading (default:
            the parameters' dtype; :attr:`MixedPrecisionConfig.frozen_dtype` for frozen groups).
        compute_dtype: Dtype of gathers for compute and of the gradients autograd produces
            (default: the parameters' dtype).
        reduce_dtype: Dtype of the gradient reduce-scatter (default: fp32).
        ledger: Where the bytes of the buffers this group allocates are accounted (optional).
        transfers: The device's copy streams (default: their own). Host-side shards and
            gradient shards are page-locked when it overlaps copies.
        pin_shard: Page-lock a host-side shard (``False`` when it moves into NVMe staging memory at once).
        host_copy: Keep :attr:`compute_shard` in host memory, page-locked when copies overlap, where
            :func:`keeps_compute_copy` says so (the ``cpu`` parameter tier): gathers then copy 16-bit
            bytes to the device, and the fp32 shard can be the optimizer's master.
        device_copy: The optimizer is offloaded (to host memory or NVMe) and the parameters are not
            (ZeRO-Offload, Ren et al. ATC'21 §4.1: 16-bit parameters on the device, fp32 masters on
            the host): a trainable group where :func:`keeps_compute_copy` says so keeps its shard in
            host memory, where it is the optimizer's fp32 master (stepped in place; with NVMe the
            master is a swapped copy, sent into the shard after each step), and only
            :attr:`compute_shard` on the device, which gathers for compute read; a step sends the
            16-bit values to the device. Exact reads (gathers for reading, state dicts,
            checkpoints) read the host shard.
        gathers: Where the gather buffers' memory comes from and goes (default: a pool of its own;
            the engine shares one among its groups, which on the CPU reuses released memory).

    Attributes:
        trainable: Some parameter of the group requires a gradient (as of the last pass boundary:
            :class:`~lightning_zinf.engine.freezing.Freezing` follows ``requires_grad`` changes);
            when built, all of them or none do.
        wants_grad: Per parameter, whether it requires a gradient (as of the last pass boundary):
            backward waits for those gradients only, and hands the others none.
        shard: This rank's ``shard_numel`` elements of the flat buffer, in the storage dtype.
        compute_shard: The same elements in ``compute_dtype``, where an offload tier keeps such a
            copy (a narrower ``compute_dtype``: ``host_copy``, or the NVMe parameter offload's
            record): gathers for compute read it instead of ``shard``; ``None`` otherwise.
        full: The gather buffer for compute: ``W * shard_numel`` elements of ``compute_dtype``;
            zero bytes of storage when released (or gathered for reading).
        master: The fp32 master shard stepped by the optimizer (``shard`` itself when the dtype is
            fp32), or ``None`` for frozen groups and before :meth:`make_master`.
        fragments: Per parameter, the 1-D view of ``master`` that this rank owns (possibly empty).
        grad_shard: fp32 gradient shard accumulated over micro-batches, or ``None`` before the first.
        state_device: Where ``master`` and ``grad_shard`` live: ``device``, or the CPU when the
            optimizer is offloaded (:meth:`make_master` with ``separate=True``).
        host_state: The optimizer is offloaded to host memory: reduced gradient slices travel to
            ``grad_shard`` through the copy stream (:meth:`finish_host_grads` completes them).
        optimizer_on_device: Under ``cpu`` optimizer offload with ``OffloadConfig.device_bytes``,
            this group was placed as without offload and is stepped on the device by the
            optimizer itself (set by :class:`~lightning_zinf.engine.build.UnitBuilder`).
        swapped_optimizer: Set by the NVMe optimizer offload, which then swaps ``master`` and
            ``grad_shard`` and does the post-step copy into ``shard`` itself. Gradients are handed to
            the optimizer only inside its step (``exposed`` says which fragments have one meanwhile),
            and the norms below are recorded.
        grad_norms: With ``swapped_optimizer``, per fragment the L2 norm of its gradient after the
            last :meth:`accumulate` (fp32, 0-d each), so clipping needs no pass over gradients that
            were swapped out.
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        source: Optional[Tensor],
        comm: Collectives,
        device: torch.device,
        shard_device: Optional[torch.device] = None,
        storage_dtype: Optional[torch.dtype] = None,
        compute_dtype: Optional[torch.dtype] = None,
        reduce_dtype: torch.dtype = torch.float32,
        ledger: Optional[MemoryLedger] = None,
        transfers: Optional[Transfers] = None,
        pin_shard: bool = True,
        host_copy: bool = False,
        device_copy: bool = False,
        gathers: Optional[GatherPool] = None,
    ) -> None:
        self.names = names
        self.params = params
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0, *itertools.accumulate(self.numels)][: len(params)]
        self._strides = [torch.empty(shape, device="meta").stride() for shape in self.shapes]  # contiguous
        self.numel = sum(self.numels)
        self.dtype = storage_dtype or params[0].dtype
        self.compute_dtype = compute_dtype or self.dtype
        self.reduce_dtype = reduce_dtype
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.trainable = params[0].requires_grad
        self.wants_grad = [self.trainable] * len(params)
        self.comm = comm
        self.device = device
        self.transfers = transfers or Transfers(device)
        self.gathers = gathers or GatherPool(device, self.ledger)
        world = comm.shard_size  # the shard group's ranks (every rank, unless hybrid)
        self.shard_numel = shard_numel(self.numel, world)
        self.padded_numel = self.shard_numel * world
        self.shard_start = comm.shard_rank * self.shard_numel
        self._ranges = self._compute_owned_ranges()

        if source is None:
            source = torch.cat([p.detach().reshape(-1) for p in params])
        start, stop = self.shard_start, min(self.shard_start + self.shard_numel, self.numel)
        shard_device = shard_device or device
        self._host_copy = host_copy and keeps_compute_copy(self.dtype, self.compute_dtype)
        self._pin_shard = pin_shard
        self._device_copy = device_copy and self.trainable and keeps_compute_copy(self.dtype, self.compute_dtype)
        if self._device_copy:
            shard_device = torch.device("cpu")  # the master's tier; copies to the device are staged
        # Page-locked only what the copies to the device read: the host copy, where there is one.
        if shard_device != device and pin_shard and not (self._host_copy or self._device_copy):
            self.shard = self.transfers.host_zeros(self.shard_numel, self.dtype)
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=shard_device)
        if stop > start:
            self.shard[: stop - start].copy_(source[start:stop])
        self.full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        # Gathers for reading (exact values in the parameters' dtype): ``full`` itself when the dtypes agree.
        self._read = self.full if self.compute_dtype == self.dtype else torch.empty(self.padded_numel, dtype=self.dtype, device=device)
        self.active = self.full  # the buffer the parameters point into while gathered
        self._view_cache: dict[bool, list[Tensor]] = {}  # active is full -> the parameters' views of it
        self._copy_owned: list[Tensor] = []  # gather buffers allocated on the copy stream
        # Released parameters are empty tensors of the compute dtype: a parameter whose dtype changes
        # gets a new gradient accumulator from autograd, so a parameter used twice in one forward
        # (tied weights) would accumulate, and signal, once per use instead of once.
        self._empty = torch.empty(0, dtype=self.compute_dtype, device=device)
        self.master: Optional[Tensor] = None
        self.compute_shard: Optional[Tensor] = None  # or set by the NVMe parameter offload
        if self._host_copy:
            self.compute_shard = self.transfers.host_empty(self.shard_numel, self.compute_dtype).copy_(self.shard)
        elif self._device_copy:
            self.compute_shard = source.new_zeros(self.shard_numel, dtype=self.compute_dtype, device=device)
            if stop > start:
                self.compute_shard[: stop - start].copy_(source[start:stop])
        self.secondary: Optional[Tensor] = None
        self.keeps_qwz_row = False  # inside a generation phase: keep the row qwZ sends (qwz_row)
        self.qwz_row: Optional[Tensor] = None
        self.codes: Optional[Tensor] = None  # frozen weights stored quantized: codes, scales, format
        self.scales: Optional[Tensor] = None
        self.code_format: tuple[int, int] = (8, 256)
        self.fragments: list[Tensor] = []
        self.grad_shard: Optional[Tensor] = None
        self._grad_fragments: list[Tensor] = []
        self.grad_norms: list[Tensor] = []
        self.state_device = device
        self.host_state = False  # master and gradient shard offloaded to host memory
        self.optimizer_on_device = False  # stepped on the device beside an offloaded optimizer
        self.swapped_optimizer = False
        self.exposed = [False] * len(params)
        self._ready = [False] * len(params)
        self._unready = sum(self.wants_grad)  # parameters wanting a gradient without one yet (mark_ready)
        self.received = [False] * len(params)  # got a gradient since the last consumption
        self._stale = [False] * len(params)  # consumed by one optimizer's step, the group's others kept (after_step)
        self._accumulated = False
        self._grad_flat: Optional[Tensor] = None
        self._grad_views: list[Tensor] = []
        self._loose_grad_bytes = 0  # gradients autograd allocated itself, in the ledger until reduced
        # Gradient slices on their way to a host-side gradient shard: the last copy's event, and the
        # copies to add once it has completed (accumulation onto earlier micro-batches).
        self._to_host: Optional[torch.Event] = None
        self._from_device: Optional[torch.Event] = None  # the last copy of a device master into a host-tier shard
        self._host_adds: list[tuple[Tensor, bool]] = []  # (landing buffer, replaces the shard's values)
        self._consumed = True
        self.release()

    # --- gather / release -------------------------------------------------------------------------
    @property
    def holds_exact(self) -> bool:
        """The parameters point into a buffer in their own dtype (a gather for reading, or any
        gather where the compute dtype is the parameters' dtype)."""
        return self.active is self._read

    @property
    def holds_compute(self) -> bool:
        """The parameters point into the compute-dtype buffer :attr:`full`."""
        return self.active is self.full

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of gather buffer this group holds now (0 while released)."""
        return self.full.untyped_storage().nbytes() + (self._read.untyped_storage().nbytes() if self._read is not self.full else 0)

    def holds_storage_of(self, tensor: Tensor) -> bool:
        """``tensor`` is (a view of) one of this group's gather buffers while it has storage."""
        ptr = tensor.untyped_storage().data_ptr()
        return ptr != 0 and ptr in (self.full.untyped_storage().data_ptr(), self._read.untyped_storage().data_ptr())

    def open_gather(self, read: bool = False) -> Tensor:
        """Allocate the buffer a gather fills and make it the active one: :attr:`full` for compute,
        or with ``read`` the buffer of exact values in the parameters' dtype (the other one is
        freed). A gathered group keeps its buffer, refilled as it is. Returns it (1-D,
        ``padded_numel`` elements); the parameters point into it after :meth:`finish_gather`."""
        target = self._activate(read)
        if target.untyped_storage().nbytes() == 0:
            self._allocate(target)
        return target

    def _activate(self, read: bool) -> Tensor:
        # The buffer a gather (for compute, or with ``read`` for reading) fills becomes the active
        # one, the other is freed; returned as it is, allocated or not.
        target = self._read if read else self.full
        other = self.full if read else self._read
        if other is not target:
            self._free(other)
        self.active = target
        return target

    def exact_source(self) -> Optional[Tensor]:
        """What an exact gather for compute all-gathers, where it is a plain device-resident
        tensor: the shard, or its :attr:`compute_shard` copy (cast to ``compute_dtype`` on the way,
        if it is not in it). ``None`` for a group stored quantized (frozen codes) or whose shard
        lives on another tier (offload): those take :meth:`start_gather`'s path. Several groups'
        sources can then be gathered by one collective
        (:meth:`~lightning_zinf.comm.Collectives.all_gather_coalesced`)."""
        if self.codes is not None:
            return None
        shard = self.shard if self.compute_shard is None else self.compute_shard
        return shard if shard.device == self.device else None

    def stage_source(self) -> tuple[Tensor, ...]:
        """What a gather for compute of this group copies from host memory to the device: its
        frozen codes and scales, or its :attr:`compute_shard` copy (else the shard); empty when
        that gather reads device memory only (a device-resident shard, an hpZ secondary
        partition, a qwZ row kept by a generation phase) or copies do not overlap (a CPU device)."""
        if self.secondary is not None or self.qwz_row is not None or not self.transfers.overlapped:
            return ()
        stored = (self.codes, self.scales) if self.codes is not None else (
            self.shard if self.compute_shard is None else self.compute_shard,)
        return stored if stored[0].device != self.device else ()

    def stage(self) -> Optional[CopiedAhead]:
        """Start copying :meth:`stage_source` to the device ahead of the gather that reads it
        (ZeRO-Infinity's overlap-centric prefetch, SC'21 §6.2: the link works for units further
        ahead than the gather buffers), on the copy stream for copies made ahead
        (:meth:`Transfers.copy_ahead`), waiting for no compute: pass the result to
        :meth:`start_gather` as ``staged``. Valid while the host tensors are unchanged: drop it
        before a step, load or edit.

        Returns:
            The device copies (1/W of the unit each, in the dtype they have on the host) and their
            event, or ``None`` when there is nothing to copy.
        """
        source = self.stage_source()
        if not source:
            return None
        self._after_writes_from_device()
        return self.transfers.copy_ahead(source)

    def start_gather(self, quantized: bool = False, from_secondary: bool = True, read: bool = False,
                     staged: Optional[CopiedAhead] = None) -> Handle:
        """Allocate the gather buffer and start all-gathering into it (asynchronously).

        For compute (default): into :attr:`full`, in ``compute_dtype``, from the hpZ secondary
        partitions when this group has one and ``from_secondary``, else from the shards (cast to
        ``compute_dtype`` first, or their :attr:`compute_shard` copies), as INT8 codes and scales
        with ``quantized`` (qwZ).
        With ``read``: the exact values, from the shards, in the parameters' dtype.
        ``staged``: :meth:`stage`'s device copies of this group's host-side source, read instead
        of copying it again (a gather for compute of a host-tier shard; ignored otherwise).
        """
        self._after_writes_from_device()
        target = self._activate(read)
        fresh = target.untyped_storage().nbytes() == 0  # else a gathered unit refills its buffer as it is
        from_secondary = self.secondary is not None and from_secondary and not read
        # For compute, a 16-bit copy of the shard where the offload keeps one: half the bytes read and moved.
        shard = self.shard if read or self.compute_shard is None else self.compute_shard
        stored = self.codes if self.codes is not None else shard
        if from_secondary or stored.device == self.device:
            if fresh:
                self._allocate(target)
            if from_secondary:
                return self.comm.all_gather_secondary(target, self.secondary, async_op=True)
            return self._gather_from_stored(target, shard, quantized and not read)[0]
        # Offloaded to host memory: copy it over on the copy stream and gather from there, so that
        # neither the host nor the compute stream waits for the copy; only the consumer does, when
        # it waits on the handle (one rank's "gather" is a copy on the copy stream, and qwZ's
        # dequantization runs on the compute stream: the handle orders both after the copy
        # stream). What was staged on the copy stream lives until then. A fresh buffer is the copy
        # stream's own memory, so the copy need not wait for the compute queued before it (that is
        # what lets prefetch run ahead); refilling a buffer compute may still read must.
        if fresh:
            self.transfers.limit_ahead(self.padded_numel * target.element_size())
        with self.transfers.on_copy_stream(after_compute=not fresh):
            if fresh:
                self._allocate(target)
                self._copy_owned.append(target)
            handle, staged = self._gather_from_stored(target, shard, quantized and not read,
                                                      None if read else staged)
        if fresh:
            self.transfers.for_compute(target)
        return self.transfers.hold(handle, *staged)

    def _allocate(self, target: Tensor) -> None:
        self.gathers.fill(target.untyped_storage(), self.padded_numel * target.element_size())

    def _free(self, buffer: Tensor) -> None:
        """Free a gather buffer's storage; one the copy stream allocated is reported to
        :meth:`Transfers.done_with` (compute has queued its last read of it)."""
        nbytes = buffer.untyped_storage().nbytes()
        if any(buffer is owned for owned in self._copy_owned):
            self._copy_owned = [owned for owned in self._copy_owned if owned is not buffer]
            self.transfers.done_with(nbytes)
        self.gathers.empty(buffer.untyped_storage())

    def _gather_from_stored(self, target: Tensor, shard: Tensor, quantized: bool,
                            staged: Optional[CopiedAhead] = None) -> tuple[Handle, tuple[Tensor, ...]]:
        # ``staged``: the device copies of what is read here, made ahead (stage()). Host memory not
        # copied ahead is copied now, on the same stream as those (the link's queue, in the order
        # of the gathers), and this stream waits for that copy only.
        kept_row = quantized and self.qwz_row is not None and self.codes is None  # the shard is not read
        hosts = (self.codes, self.scales) if self.codes is not None else (shard,)
        if staged is None and not kept_row and hosts[0].device != self.device:
            staged = self.transfers.copy_ahead(hosts)
        copied = self.transfers.take_ahead(staged) if staged is not None else ()
        if self.codes is not None:  # stored quantized: the codes are the values, sent as they are
            codes, scales = copied or hosts
            return self.comm.all_gather_codes(target, codes, scales, *self.code_format, async_op=True), (codes, scales)
        if kept_row:  # kept by a generation phase
            return self.comm.all_gather_quantized(target, shard, async_op=True, row=self.qwz_row), (self.qwz_row,)
        shard = copied[0] if copied else shard
        if quantized:
            row = self.comm.quantized_row(shard)
            if self.keeps_qwz_row:
                self.qwz_row = row
                self.ledger.add("secondary", row.untyped_storage().nbytes())
            return self.comm.all_gather_quantized(target, shard, async_op=True, row=row), (shard, row)
        shard = shard.to(target.dtype)
        return self.comm.all_gather(target, shard, async_op=True), (shard,)

    def gather_scratch(self, quantized: bool, from_secondary: bool) -> tuple[Handle, tuple[Tensor, ...]]:
        """Take part in a gather of this group for compute without touching its own buffers (it is
        in use on this rank while another rank asks for it): the collective :meth:`start_gather`
        would issue, into a scratch buffer. The shard must be in memory (NVMe: acquired by the
        caller). Returns the handle and what must live until it is waited for."""
        self.settle_host_shard()
        scratch = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        if self.secondary is not None and from_secondary:
            return self.comm.all_gather_secondary(scratch, self.secondary, async_op=True), (scratch,)
        shard = self.shard if self.compute_shard is None else self.compute_shard
        handle, staged = self._gather_from_stored(scratch, shard, quantized)
        return handle, (scratch, *staged)

    def keep_secondary(self) -> None:
        """hpZ (ZeRO++ §3.2): keep this rank's secondary partition, its ``1/P`` of the gathered
        buffer (P = ``hpz_partition_size``), for later gathers inside its partition group. Call
        after a gather; the values must be current (they are until the shards change)."""
        hpz = self.comm.hpz
        assert hpz is not None, "keep_secondary needs Collectives(hpz_partition_size=...)"
        size = self.padded_numel // hpz.ranks_per_node
        self.drop_secondary()  # and a kept qwZ row: later gathers read the secondary partition instead
        self.secondary = self.full[hpz.local_rank * size : (hpz.local_rank + 1) * size].clone()
        self.ledger.add("secondary", self.secondary.untyped_storage().nbytes())

    def store_quantized(self, bits: int, block: int) -> None:
        """Keep this (frozen) group's shard as blockwise codes and scales only (``bits`` 8 or 4, one
        fp32 scale per ``block``), freeing the shard; :meth:`shard_resident` brings values back
        for checkpoints, loads and edits.

        Raises:
            ValueError: the group is trainable (the optimizer steps its shard).
        """
        if self.trainable:
            raise ValueError(f"store_quantized: {self.names[0]}... is trainable; only frozen groups are stored quantized.")
        self.code_format = (bits, block)
        self._set_codes(*quantize(self.shard, bits, block))
        self.shard = self.shard.new_empty(0)
        self.compute_shard, self._host_copy = None, False  # gathers send the codes

    def _set_codes(self, codes: Tensor, scales: Tensor) -> None:
        # Host-side codes are copied to the device at every gather: page-locked, without blocking.
        if codes.device.type == "cpu":
            codes, scales = self.transfers.host_copy(codes), self.transfers.host_copy(scales)
        self.codes, self.scales = codes, scales

    @contextmanager
    def shard_resident(self, write_back: bool) -> Iterator[None]:
        """For a group stored quantized: its shard, dequantized, in :attr:`shard` for the block;
        afterwards requantized from it (``write_back``: it was loaded or edited) and freed. For
        other groups, nothing."""
        if self.codes is None:
            yield
            return
        bits, block = self.code_format
        self.shard = dequantize(self.codes, self.scales, self.shard_numel, bits, block, dtype=self.dtype)
        try:
            yield
            if write_back:
                self._set_codes(*quantize(self.shard, bits, block))
        finally:
            self.shard = self.shard.new_empty(0)

    def drop_secondary(self) -> None:
        """Forget the hpZ secondary partition and the kept qwZ row (the shards changed): the next
        gather uses the shards."""
        if self.secondary is not None:
            self.ledger.add("secondary", -self.secondary.untyped_storage().nbytes())
        self.secondary = None
        self.drop_qwz_row()

    def drop_qwz_row(self) -> None:
        """Forget the qwZ row kept by a generation phase (:attr:`keeps_qwz_row`): the next quantized
        gather quantizes the shard again. The phase keeps the row so that each shard is quantized
        once per phase rather than once per decode step (ZeRO++, Wang et al. 2023, §3.1's
        quantized weights, held as DeepSpeed's hybrid engine holds its gathered weights for
        RLHF generation)."""
        if self.qwz_row is not None:
            self.ledger.add("secondary", -self.qwz_row.untyped_storage().nbytes())
        self.qwz_row = None

    def finish_gather(self) -> None:
        """Point every parameter at its slice of the gathered buffer (call after ``wait()``)."""
        for p, view in zip(self.params, self._gathered_views()):
            p.data = view

    def _gathered_views(self) -> list[Tensor]:
        # ``full`` and ``_read`` keep their storage objects for the group's life (the gather pool
        # moves memory in and out of them), so their views are made once, not at every gather.
        key = self.active is self.full
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = self._views(self.active)
        return views

    def repoint(self) -> None:
        """Point every parameter back at the buffer it is gathered into, or at the empty tensor of a
        released group (after code that set ``.data`` to something else for a while: a state dict)."""
        if self.active.untyped_storage().nbytes():
            self.finish_gather()
        else:
            for p in self.params:
                p.data = self._empty

    def release(self) -> None:
        """Free the gathered buffer; parameters become empty tensors until the next gather."""
        for p in self.params:
            p.data = self._empty
        self._free(self.full)
        self._free(self._read)
        self.active = self.full

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered buffer into the shard (and the fp32 master).

        Used after user code edited gathered parameters (gathered for reading); every rank must have
        made the same edit. Call inside ``ZeroEngine.state_resident(write_back=True)``, which then
        drops the hpZ secondary partition (it may hold the old values).
        """
        self.settle_host_shard()
        new = self.active[self.shard_start : self.shard_start + self.shard_numel].to(self.shard.device)
        if self.master is not None and self.master is not self.shard:
            # Only edited elements: copying the whole shard would round unedited fp32 masters. A
            # select, not masked indexing: after a load every element changed, and indexing cost
            # 10x the time and index tensors twice the shard's size (state_dict.py benchmark).
            changed = (new != self.shard).to(self.master.device)
            torch.where(changed, new.to(self.master.device, torch.float32), self.master, out=self.master)
        self.shard.copy_(new)  # the unedited elements are equal already (inside state_resident, which
        # refreshes a compute copy once the block ends)

    def shard_changed(self) -> None:
        """The shard was rewritten (a step, a load, an edit): drop the kept qwZ row, refresh the
        compute copy: in host memory (``host_copy``), or on the device (``device_copy``: cast on the
        host and sent in ``compute_dtype`` on the copy stream, after the compute that may still read
        the old copy; compute from here on waits for it, the host does not). The NVMe offload
        refreshes its records itself. The host must not write memory a copy to the device may still
        read: call after :meth:`Transfers.host_wait_h2d`."""
        self.settle_host_shard()
        self.drop_qwz_row()
        if self._host_copy:
            self.compute_shard.copy_(self.shard)
        elif self._device_copy:
            self.transfers.wait_on_device(self.transfers.copy_to_device(self.compute_shard, self.shard))

    def _send_master_to_host(self) -> None:
        """After a step of a master on the device: its values sent into the host-tier shard, and
        cast on the device into the host compute copy, on the device-to-host copy stream after the
        step's compute; the host does not wait (copies to the device wait for them on the device,
        host readers in :meth:`settle_host_shard`)."""
        self.drop_qwz_row()
        # Cast on the device: a copy to the host that also converts is staged through pageable memory.
        self._from_device = self.transfers.copy_to_host(self.shard, self.master.to(self.shard.dtype))
        if self._host_copy:  # rounded as the host would round it: fp32 to 16 bits is the same cast
            self._from_device = self.transfers.copy_to_host(self.compute_shard, self.master.to(self.compute_dtype))

    def _after_writes_from_device(self) -> None:
        # Copies of the host-tier shard (or its copy) to the device, all on the stream of copies
        # made ahead (Transfers.copy_ahead), read it only once the master's values have landed
        # there; device-side, the host does not wait.
        if self._from_device is not None and self.transfers.ahead is not None:
            self.transfers.ahead.wait_event(self._from_device)

    def settle_host_shard(self) -> None:
        """Block the host until the master's last values have landed in the host-tier shard (after
        a step of a master on the device: :meth:`after_step`): before the host reads or writes
        the shard (checkpoints, state dicts, loads, edits)."""
        if self._from_device is not None:
            self.transfers.wait_on_host(self._from_device)
            self._from_device = None

    @property
    def keeps_device_copy(self) -> bool:
        """The shard lives in host memory as the offloaded optimizer's master while gathers read a
        compute copy on the device (``device_copy``)."""
        return self._device_copy

    # --- optimizer state --------------------------------------------------------------------------
    def make_master(self, state_device: Optional[torch.device] = None, separate: bool = False,
                    swapped: bool = False) -> None:
        """Create the fp32 master shard and the per-parameter fragments the optimizer steps.

        Args:
            state_device: Where the master and the gradient shard live (default: ``device``).
            separate: Give fp32 groups a master of their own instead of stepping ``shard`` in place
                (offload: the master lives on another tier than the shard the forward reads),
                unless the forward reads a host copy (``host_copy``) and the shard is where the
                master goes.
            swapped: The master will be swapped to NVMe (its tensor emptied between steps): never
                the shard, which must stay in memory.
        """
        if self.master is None:
            self.state_device = state_device or self.device
            self.host_state = state_device is not None and state_device.type == "cpu"  # the optimizer offloaded
            # A host copy feeds the gathers: the fp32 shard beside it can be stepped in place.
            in_place = (self.state_device == self.device and not separate) or ((self._host_copy or self._device_copy) and not swapped)
            if self.dtype == torch.float32 and in_place and self.shard.device == self.state_device:
                self.master = self.shard
            else:
                self.master = self.shard.to(self.state_device, torch.float32, copy=True)
                if self._pin_shard and self.shard.device != self.device and self.state_device == self.device:
                    # A host-tier shard that each step's values are sent into: page-locked, so
                    # that copy does not block the host (after_step).
                    self.shard = self.transfers.host_copy(self.shard)
        if not self.fragments:  # once: several optimizers may each hold some of them
            self.fragments = [self.master[lo:hi] for lo, hi in self.owned_ranges()]

    def layout(self, which: str) -> list[tuple[Tensor, int]]:
        """``master`` or ``grad``: that shard and the per-parameter views of it, each with its
        element offset in the shard (for offload, which re-points them into staging memory)."""
        whole, parts = (self.master, self.fragments) if which == "master" else (self.grad_shard, self._grad_fragments)
        return [(whole, 0)] + [(part, lo) for part, (lo, _) in zip(parts, self.owned_ranges())]

    def owned_ranges(self) -> list[tuple[int, int]]:
        """Per parameter, the [lo, hi) range of this rank's shard that holds its elements."""
        return self._ranges

    def _fragment_views(self, shard: Tensor) -> list[Tensor]:
        """Each parameter's 1-D view of ``shard`` (this rank's ``shard_numel`` elements), over its
        :meth:`owned_ranges` (empty where the rank holds none of it). One ``as_strided`` each, as
        :meth:`_views` makes them: single views (not ``split``'s multiple outputs, on which torch
        refuses some in-place ops a user may make on a ``.grad``)."""
        base = shard.storage_offset()
        return [shard.as_strided((hi - lo,), (1,), base + lo) for lo, hi in self._ranges]

    def _compute_owned_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        for offset, numel in zip(self.offsets, self.numels):
            lo = min(max(offset - self.shard_start, 0), self.shard_numel)
            hi = min(max(offset + numel - self.shard_start, lo), self.shard_numel)
            ranges.append((lo, hi))
        return ranges

    def after_step(self, held: Optional[Sequence[bool]] = None) -> None:
        """Cast the stepped fp32 master back into the compute-dtype shard (unless the optimizer is
        offloaded: :class:`~lightning_zinf.offload.optimizer.OptimizerOffload` copies each group as
        it steps it); the gradients are consumed (the next backward starts a fresh accumulation, as
        after ``zero_grad``). The hpZ secondary partition, now stale, is dropped.

        Args:
            held: Per parameter, whether the optimizer that stepped holds it (``None``: all). Where
                it does not hold a parameter that takes gradients (two optimizers over one unit:
                a GAN's generator and discriminator grouped together), only the held parameters'
                gradients are consumed (marked stale: the next backward starts them over, in
                :meth:`accumulate`, while an offloaded step may still read them now): the others
                keep accumulating across this step, as in plain torch.
        """
        self.drop_secondary()
        partial = (held is not None and not self.swapped_optimizer
                   and any(not h and p.requires_grad for p, h in zip(self.params, held)))
        if self.master is not None and not self.host_state:  # an offloaded optimizer copies as it steps
            if self.shard.device != self.master.device and self._pin_shard:
                self._send_master_to_host()
            else:
                if self.master is not self.shard:
                    self.shard.copy_(self.master)
                self.shard_changed()
        if not partial:
            self._consumed = True
            return
        self._stale = [a or b for a, b in zip(self._stale, held)]

    def free_consumed_grads(self) -> None:
        """Free the fp32 gradient shard once the optimizer has consumed it and no fragment holds it
        (``zero_grad()`` set every ``.grad`` to ``None``): until the next backward accumulates into
        a new one, forward runs without it (FSDP2's sharded gradients are freed the same way).
        Not for a gradient shard that the NVMe optimizer offload swaps."""
        if self.grad_shard is None or self.swapped_optimizer or not all(f.grad is None for f in self.fragments):
            return
        # Consumed by a step, or every fragment's gradient cleared between backwards (the zero_grad
        # of each optimizer sharing the group): the next backward starts over either way.
        if self._consumed or (self.fragments and not self._accumulated and not self.grads_in_transit):
            self.grad_shard, self._grad_fragments = None, []
            self._consumed, self._stale = True, [False] * len(self.params)

    def discard_accumulated(self) -> None:
        """The gradients were consumed (a step) or zeroed: the next :meth:`accumulate` starts over."""
        self._consumed = True
        self.exposed = [False] * len(self.params)

    # --- gradients --------------------------------------------------------------------------------
    @property
    def casts_gradients(self) -> bool:
        """Gradients come out of backward in another dtype than the reduce-scatter's."""
        return self.compute_dtype != self.reduce_dtype

    def prepare_grads(self, pool: BufferPool) -> None:
        """Before the unit's backward: point every ``p.grad`` at its slice of one zeroed flat buffer,
        so autograd accumulates gradients in place, already laid out for the reduce-scatter
        (DeepSpeed's contiguous gradients). Idempotent within one backward.

        Not for a group whose gradients are cast for the reduce-scatter: there autograd keeps its
        own per-parameter gradients (FSDP2's way) and :meth:`start_reduce` casts them straight
        into the reduce-scatter input, so no compute-dtype flat buffer is held beside that input
        (measured: 15-19 MiB of a 4-rank bf16 peak, examples/benchmarks/RESULTS.md)."""
        if self._grad_flat is not None or self.casts_gradients:
            return
        self._new_grad_buffer(pool)
        for p, view, wanted in zip(self.params, self._grad_views, self.wants_grad):
            if wanted:  # a frozen parameter keeps no .grad, as in plain torch
                p.grad = view

    def _new_grad_buffer(self, pool: BufferPool) -> None:
        # In the dtype autograd produces for the gathered parameters (their compute dtype).
        self._grad_flat = pool.take(self.padded_numel, self.compute_dtype).zero_()
        self._grad_views = self._views(self._grad_flat)

    def _views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of ``flat`` (a full, 1-D buffer of this group), in its shape. One
        ``as_strided`` each: a quarter of a slice and a reshape's host time, paid per tensor at every
        gather and backward (thousands of small tensors a step in a grouped model)."""
        base = flat.storage_offset()
        return [flat.as_strided(shape, stride, base + offset)
                for shape, stride, offset in zip(self.shapes, self._strides, self.offsets)]

    def mark_ready(self, index: int) -> bool:
        """Note that parameter ``index`` has its gradient; True once every parameter that requires
        one (:attr:`wants_grad`) has one."""
        if not self._ready[index]:
            grad = self.params[index].grad
            if self._grad_flat is None and grad is not None:
                # A gradient autograd allocated itself: accounted until start_reduce copies it.
                self._loose_grad_bytes += grad.numel() * grad.element_size()
                self.ledger.add("grad_buffers", grad.numel() * grad.element_size())
            self._ready[index] = True
            # A count, not a scan of the flags: a grouped unit's group has hundreds of parameters,
            # each calling this once a backward.
            self._unready -= self.wants_grad[index]
        return self._unready <= 0

    def set_wanted(self, wanted: list[bool]) -> None:
        """Which parameters require a gradient from the next pass on (one flag per parameter, at a
        pass boundary): :attr:`wants_grad`, and :attr:`trainable` if any does."""
        self.wants_grad = list(wanted)
        self.trainable = any(wanted)
        self._unready = sum(w and not r for w, r in zip(self.wants_grad, self._ready))

    def _drop_loose_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.ledger.add("grad_buffers", -self._loose_grad_bytes)
        self._loose_grad_bytes = 0

    @property
    def any_ready(self) -> bool:
        """Some parameter received its gradient in this backward."""
        return any(self._ready)

    @property
    def grads_prepared(self) -> bool:
        """A flat gradient buffer is attached (between pre-backward and the reduce-scatter)."""
        return self._grad_flat is not None

    def start_reduce(self, pool: BufferPool) -> tuple[Handle, list[Tensor], list[bool]]:
        """Start reduce-scattering the flat gradient (zeros where a parameter got none) and free the
        full gradients.

        Returns:
            ``(handle, buffers, got)``: wait on ``handle``, then call :meth:`accumulate` with
            ``buffers[0]`` (``reduce_dtype``, ``shard_numel`` elements: the mean over ranks of this
            rank's slice) and ``got`` (which parameters had a gradient on this rank), and give all
            ``buffers`` back to ``pool``.
        """
        got = list(self._ready)
        if self.casts_gradients:
            # One pass over autograd's gradients casts them into the reduce-scatter input (FSDP2's
            # copy-in); zeros where a parameter got none, and in the padding. One multi-tensor
            # kernel each on an accelerator, not one per parameter: the gradients share a dtype,
            # and each is copied into a 1-D slice of its own size.
            flat = pool.take(self.padded_numel, self.reduce_dtype, "reduce_pending")
            slices = flat.split([*self.numels, self.padded_numel - self.numel])  # the last: padding
            has = [p.grad is not None for p in self.params]
            if any(has):
                torch._foreach_copy_([dst for dst, h in zip(slices, has) if h],
                                     [p.grad.reshape(-1) for p, h in zip(self.params, has) if h])
            torch._foreach_zero_([dst for dst, h in zip(slices, [*has, False]) if not h])
            got = [a or h for a, h in zip(got, has)]
        else:
            if self._grad_flat is None:
                # No pre-backward hook ran (a parameter used outside any hooked module's output
                # path): autograd stored the gradients itself; they are copied in below.
                self._new_grad_buffer(pool)
            flat, views = self._grad_flat, self._grad_views
            for j, (p, view) in enumerate(zip(self.params, views)):
                grad = p.grad  # (read once: each read is a call into torch)
                if grad is not None and grad is not view:  # autograd replaced our view
                    view.copy_(grad)
                    got[j] = True
            self._grad_flat, self._grad_views = None, []
            pool.move(flat, "reduce_pending")
        self._drop_loose_grads()
        self._ready, self._unready = [False] * len(self.params), sum(self.wants_grad)
        if self.comm.local and self.comm.qgz_bits is None:
            # The mean over one rank is the flat gradient itself (shard_numel == padded_numel):
            # hand it on as the result, with no second buffer and no copy.
            return self.comm.reduce_scatter_mean(flat, flat, async_op=True), [flat], got
        out = pool.take(self.shard_numel, self.reduce_dtype, "reduce_pending")
        reduce = self.comm.reduce_scatter_mean if self.comm.qgz_bits is None else self.comm.reduce_scatter_mean_quantized
        return reduce(out, flat, async_op=True), [out, flat], got

    def start_reduce_zeros(self, pool: BufferPool) -> tuple[Handle, list[Tensor], list[bool]]:
        """Take part, with a zero gradient, in a reduce-scatter of this group that another rank
        asked for (this rank did not use the group in this backward); the result is this rank's
        slice of the other ranks' mean, to :meth:`accumulate` as :meth:`start_reduce`'s is. The
        group's own gradients in progress, if any, are left alone."""
        flat = pool.take(self.padded_numel, self.reduce_dtype, "reduce_pending").zero_()
        out = pool.take(self.shard_numel, self.reduce_dtype, "reduce_pending")
        reduce = self.comm.reduce_scatter_mean if self.comm.qgz_bits is None else self.comm.reduce_scatter_mean_quantized
        return reduce(out, flat, async_op=True), [out, flat], [False] * len(self.params)

    def discard_grads(self, pool: BufferPool) -> None:
        """Drop a prepared flat gradient that received nothing, or gradients autograd stored
        itself, and forget partial readiness (after a backward that raised). Nothing to do, and no
        pass over the parameters, where no backward reached the group (every decode step of a
        generation settles every group)."""
        if self._grad_flat is None and not self._loose_grad_bytes and not any(self._ready):
            return
        if self._grad_flat is not None:
            pool.give(self._grad_flat)
            self._grad_flat, self._grad_views = None, []
        self._drop_loose_grads()
        self._ready, self._unready = [False] * len(self.params), sum(self.wants_grad)

    def accumulate(self, reduced: Tensor, got: list[bool]) -> bool:
        """Add a reduced gradient slice to the fp32 gradient shard; ``got`` marks the parameters
        that had a gradient on this rank. The optimizer sees the result after :meth:`expose_grads`.

        The first call after an optimizer step (:meth:`after_step`) or after ``zero_grad`` (all
        fragments' ``.grad`` set to ``None``) starts a fresh accumulation.

        Returns:
            Whether ``reduced`` itself became the gradient shard (the first accumulation since the
            shard was freed, of an fp32 slice on the state device, as FSDP2 keeps its reduce-scatter
            output): then the caller must not reuse it.
        """
        adopt = (self.grad_shard is None and not self.swapped_optimizer and reduced.dtype == torch.float32
                 and reduced.device == self.state_device and reduced.numel() == self.shard_numel)
        if self.grad_shard is None:
            if adopt:
                self.grad_shard = reduced
            elif self.host_state:
                self.grad_shard = self.transfers.host_zeros(self.shard_numel, torch.float32)
            else:
                self.grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.state_device)
            # Views made once, while the storage exists: an offloaded gradient shard may have no
            # storage when they are handed to the optimizer.
            self._grad_fragments = self._fragment_views(self.grad_shard)
        fresh = self.fresh_accumulation or adopt
        if fresh:
            self._stale = [False] * len(self.params)
        elif not self._accumulated:
            self._start_over_stale()
        self._consumed = False
        to_host = self.host_state and not adopt
        if to_host:
            # To a host-side gradient shard: on the copy stream, read on the host only after
            # finish_host_grads (the end of backward), so backward is never blocked by a copy.
            # Sent in the reduce dtype (ZeRO-Offload's gradient bytes: 2 per parameter under a
            # 16-bit reduce dtype), into a page-locked landing buffer cast or added on the host
            # then; an fp32 slice starting an accumulation lands straight in the shard.
            if fresh and reduced.dtype == torch.float32:
                self._to_host = self.transfers.copy_to_host(self.grad_shard, reduced)
            else:
                landing = self.transfers.host_empty(self.shard_numel, reduced.dtype)
                self._to_host = self.transfers.copy_to_host(landing, reduced)
                self._host_adds.append((landing, fresh))
        elif fresh:
            if not adopt:
                self.grad_shard.copy_(reduced)  # from the reduce dtype into fp32
        else:
            self.grad_shard.add_(reduced)
        self.received = got if fresh else [a or b for a, b in zip(self.received, got)]
        if not self.grads_in_transit:
            self._record_norms()
        self._accumulated = True
        return adopt

    def _start_over_stale(self) -> None:
        """At a backward's first slice onto kept gradients: the parameters whose gradients were
        consumed since (stepped by one of the optimizers sharing the group, or cleared by its
        ``zero_grad``: the fragment's ``.grad`` is ``None``) start over from zero; the others keep
        accumulating, as each parameter's ``.grad`` does in torch."""
        if self.swapped_optimizer or self.grad_shard is None:
            return
        cleared = [f.grad is None for f in self.fragments] if self.fragments else [False] * len(self.params)
        for j, (lo, hi) in enumerate(self.owned_ranges()):
            if self._stale[j] or cleared[j]:
                self.grad_shard[lo:hi].zero_()
                self.received[j] = False
        self._stale = [False] * len(self.params)

    @property
    def grads_in_transit(self) -> bool:
        """Gradient slices are on their way to the host-side gradient shard (:meth:`finish_host_grads`)."""
        return self._to_host is not None or bool(self._host_adds)

    @property
    def host_grads_arrived(self) -> bool:
        """The copies towards the host-side gradient shard have completed (no host wait)."""
        return self._to_host is None or self._to_host.query()

    @property
    def host_adds_pending(self) -> bool:
        """Gradient slices wait to be added onto earlier micro-batches' (:meth:`finish_host_grads`)."""
        return bool(self._host_adds)

    def finish_host_grads(self) -> None:
        """Wait (on the host) for the gradient slices copied towards the host-side gradient shard,
        and add those that accumulate onto earlier micro-batches. Nothing to do on the CPU, where
        every copy was made at once, or when none is in transit."""
        if not self.grads_in_transit:
            return
        self.transfers.wait_on_host(self._to_host)
        self._to_host = None
        for landing, replaces in self._host_adds:
            if replaces:  # the first slice since the gradients were consumed
                self.grad_shard.copy_(landing)
            else:
                self.grad_shard.add_(landing)
        self._host_adds = []
        self._record_norms()

    def _record_norms(self) -> None:
        if self.swapped_optimizer:
            self.grad_norms = list(torch._foreach_norm(self._grad_fragments))

    @property
    def fresh_accumulation(self) -> bool:
        """The next :meth:`accumulate` starts over (after a step or ``zero_grad``). Not within one
        backward that accumulated already (several reduce-scatters of this group in one backward:
        other ranks' requests this rank served), before its gradients are exposed."""
        if self.swapped_optimizer:  # zero_grad is reported through discard_accumulated
            return self._consumed
        if self._accumulated:
            return False
        return self._consumed or (bool(self.fragments) and all(f.grad is None for f in self.fragments))

    def expose_grads(self, received: list[bool]) -> None:
        """Give each fragment its slice of the gradient shard as ``.grad``, but only for parameters
        that received a gradient on some rank (``received``, agreed by all ranks): like plain
        torch, a parameter without a gradient is not stepped (no weight decay, no moment decay).
        Groups that accumulated nothing since the last call keep their fragments' gradients."""
        if not self._accumulated:
            return
        self._accumulated = False
        if self.swapped_optimizer:
            self.exposed = list(received)
            return
        for j, (fragment, has) in enumerate(zip(self.fragments, received)):
            fragment.grad = self._grad_fragments[j] if has and self._grad_fragments else None

    def gradient_view(self, j: int) -> Tensor:
        """Parameter ``j``'s slice of the fp32 gradient shard (what its fragment's ``.grad`` is when
        exposed); with ``swapped_optimizer`` valid while the shard is in memory."""
        return self._grad_fragments[j]
