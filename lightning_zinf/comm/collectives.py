"""The one place where the engine talks to other ranks.

Every gather and reduce-scatter of the engine goes through :class:`Collectives`, so quantized
(qwZ/qgZ) and hierarchical (hpZ) variants can replace these methods later without touching the
engine, and every byte sent is counted for the monitoring callbacks.

Without an initialised process group (or with world size 1) the collectives become local copies,
so the engine runs in a plain single-process script too; the debug switch ``ZINF_REAL_COLLECTIVES=1``
keeps the data plane's collectives real at world size 1 (:func:`real_collectives_forced`).

Two planes, two groups. The data plane (gathers, reduce-scatters, all-to-alls, collectives of
tensors on the compute device) runs on the data-parallel group, NCCL on GPUs. The control plane
(rank agreement, trace checks, gradient-received flags, object gathers, barriers, anything held in
host memory: RNG states, norms of CPU-offloaded gradients) runs on a gloo group over the same ranks
with CPU tensors. A group of its own rather than a default group with a per-device backend
(``cpu:gloo,cuda:nccl``): it works whatever backend the caller initialised the world with
(``init_process_group("nccl")`` in a torchrun script included), and a host-side agreement then
never enqueues device work nor waits for the device's queue to drain, as an all-reduce of a CUDA
tensor read back with ``int()`` would.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from lightning_zinf.comm.exit import hold_groups
from lightning_zinf.comm.topology import NodeGroups, RankSetGroups, Topology, require_divisor
from triton_kernels import (PackedRows, QgzLayout, dequantize, dequantize_reduce, dequantize_reduce_requantize,
                            quantize, reorder_quantize)

__all__ = ["Collectives", "CommBytes", "Handle"]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Below this many bytes gloo's staging copies cost less than the extra collectives of the in-place
# forms below (one per rank instead of one): small units keep the flat collective.
_GLOO_IN_PLACE_BYTES = 1 << 20


class Handle(Protocol):
    """What an asynchronous collective returns: ``wait()`` blocks until its output is ready."""

    def wait(self) -> Any: ...


class _Done:
    """A handle for work that finished synchronously."""

    def wait(self) -> bool:
        return True


class _Task:
    """A handle for a function run by a :class:`_Sequence`: ``wait()`` returns once it has run, or
    raises what it raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as error:  # handed to the waiting thread
            self.error = error
        finally:
            self.done.set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True


class _Sequence:
    """A daemon thread that runs functions in the order they were submitted: on gloo, hybrid
    sharding's all-reduce of each gradient shard across the replicas, after its reduce-scatter.
    gloo's waits block the thread that waits, so run in the caller they would stop the backward
    for the reduce-scatter's remaining time and the whole all-reduce; here the next unit's backward
    computes meanwhile, as it does during the reduce-scatter alone. One thread, so each rank issues
    the replica group's all-reduces in the order of its reduce-scatters, which every rank shares. A
    daemon, so that a thread stuck in a collective of a failed run does not hold the process at exit."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[_Task]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._failed: Optional[BaseException] = None

    def submit(self, fn: Callable[[], None]) -> _Task:
        """Queue ``fn``; the handle's ``wait()`` returns once it has run (raising what it raised).
        After a function raised, the later ones do not run and their handles raise that error:
        a rank that skipped one collective must not pair its next with the peers' skipped one."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zinf-replica-all-reduce", daemon=True)
            self._thread.start()
        task = _Task(fn)
        self._queue.put(task)
        return task

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if self._failed is not None:
                task.error = self._failed
                task.done.set()
                continue
            task.run()
            self._failed = task.error


class _Then:
    """A handle that waits for its collectives (possibly none), then runs ``finish`` once
    (dequantization, the rest of qgZ's steps) on the stream current at ``wait()``; ``keep`` stays
    alive until then (tensors in use by work on other streams) and is then recorded on that stream
    (``record_stream``): tensors allocated on another stream (a copy stream's gather of offloaded
    shards) that ``finish`` or the collectives read are not reused before that stream is done, the
    collectives included, since ``wait()`` ordered it after them."""

    def __init__(self, works: list[Any], finish: Callable[[], None], keep: tuple = ()) -> None:
        self.works: list[Any] = works
        self.finish: Optional[Callable[[], None]] = finish
        self.keep = keep

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        for tensor in self.keep:
            if isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta"):
                tensor.record_stream(torch.accelerator.current_stream(tensor.device))
        self.keep = ()
        return True


@dataclass
class CommBytes:
    """Bytes this rank moved through collectives since the last :meth:`reset`.

    Attributes:
        gathered: Bytes received by all-gathers of parameter shards (the full buffer minus this
            rank's own shard), from the primary shards or (hpZ) the secondary partitions.
        reduce_scattered: Bytes sent by gradient reduce-scatters (the full flat gradient minus
            this rank's own shard).
        all_reduced: Bytes sent by hybrid sharding's all-reduce of gradient shards across the
            replicas, as a ring sends them (``2 (R - 1) / R`` times the shard for ``R`` replicas;
            with qgZ, ``2 (R - 1)`` packed rows of codes and scales).
        intra_node: Of all three, the bytes exchanged with ranks on this rank's node.
        inter_node: Of all three, the bytes exchanged with ranks on other nodes (what ZeRO++ and
            hybrid sharding reduce).
    """

    gathered: int = 0
    reduce_scattered: int = 0
    all_reduced: int = 0
    intra_node: int = 0
    inter_node: int = 0

    def reset(self) -> None:
        self.gathered = self.reduce_scattered = self.all_reduced = self.intra_node = self.inter_node = 0

    def add_split(self, split: tuple[int, int]) -> None:
        """Add ``(intra-node, inter-node)`` bytes."""
        self.intra_node += split[0]
        self.inter_node += split[1]


#: The environment variable of the debug switch that keeps real data-plane collectives at world size 1.
REAL_COLLECTIVES_ENV = "ZINF_REAL_COLLECTIVES"


def real_collectives_forced() -> bool:
    """Whether ``ZINF_REAL_COLLECTIVES=1``: at world size 1, gathers, reduce-scatters and qgZ's
    all-to-alls still go through ``torch.distributed`` (all_gather_into_tensor, reduce_scatter_tensor,
    all_to_all_single) instead of local copies, so that one GPU runs every engine feature through
    NCCL once (a debug and device-check switch; the values are the same, the time is not)."""
    return os.environ.get(REAL_COLLECTIVES_ENV) == "1"


def _gloo_in_place(group: Optional[dist.ProcessGroup], device: torch.device, nbytes: int, one_node: bool) -> bool:
    """The in-place forms below serve gloo on host tensors (``device``) whose gathered or reduced
    whole is 1 MiB and more (``nbytes``) when every rank of ``group`` is on this machine. They send
    each peer its bytes directly, which crosses a link between nodes once per remote peer where
    gloo's ring forms cross it once per node pair (``cluster/cluster.py``, ZeRO-3 on 2 nodes of 2
    ranks: 85 vs 77 MB over the link per step); an accelerator uses NCCL, which gathers and
    reduce-scatters in place already."""
    return (one_node and device.type == "cpu" and nbytes >= _GLOO_IN_PLACE_BYTES
            and dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1)


def gloo_received_nbytes(world: int, shard_nbytes: int) -> int:
    """Bytes gloo's in-place reduce-scatter within one node (:func:`_reduce_scatter_mean_flat`)
    receives into a buffer of its own: the ``world - 1`` peers' copies of this rank's slice of
    ``shard_nbytes`` bytes, where the reduced whole (``world * shard_nbytes``) is 1 MiB and more
    and ``world > 1``; else 0. The memory ledger (:meth:`Collectives.reduce_transient_nbytes`) and
    the planner (:mod:`lightning_zinf.planning.cost`) count it the same way.

    Args:
        world: Ranks of the reduce-scatter's group.
        shard_nbytes: Bytes of one rank's slice (``n`` elements times their size).

    Returns:
        Bytes, an int >= 0.
    """
    return (world - 1) * shard_nbytes if world > 1 and world * shard_nbytes >= _GLOO_IN_PLACE_BYTES else 0


def _all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup], one_node: bool,
                     async_op: bool = False) -> Optional[Handle]:
    """All-gather ``shard`` (``n`` elements) from every rank of ``group`` into ``out``, rank r's at
    ``out[r*n:(r+1)*n]``; a handle when ``async_op``.

    On gloo on one node, for tensors of 1 MiB and more, by one in-place broadcast per rank into its slice of
    ``out``: gloo's flat all-gather stages the gathered tensor in a buffer of its own and copies it
    back slice by slice (torch.profiler on ``throughput.py``'s 91M GPT: the largest single item of
    a step), and the broadcasts move the same bytes without those copies (2 ranks, one 14 MB
    shard: 7.7 vs 17.9 ms, medians of 6). Other backends (NCCL) gather in place already.
    """
    if not _gloo_in_place(group, out.device, out.numel() * out.element_size(), one_node):
        return _all_gather_tensor(out, shard, group=group, async_op=async_op)
    n, world = shard.numel(), dist.get_world_size(group)
    out[dist.get_rank(group) * n:][:n].copy_(shard)
    works = [dist.broadcast(out[s * n:][:n], group_src=s, group=group, async_op=True) for s in range(world)]
    handle = _Then(works, lambda: None)
    if not async_op:
        handle.wait()
        return None
    return handle


def _reduce_scatter_mean_flat(out: torch.Tensor, full: torch.Tensor, group: Optional[dist.ProcessGroup],
                              one_node: bool, async_op: bool = False) -> Optional[Handle]:
    """The mean over the ranks of ``group`` of ``full`` (``W * n`` elements), this rank's slice
    ``[r*n:(r+1)*n]`` into ``out``; ``full`` is scratch afterwards. A handle when ``async_op``.

    On gloo on one node, for tensors of 1 MiB and more, by point-to-point messages: every rank
    sends each peer that peer's slice and receives the peers' copies of its own slice into a
    scratch buffer of ``(W - 1) * n`` elements, then sums the W copies in rank order and divides by
    W into ``out``. Each rank sends ``(W - 1) * n`` elements, the least a reduce-scatter can.
    gloo's flat reduce-scatter first copies the whole input and sends twice that, and one
    in-place reduce per rank's slice 2.2 times that (2 ranks, a 14 MB slice, /proc/self/io's
    wchar per call: 1.0x vs 2.0x vs 2.2x the slice; 11.0 vs 28.1 vs 18.8 ms).
    """
    if not _gloo_in_place(group, full.device, full.numel() * full.element_size(), one_node):
        return _reduce_scatter_flat(out, full, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    n, world, me = out.numel(), dist.get_world_size(group), dist.get_rank(group)
    received = full.new_empty((world - 1) * n)
    works = []
    for step in range(1, world):  # pairs (me -> me + step, me - step -> me): every rank busy each round
        to, source = (me + step) % world, (me - step) % world
        works.append(dist.isend(full[to * n:][:n], group_dst=to, group=group))
        works.append(dist.irecv(received[(source - (source > me)) * n:][:n], group_src=source, group=group))

    def finish() -> None:
        copies = [full[me * n:][:n] if s == me else received[(s - (s > me)) * n:][:n] for s in range(world)]
        torch.add(copies[0], copies[1], out=out)
        for copy in copies[2:]:
            out.add_(copy)
        out.div_(world)

    handle = _Then(works, finish, keep=(received,))
    if not async_op:
        handle.wait()
        return None
    return handle


def _all_reduce_mean_quantized(shard: torch.Tensor, layout: QgzLayout,
                               group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
    """Hybrid sharding with qgZ: the mean of ``shard`` over the replicas, in place, moving
    blockwise codes (``layout.bits``, ``layout.block``) instead of the shard's dtype. ZeRO++'s
    quantized reduce (Wang et al. 2023, §3.3) carried over to MiCS's replica all-reduce
    (Zhang et al. 2022, §3): an all-reduce is a reduce-scatter then an all-gather, and both
    move codes.

    1. quantize the shard into one partition per replica (``layout``: ``QgzLayout(n, 1, R)``);
    2. all-to-all among the replicas: each receives every replica's codes of its partition;
    3. dequantize, sum in fp32 in replica order, times 1/replicas, requantize;
    4. all-gather the requantized partitions;
    5. dequantize every partition, this rank's own included, into ``shard``.

    Every replica dequantizes the same codes in step 5, so the replicas' shards stay equal,
    bit for bit, and their weights do not drift apart. The result carries two quantizations'
    error (steps 1 and 3), as qgZ's two legs do. A rank sends ``2 (R - 1)`` packed rows of
    ``ceil(n / R)`` elements' codes and scales, where the unquantized ring sends
    ``2 (R - 1) / R`` of the shard. Non-finite values come out as NaN in their blocks.

    Blocking on the host for gloo; on NCCL, called with the side stream current, it queues
    everything on the device and returns.

    Args:
        shard: 1-D fp32/fp16/bf16 tensor of ``n`` elements, this rank's gradient shard (the
            mean over its shard group).
        layout: ``QgzLayout(n, 1, R)`` with the codes' bits and block, ``R`` the replicas.
        group: The replica group (taken when the reduce was issued).

    Returns:
        The buffers it made (:meth:`Collectives.reduce_transient_nbytes` counts them), for a caller
        on NCCL to keep until its wait, as the memory ledger does.
    """
    replicas = layout.world
    packed = layout.packed()
    send = packed.empty(replicas, shard.device)
    reorder_quantize(shard, layout, nonfinite="propagate", out=packed.views(send))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    mine = packed.empty(1, shard.device)
    dequantize_reduce_requantize(*packed.views(received.view(replicas, 1, -1)), layout, multiplier=1 / replicas,
                                 out=packed.views(mine))
    rows = send  # step 1's rows are sent: their buffer takes the gathered ones
    _all_gather_tensor(rows.view(-1), mine.view(-1), group=group)
    whole = layout.part_numel * replicas == shard.numel()
    values = shard.view(replicas, -1) if whole else shard.new_empty(replicas, layout.part_numel)
    dequantize_reduce(*packed.views(rows.view(1, replicas, -1)), layout, dtype=shard.dtype, out=values)
    if not whole:
        shard.copy_(values.view(-1)[:shard.numel()])
    return (send, received, mine) if whole else (send, received, mine, values)


class Collectives:
    """Collectives over one data-parallel process group, sharded over all of it or (hybrid
    sharding) over groups of its ranks.

    Hybrid sharding (MiCS, Zhang et al. 2022, arXiv:2205.00119, §3; FSDP's ``HYBRID_SHARD``):
    the ranks form groups of ``shard_group_size`` consecutive ranks (by default a node), each of
    which holds one copy of the sharded state. Gathers and reduce-scatters run within the group;
    each gradient shard is then averaged across the groups (the replicas) by one all-reduce of the
    shard, so only ``1 / shard_group_size`` of the gradients crosses between groups and no
    parameter does. The control plane stays on every rank.

    Args:
        group: The process group; ``None`` means the default (world) group when
            ``torch.distributed`` is initialised, and a single local rank when it is not.
        ranks_per_node: Ranks on each node (numbered node by node), for the intra/inter-node split
            of the byte counts. ``None``: one node.
        hpz_partition_size: Build the hpZ secondary-partition groups of this many consecutive
            ranks (:meth:`all_gather_secondary`). ``None``: no hpZ.
        qwz_block: Elements per scale of :meth:`all_gather_quantized` (qwZ); ``None``: no qwZ.
        qgz_bits: Code width of :meth:`reduce_scatter_mean_quantized` (qgZ), 4 or 8; ``None``: no
            qgZ. Builds the intra- and inter-node groups. Under hybrid sharding (``shard_group_size``
            given) the reduce-scatter stays within the shard group at full precision and the
            all-reduce across the replicas moves these codes instead (:meth:`reduce_scatter_mean`;
            :attr:`replica_bits`); with one group nothing is quantized.
        block: Elements per scale of the qgZ codes.
        timeout: How long the collectives of the control, hpZ and qgZ groups wait for other ranks;
            pass the world group's (``None``: torch's default for a new group, 30 minutes for gloo,
            10 for NCCL). A rank set of hpZ or qgZ that is the whole world uses the world group
            itself when its timeout is this one (or this is ``None``).
        device: The compute device. On an accelerator, qgZ chains its two all-to-all legs on a
            side stream of it (:meth:`reduce_scatter_mean_quantized`).
        shard_group_size: Hybrid sharding: ranks per shard group. ``None`` (or the world size):
            shard over every rank.

    Attributes:
        local: The data plane moves bytes as local copies (a shard group of one rank; at world
            size 1 not with the debug switch ``ZINF_REAL_COLLECTIVES=1``).
        group: The data-parallel group (data plane, and the world of :attr:`rank` and
            :attr:`world_size`).
        shard_size: Ranks each flat group is sharded over: the world size, or the shard group's.
        shard_rank: This rank's index in its shard group (its shard of every flat group).
        replicas: How many shard groups hold the sharded state (1 unless hybrid).
        replica: This rank's shard group.
        replica_bits: Hybrid sharding over two groups or more with qgZ: the code width of the
            quantized all-reduce across the replicas (under hybrid sharding :attr:`qgz_bits` is
            ``None``: no reduce-scatter is quantized).
        control_group: A gloo group over the same ranks (control plane), ``None`` on one rank.
        topology: The :class:`~lightning_zinf.comm.topology.Topology` of nodes.
        hpz: The topology of the hpZ partition groups (a "node" is one group), or ``None``.
        rank_set_groups: The :class:`~lightning_zinf.comm.topology.RankSetGroups` hpZ and qgZ share
            (one process group per rank set), or ``None`` without them or on one rank.

    Raises:
        ValueError: a size that does not divide the world size; hpZ, qgZ or hybrid sharding over a
            group other than the world; hpZ with hybrid sharding.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        ranks_per_node: Optional[int] = None,
        hpz_partition_size: Optional[int] = None,
        qwz_block: Optional[int] = None,
        qgz_bits: Optional[int] = None,
        block: int = 256,
        timeout: Optional[timedelta] = None,
        device: Optional[torch.device] = None,
        shard_group_size: Optional[int] = None,
    ) -> None:
        self.qwz_block = qwz_block
        accelerated = device is not None and torch.device(device).type != "cpu"
        self._device = torch.device(device) if accelerated else None
        self._chain: Optional[torch.Stream] = torch.Stream(device=self._device) if accelerated else None
        self.qgz_bits, self.block = qgz_bits, block
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        # One rank moves its data-plane bytes as local copies, unless a debug run asks for the
        # real collectives (every engine feature through NCCL on a single GPU).
        self.local = self.world_size == 1 and not (self.distributed and real_collectives_forced())
        self.bytes = CommBytes()
        self.topology = Topology(self.world_size, self.rank, ranks_per_node or self.world_size)
        self.hpz: Optional[Topology] = None
        self._hpz_group: Optional[dist.ProcessGroup] = None
        self._nodes: Optional[NodeGroups] = None
        hybrid = shard_group_size is not None and shard_group_size != self.world_size
        hierarchical = hpz_partition_size is not None or qgz_bits is not None
        if (hierarchical or hybrid) and self.world_size > 1 and self.group is not dist.group.WORLD:
            # Their groups are built from world ranks.
            raise ValueError("hpZ, qgZ and hybrid sharding need the engine to partition over the world group "
                             "(group=None).")
        if hybrid and hpz_partition_size is not None:
            raise ValueError("hpZ does not combine with hybrid sharding (shard_group_size): its gathers stay within a "
                             "shard group already.")
        if hybrid:
            require_divisor("shard_group_size", shard_group_size, self.world_size,
                            "each group of that many consecutive ranks holds one copy of the sharded state",
                            "Pass one of those (normally the ranks per node).")
        if hpz_partition_size is not None:
            require_divisor("hpz_partition_size", hpz_partition_size, self.world_size,
                            "hpZ's secondary partitions are held by groups of that many consecutive ranks",
                            "Pass one of those (normally the ranks per node).")
        # Every argument is checked before the first group is made: a rank that raised would
        # otherwise leave its peers waiting in (or torn out of) that group's rendezvous.
        self.control_group: Optional[dist.ProcessGroup] = None
        if self.world_size > 1:
            # Over the world every rank calls this, so the group's name comes from the global count.
            # Over a sub-group only its ranks do (engines over different sub-groups need not build
            # their control groups in one global order); then every rank must have created the
            # same number of groups before, since a locally synchronised group is named after it.
            subgroup = self.group is not dist.group.WORLD
            self.control_group = dist.new_group(dist.get_process_group_ranks(self.group), backend="gloo",
                                                timeout=timeout, use_local_synchronization=subgroup)
        # Hybrid: qgZ's codes cross between the groups in the replicas' all-reduce, never in a
        # reduce-scatter, which stays within the group (with one group, nothing is quantized).
        self.replica_bits: Optional[int] = qgz_bits if hybrid else None
        if shard_group_size is not None:
            self.qgz_bits = qgz_bits = None
        # hpZ's, qgZ's and hybrid sharding's groups, one per rank set (on NCCL, one communicator per set).
        self.rank_set_groups = RankSetGroups(timeout) if (hierarchical or hybrid) and self.world_size > 1 else None
        self._shard_group: Optional[dist.ProcessGroup] = self.group
        self._replica_group: Optional[dist.ProcessGroup] = None
        self.shard_size, self.shard_rank, self.replicas, self.replica = self.world_size, self.rank, 1, 0
        self._shard_peers = list(range(self.world_size))  # ranks of ``group`` sharing this rank's shards
        self._replica_peers = [self.rank]  # world ranks holding this rank's shards
        if hybrid:
            assert shard_group_size is not None
            shards = Topology(self.world_size, self.rank, shard_group_size)
            groups = NodeGroups(shards, groups=self.rank_set_groups)
            self._shard_group, self._replica_group = groups.intra, groups.inter
            self.shard_size, self.shard_rank = shard_group_size, shards.local_rank
            self.replicas, self.replica = shards.nodes, shards.node
            self._shard_peers = shards.node_ranks(shards.node)
            self._replica_peers = shards.peer_ranks(shards.local_rank)
            # A shard group of one rank gathers nothing: its data plane is local copies.
            self.local = shard_group_size == 1
        self._across = _Sequence() if self._replica_group is not None else None
        #: The shard group is on one node (gloo's in-place forms then apply).
        self._shard_one_node = len({r // self.topology.ranks_per_node for r in self._shard_peers}) == 1
        if hpz_partition_size is not None:
            self.hpz = Topology(self.world_size, self.rank, hpz_partition_size)
            if self.world_size > 1:
                self._hpz_group = NodeGroups(self.hpz, with_inter=False, groups=self.rank_set_groups).intra
            elif not self.local:
                self._hpz_group = self.group
        if qgz_bits is not None and self.world_size > 1:
            self._nodes = NodeGroups(self.topology, groups=self.rank_set_groups)
        elif qgz_bits is not None and not self.local:
            self._nodes = NodeGroups.of_one_rank(self.topology, self.group)
        hold_groups(self)

    def drop_groups(self) -> None:
        """Let go of every process group, for good (at a normal exit: :mod:`lightning_zinf.comm.exit`)."""
        self.group = self.control_group = self._hpz_group = self._shard_group = self._replica_group = None
        self._nodes = self.rank_set_groups = None

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """Gather every rank's ``shard`` into ``out``, rank r's at ``out[r*n:(r+1)*n]``.

        Args:
            out: 1-D tensor of ``shard_size * n`` elements, same dtype and device as ``shard``
                (ranks of the shard group).
            shard: 1-D tensor of ``n`` elements.
            async_op: Return before the data has arrived; call ``wait()`` on the handle.

        Returns:
            A handle whose ``wait()`` returns when ``out`` is filled.
        """
        self.bytes.gathered += (out.numel() - shard.numel()) * out.element_size()
        self.bytes.add_split(self.topology.split_bytes(self._shard_peers, shard.numel() * shard.element_size()))
        if self.local:
            out.copy_(shard)
            return _Done()
        work = _all_gather_flat(out, shard, self._shard_group, self._shard_one_node, async_op=async_op)
        return work if async_op else _Done()

    def all_gather_coalesced(self, outs: list[torch.Tensor], shards: list[torch.Tensor],
                             async_op: bool = False) -> Handle:
        """Gather several flat buffers by one collective: for each ``i``, every rank's
        ``shards[i]`` into ``outs[i]`` as :meth:`all_gather` would (rank r's at
        ``outs[i][r*n_i:(r+1)*n_i]``), counted in :attr:`bytes` as those gathers would be.

        Each rank packs its shards end to end (cast to the outputs' dtype on the way), one
        all-gather moves the packed buffers (rank-major: rank 0's shards, then rank 1's, ...), and
        ``wait()`` copies each group's column of it into its output. Many small gathers (the
        persistent units after every step) then pay one collective's latency instead of one each,
        for two local copies of their bytes and transient buffers of
        :meth:`coalesced_nbytes`. On one rank (:attr:`local`), one copy per shard into its output.
        The packing and the copy-out are one multi-tensor kernel each on an accelerator
        (``torch._foreach_copy_``; ``torch.split_with_sizes_copy``, FSDP2's copy-out).

        Args:
            outs: 1-D tensors of ``shard_size * n_i`` elements, all of one dtype and device.
            shards: 1-D tensors of ``n_i`` elements on that device, all of one dtype (any).
            async_op: Return before the data has arrived; ``wait()`` on the handle fills ``outs``.

        Returns:
            A handle whose ``wait()`` returns when every ``outs[i]`` is filled.
        """
        world, itemsize = self.shard_size, outs[0].element_size()
        sizes = [shard.numel() for shard in shards]
        for out, n in zip(outs, sizes):
            self.bytes.gathered += (out.numel() - n) * itemsize
            self.bytes.add_split(self.topology.split_bytes(self._shard_peers, n * itemsize))
        if self.local:
            torch._foreach_copy_(outs, shards)
            return _Done()
        total = sum(sizes)
        packed = outs[0].new_empty(total)
        torch._foreach_copy_(list(packed.split(sizes)), shards)
        gathered = outs[0].new_empty(world * total)
        work = _all_gather_flat(gathered, packed, self._shard_group, self._shard_one_node, async_op=True)

        def unpack() -> None:
            torch.split_with_sizes_copy(gathered.view(world, total), sizes, dim=1,
                                        out=[out.view(world, n) for out, n in zip(outs, sizes)])

        handle = _Then([work], unpack, keep=(packed, gathered))
        if not async_op:
            handle.wait()
        return handle

    def coalesced_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of the transient buffers :meth:`all_gather_coalesced` allocates (until its
        ``wait()``) for shards of ``numel`` elements in all, gathered in ``dtype``: the packed
        shards and the packed gather (``(world_size + 1) * numel`` elements); 0 on one rank."""
        return 0 if self.local else (self.shard_size + 1) * numel * dtype.itemsize

    def all_gather_quantized(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                             row: Optional[torch.Tensor] = None) -> Handle:
        """qwZ's gather (ZeRO++ §3.1): quantize ``shard`` blockwise to INT8 (one fp32 scale per
        ``qwz_block`` elements) straight into one packed row (:class:`~triton_kernels.PackedRows`:
        codes, then scales), all-gather the rows in one collective, and dequantize every rank's
        part from the gathered rows in place, this rank's own included (so all ranks hold
        identical values), into ``out`` in its dtype. ``bytes`` counts the rows, padding included.

        Args:
            out: 1-D tensor of ``shard_size * n`` elements (fp32, fp16 or bf16).
            shard: 1-D tensor of ``n`` elements, ``out``'s dtype and device.
            async_op: Return before the data has arrived; ``wait()`` on the handle dequantizes.
            row: ``shard``'s packed row made earlier by :meth:`quantized_row` (a generation phase
                keeps it while the shard is unchanged): sent as it is, without quantizing again;
                ``shard`` is then not read (it may be empty: offloaded, not swapped in).

        Raises:
            RuntimeError: built without ``qwz_block``.
        """
        if self.qwz_block is None:
            raise RuntimeError("all_gather_quantized needs Collectives(qwz_block=...).")
        if row is None:
            row = self.quantized_row(shard)
        packed = PackedRows.of(out.numel() // self.shard_size, 8, self.qwz_block)
        return self._all_gather_packed(out, row, packed, self.qwz_block, async_op)

    def quantized_row(self, shard: torch.Tensor) -> torch.Tensor:
        """qwZ's packed row of ``shard`` (1-D, ``n`` elements): its INT8 blockwise codes, then its
        fp32 scales (one per ``qwz_block`` elements), ``[1, PackedRows.of(n, 8, qwz_block).row_bytes]``
        uint8 on ``shard``'s device; what :meth:`all_gather_quantized` sends.

        Raises:
            RuntimeError: built without ``qwz_block``.
        """
        if self.qwz_block is None:
            raise RuntimeError("quantized_row needs Collectives(qwz_block=...).")
        packed = PackedRows.of(shard.numel(), 8, self.qwz_block)
        row = packed.empty(1, shard.device)
        # A NaN or Inf weight dequantizes to NaN and shows in the loss, as it would unquantized.
        quantize(shard.view(1, -1), 8, self.qwz_block, nonfinite="propagate", out=packed.views(row))
        return row

    def all_gather_codes(self, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int,
                         async_op: bool = False) -> Handle:
        """All-gather every rank's blockwise codes and scales (as :func:`triton_kernels.quantize`
        made them from an ``n``-element shard) and dequantize them, in rank order, into ``out``
        (``shard_size * n`` elements, in its dtype). The gather of frozen weights stored quantized:
        codes and scales are copied into one packed row (:class:`~triton_kernels.PackedRows`) and
        gathered in one collective; ``bytes`` counts the rows, padding included.

        Args:
            out: 1-D fp32/fp16/bf16 tensor of ``shard_size * n`` elements.
            codes: This rank's codes (``code_cols(n, bits)``).
            scales: This rank's fp32 scales (``ceil(n / block)``).
            bits: The codes' format: 8 or 4 bits.
            block: The codes' format: elements per scale.
            async_op: Return before the data has arrived; ``wait()`` on the handle dequantizes.
        """
        packed = PackedRows.of(out.numel() // self.shard_size, bits, block)
        row = packed.empty(1, codes.device)
        row_codes, row_scales = packed.views(row)
        row_codes.copy_(codes.view(1, -1))
        row_scales.copy_(scales.view(1, -1))
        return self._all_gather_packed(out, row, packed, block, async_op)

    def _all_gather_packed(self, out: torch.Tensor, row: torch.Tensor, packed: PackedRows, block: int,
                           async_op: bool) -> Handle:
        """Gather every rank's packed ``row`` (``[1, packed.row_bytes]`` uint8) in one collective and
        dequantize the gathered rows, read in place, into ``out`` (``shard_size * n`` elements)."""
        world = self.shard_size
        n = out.numel() // world
        self.bytes.gathered += (world - 1) * packed.row_bytes
        self.bytes.add_split(self.topology.split_bytes(self._shard_peers, packed.row_bytes))
        if self.local:
            rows, works = row, []
        else:
            rows = packed.empty(world, row.device)
            works = [_all_gather_flat(rows.view(-1), row.view(-1), self._shard_group, self._shard_one_node,
                                      async_op=True)]

        def dequantize_into_out() -> None:
            all_codes, all_scales = packed.views(rows)
            dequantize(all_codes, all_scales, n, packed.bits, block, dtype=out.dtype, out=out.view(world, n))

        handle = _Then(works, dequantize_into_out, keep=(row, rows))
        if not async_op:
            handle.wait()
        return handle

    def all_gather_secondary(self, out: torch.Tensor, secondary: torch.Tensor, async_op: bool = False) -> Handle:
        """hpZ's gather: all-gather the secondary partitions of this rank's partition group into
        ``out``, local rank l's at ``out[l*n:(l+1)*n]`` (ZeRO++ §3.2).

        Args:
            out: 1-D tensor of ``hpz_partition_size * n`` elements, same dtype and device as ``secondary``.
            secondary: 1-D tensor of ``n`` elements: this rank's secondary partition.
            async_op: Return before the data has arrived; call ``wait()`` on the handle.

        Raises:
            RuntimeError: built without ``hpz_partition_size``.
        """
        if self.hpz is None:
            raise RuntimeError("all_gather_secondary needs Collectives(hpz_partition_size=...).")
        self.bytes.gathered += (out.numel() - secondary.numel()) * out.element_size()
        peers = self.hpz.node_ranks(self.hpz.node)
        self.bytes.add_split(self.topology.split_bytes(peers, secondary.numel() * secondary.element_size()))
        if self._hpz_group is None:
            out.copy_(secondary)
            return _Done()
        one_node = len({r // self.topology.ranks_per_node for r in peers}) == 1
        work = _all_gather_flat(out, secondary, self._hpz_group, one_node, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """Average ``full`` over ranks and keep this rank's slice in ``out``. Under hybrid
        sharding, the mean over the shard group's ranks by a reduce-scatter, then over the replicas
        by an all-reduce of the slice (a sum, then a division by the replicas: gloo has no mean);
        with :attr:`replica_bits`, by the quantized all-reduce of :func:`_all_reduce_mean_quantized`.

        Args:
            out: 1-D tensor of ``n`` elements: receives ``mean_over_ranks(full)[r*n:(r+1)*n]``
                (``r`` this rank's :attr:`shard_rank`).
            full: 1-D tensor of ``shard_size * n`` elements, same dtype and device as ``out``; its
                values are undefined afterwards (a collective may use it as scratch).
            async_op: Return before the result has arrived; call ``wait()`` on the handle.

        Returns:
            A handle whose ``wait()`` returns when ``out`` is filled.
        """
        nbytes = out.numel() * out.element_size()
        self.bytes.reduce_scattered += (full.numel() - out.numel()) * full.element_size()
        self.bytes.add_split(self.topology.split_bytes(self._shard_peers, nbytes))
        if self.local:
            out.copy_(full)  # nothing to do when they are one tensor (torch skips a self-copy)
            work: Optional[Handle] = None
        else:
            work = _reduce_scatter_mean_flat(out, full, self._shard_group, self._shard_one_node, async_op=True)
        if self._replica_group is None:
            if work is not None and not async_op:
                work.wait()
            return work if work is not None and async_op else _Done()
        replicas, group = self.replicas, self._replica_group
        layout = self._replica_layout(out.numel(), out.element_size())
        per_peer = 2 * layout.packed().row_bytes if layout is not None else 2 * nbytes // replicas
        self.bytes.all_reduced += (replicas - 1) * per_peer
        self.bytes.add_split(self.topology.split_bytes(self._replica_peers, per_peer))

        def across_replicas() -> tuple[torch.Tensor, ...]:
            if layout is not None:
                return _all_reduce_mean_quantized(out, layout, group)
            # gloo has no mean: a sum, divided first where a 16-bit float's range could overflow.
            if out.dtype == torch.float16:
                out.div_(replicas)
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
            if out.dtype != torch.float16:
                out.div_(replicas)
            return ()

        on_nccl = self._chain is not None and out.device.type != "cpu" and dist.get_backend(group) == "nccl"
        if on_nccl and layout is not None:
            # NCCL, quantized: the whole chain (reduce-scatter's wait, quantize, both legs,
            # dequantize) is queued at once on the side stream; its NCCL calls wait on the device
            # only. ``wait()`` orders the compute stream after the chain's last kernel, which wrote
            # ``out``; the chain's buffers are allocated on the side stream and used only there.
            self._chain.wait_stream(torch.accelerator.current_stream(self._device))
            with self._chain:
                if work is not None:
                    work.wait()
                made = across_replicas()
            chained = torch.Event(device=self._device)
            chained.record(self._chain)
            # ``out`` comes from the compute stream: kept to the wait, then recorded on the stream
            # that waits, whatever the caller does with it. The chain's own buffers are kept to the
            # wait too, so the allocator holds them as long as the memory ledger counts them.
            handle: Handle = _Then([], lambda: torch.accelerator.current_stream(self._device).wait_event(chained),
                                   keep=(out, *made))
        elif on_nccl:
            # NCCL: the all-reduce is queued at once on the side stream, behind the reduce-scatter
            # on the device (the side stream waits for the compute stream, then for the
            # reduce-scatter), so it overlaps the next units' backward as the reduce-scatter does;
            # ``wait()`` orders the compute stream after it. ``out`` and ``full`` come from the
            # compute stream and stay referenced by the works until then.
            self._chain.wait_stream(torch.accelerator.current_stream(self._device))
            with self._chain:
                if work is not None:
                    work.wait()
                reduced = dist.all_reduce(out, op=dist.ReduceOp.AVG, group=group, async_op=True)
            handle = _Then([reduced], lambda: None)
        elif out.device.type == "cpu":
            # gloo: the reduce-scatter's wait and the all-reduce on the sequence's thread.
            def chain() -> None:
                if work is not None:
                    work.wait()
                across_replicas()

            assert self._across is not None  # built with the replica group
            handle = self._across.submit(chain)
        else:
            # Device tensors over gloo (two ranks sharing a GPU in the tests): issued once the
            # reduce-scatter is waited for.
            handle = _Then([work] if work is not None else [], across_replicas)
        if not async_op:
            handle.wait()
        return handle

    def _replica_layout(self, n: int, itemsize: int) -> Optional[QgzLayout]:
        # The quantized all-reduce's layout for a shard of n elements, or None for the unquantized
        # one: codes only where they send fewer bytes (a shard of a few elements pads each
        # partition to whole blocks). The same choice on every replica (it depends on n, R and the
        # dtype).
        if self.replica_bits is None:
            return None
        layout = QgzLayout(n, 1, self.replicas, bits=self.replica_bits, block=self.block)
        return layout if 2 * layout.packed().row_bytes < 2 * n * itemsize // self.replicas else None

    def _qgz_layout(self, n: int) -> QgzLayout:
        # qgZ's cut of a flat gradient of world_size * n elements into one partition per rank.
        topo = self.topology
        return QgzLayout(n * self.world_size, topo.nodes, topo.ranks_per_node, bits=self.qgz_bits,
                         block=self.block, part_numel=n)

    def reduce_transient_nbytes(self, n: int, dtype: torch.dtype) -> int:
        """Bytes the collectives allocate themselves for one gradient reduce of a shard of ``n``
        elements of ``dtype`` (:meth:`reduce_scatter_mean` or :meth:`reduce_scatter_mean_quantized`,
        as the engine calls them), alive until its ``wait()``, beyond its ``out`` and ``full``:
        qgZ's packed rows (the rows quantized, received and reduced on each leg), or under hybrid
        sharding with :attr:`replica_bits` the quantized all-reduce's (``2 R + 1`` rows, and a
        shard of ``R`` whole partitions where ``n`` is not one). The unquantized reduce-scatter
        within one node on gloo receives its peers' copies of this rank's slice into ``(W - 1) n``
        elements of its own where ``W n`` elements are 1 MiB and more
        (:func:`_reduce_scatter_mean_flat`). Not counted: what gloo and NCCL allocate inside their
        own libraries (gloo's flat reduce-scatter across nodes copies its whole input there)."""
        return self._scratch_nbytes(n, dtype) + self._codes_nbytes(n, dtype)

    def _scratch_nbytes(self, n: int, dtype: torch.dtype) -> int:
        # The shard group's unquantized reduce-scatter (qgZ replaces it; one rank has none).
        if self.qgz_bits is not None or self.local or self._shard_group is None:
            return 0
        device = self._device or torch.device("cpu")
        if not _gloo_in_place(self._shard_group, device, self.shard_size * n * dtype.itemsize, self._shard_one_node):
            return 0
        return gloo_received_nbytes(self.shard_size, n * dtype.itemsize)

    def _codes_nbytes(self, n: int, dtype: torch.dtype) -> int:
        if self.qgz_bits is not None:
            layout = self._qgz_layout(n)
            intra = self._nodes is not None and self._nodes.intra is not None
            inter = self._nodes is not None and self._nodes.inter is not None
            rows = layout.world * (1 + intra) + self.topology.nodes * (1 + inter)
            return rows * layout.packed().row_bytes
        if self._replica_group is None:
            return 0
        layout = self._replica_layout(n, dtype.itemsize)
        if layout is None:
            return 0
        rows = (2 * self.replicas + 1) * layout.packed().row_bytes
        whole = layout.part_numel * self.replicas == n  # else dequantized into a buffer of its own
        return rows + (0 if whole else self.replicas * layout.part_numel * dtype.itemsize)

    def reduce_scatter_mean_quantized(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """qgZ (ZeRO++ §3.3): the mean over ranks of ``full``, this rank's slice into ``out``, by a
        hierarchical all-to-all of blockwise quantized codes (``qgz_bits``, ``block``):

        1. reorder + quantize ``full`` into one partition per rank, in slot order;
        2. intra-node all-to-all: local peer ``k`` receives the partitions of the ranks with local
           rank ``k`` (one per node);
        3. dequantize, sum over the node's ranks in fp32, requantize;
        4. inter-node all-to-all among the ranks with this local rank: each receives its own
           partition's node sums;
        5. dequantize, sum over nodes, times 1/W, into ``out``.

        Steps 1-2 start at once. On an accelerator steps 3-4 are queued at once too, on a side
        stream that waits for step 2 on the device, so the inter-node leg starts as soon as the
        intra-node one is done, without the host or the compute stream waiting; ``wait()`` on the
        handle orders the compute stream after step 4 and queues step 5. On the CPU (gloo waits
        block the host) ``wait()`` runs 3-5. Any ``n`` and any number of nodes work (no fallback
        path). Non-finite gradients come out as NaN.

        Each leg is one all-to-all of packed rows (:class:`~triton_kernels.PackedRows`: a
        partition's codes, then its scales), which steps 1 and 3 write and steps 3 and 5 read in
        place; ``bytes`` counts the rows sent, padding included.

        Args:
            out: 1-D fp32 (or fp16/bf16) tensor of ``n`` elements.
            full: 1-D fp32/fp16/bf16 tensor of ``world_size * n`` elements.
            async_op: Return before the result is in ``out``; call ``wait()`` on the handle.

        Raises:
            RuntimeError: built without ``qgz_bits``.
        """
        if self.qgz_bits is None:
            raise RuntimeError("reduce_scatter_mean_quantized needs Collectives(qgz_bits=...).")
        topo = self.topology
        layout = self._qgz_layout(out.numel())
        packed = layout.packed()
        send = packed.empty(layout.world, full.device)  # [W] rows in slot order: codes, then scales
        reorder_quantize(full, layout, nonfinite="propagate", out=packed.views(send))
        row = packed.row_bytes
        nodes, local_peers = topo.nodes, topo.ranks_per_node
        sent_intra, sent_inter = (local_peers - 1) * nodes * row, (nodes - 1) * row
        self.bytes.reduce_scattered += sent_intra + sent_inter
        self.bytes.add_split((sent_intra, sent_inter))
        # One all-to-all per leg: each row carries its codes and scales.
        if self._nodes is not None and self._nodes.intra is not None:
            received = torch.empty_like(send)
            works = [dist.all_to_all_single(received, send, group=self._nodes.intra, async_op=True)]
        else:
            received, works = send, []

        def inter_node() -> tuple[torch.Tensor, list[Any]]:
            """Steps 3-4 (after step 2's works have been waited for): the packed rows of this rank's
            own partition, and the works that deliver them."""
            partial = packed.empty(nodes, full.device)
            dequantize_reduce_requantize(*packed.views(received.view(local_peers, nodes, -1)), layout,
                                         out=packed.views(partial))
            if self._nodes is None or self._nodes.inter is None:
                return partial, []
            mine = torch.empty_like(partial)
            return mine, [dist.all_to_all_single(mine, partial, group=self._nodes.inter, async_op=True)]

        def dequantize_mine(mine: torch.Tensor) -> None:
            dequantize_reduce(*packed.views(mine), layout, multiplier=1 / self.world_size, dtype=out.dtype, out=out)

        if self._chain is None:
            def finish() -> None:
                mine, inter = inter_node()
                for work in inter:
                    work.wait()
                dequantize_mine(mine)

            handle = _Then(works, finish)
        else:
            # Memory allocated on the side stream is read by the compute stream in step 5 and freed
            # after it; the next chain starts by waiting for the compute stream, so it is not reused
            # early. NCCL's works wait, when waited for, on the device only.
            self._chain.wait_stream(torch.accelerator.current_stream(self._device))
            with self._chain:
                for work in works:
                    work.wait()
                mine, inter = inter_node()
            chained = torch.Event(device=self._device)
            chained.record(self._chain)

            def finish_on_device() -> None:
                # Step 3's output (one node: no inter-node works to wait for) is on the side stream.
                torch.accelerator.current_stream(self._device).wait_event(chained)
                dequantize_mine(mine)

            # The intra-node leg's buffers were released by NCCL at the chain's wait; the compute
            # stream frees them only after waiting for the chain (which waited for that leg). Step
            # 3's output, the chain's memory, is recorded on the stream that waits too, whichever
            # stream issues the next reduce.
            handle = _Then(inter, finish_on_device, keep=(send, received, mine))
        if not async_op:
            handle.wait()
        return handle

    def _group_for(self, tensor: torch.Tensor) -> Optional[dist.ProcessGroup]:
        # NCCL takes device tensors only; host tensors go over gloo.
        return self.control_group if tensor.device.type == "cpu" else self.group

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it. A tensor in host memory goes over the
        control group, one on the device over the data group."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group_for(tensor))
        return tensor

    def sum_over_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank quantity of this rank's shards (a squared gradient norm) over one copy of
        the sharded state, in place, and return it: :meth:`all_reduce_sum` over the ranks, divided
        by :attr:`replicas` (every replica holds the same shards, the all-reduce's identical result)."""
        self.all_reduce_sum(tensor)
        if self.replicas > 1:
            tensor.div_(self.replicas)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s values (group rank) and return it.
        A tensor in host memory (an RNG state) goes over the control group, one on the device (a
        parameter buffer) over the data group."""
        if self.world_size > 1:
            group = self._group_for(tensor)
            dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this call (host-side; queued device work
        is not waited for)."""
        if self.world_size > 1:
            dist.barrier(group=self.control_group)

    # The control plane's checks (agreement, negotiation, trace validation) all send one message
    # shape, a row per rank: whatever call each rank is in, two ranks' calls pair, and the row's tag
    # says which call each made (a rank at a pass start and one about to gather then see that,
    # instead of gloo pairing collectives of other sizes).
    EQUAL, EQUAL_EACH, ROUND, FLAG = 1, 2, 3, 4
    _ROW = 8  # tag and seven values: a flag and the payload of a pass start (RankAgreement.begin_pass)

    def exchange(self, tag: int, values: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's ``(tag, *values)`` (at most seven signed 64-bit values, zero-padded),
        indexed by rank: one all-gather of a host row on the control group. Blocks the host for one
        round trip between the ranks, never on the device. (An all-gather, not a sum of one row per
        rank: gloo's all-reduce of a few bytes takes two to three times as long, 1.2-1.6 ms against
        0.4-0.8 ms at 2 ranks on a 2-core machine.)"""
        if len(values) > self._ROW - 1:
            raise ValueError(f"exchange: at most {self._ROW - 1} values, got {len(values)}")
        row = torch.tensor([tag, *values] + [0] * (self._ROW - 1 - len(values)), dtype=torch.int64)
        if self.world_size == 1:
            return [tuple(row.tolist())]
        rows = torch.empty(self.world_size * self._ROW, dtype=torch.int64)
        _all_gather_tensor(rows, row, group=self.control_group)
        return [tuple(r) for r in rows.view(self.world_size, self._ROW).tolist()]

    def all_equal(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (a signed 64-bit integer) in this call: one
        :meth:`exchange`. ``False`` also when another rank is in another control call."""
        return len(set(self.exchange(self.EQUAL, [value]))) == 1

    def all_equal_each(self, values: list[int]) -> list[bool]:
        """Element ``i`` is whether every rank passed the same ``values[i]`` (at most three): one
        :meth:`exchange`; all ``False`` when another rank is in another control call."""
        rows = self.exchange(self.EQUAL_EACH, values)
        if len({r[0] for r in rows}) > 1:
            return [False] * len(values)
        return [len({r[1 + i] for r in rows}) == 1 for i in range(len(values))]

    def all_gather_ints(self, values: list[int]) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (at most three; a negotiation round,
        :mod:`lightning_zinf.engine.negotiation`), indexed by rank, or ``None`` for a rank in
        another control call: one :meth:`exchange`."""
        rows = self.exchange(self.ROUND, values)
        return [r[1:1 + len(values)] if r[0] == self.ROUND else None for r in rows]  # type: ignore[misc]

    def flag_with(self, flag: bool, payload: Sequence[int]) -> Optional[tuple[bool, list[tuple[int, ...]]]]:
        """Whether ``flag`` is true on some rank, and every rank's ``payload`` (at most six signed
        64-bit values), in one :meth:`exchange`: what a waypoint's check and the checks that follow
        it send at once (:meth:`Negotiation.waypoint_with
        <lightning_zinf.engine.negotiation.Negotiation.waypoint_with>`).

        Returns:
            ``(flag on some rank, payloads)``, the payloads a list indexed by rank of tuples of
            ``len(payload)`` ints (zeros where a rank sent a shorter one); ``None`` when another
            rank is in another control call (its tag differs).
        """
        rows = self.exchange(self.FLAG, [int(flag), *payload])
        if any(r[0] != self.FLAG for r in rows):
            return None
        return any(r[1] for r in rows), [r[2:2 + len(payload)] for r in rows]

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Element ``i`` is whether ``flags[i]`` is true on some rank: one all-reduce (MAX) of a
        uint8 host tensor on the control group, read back once."""
        if self.world_size == 1 or not flags:
            return list(flags)
        agreed = torch.tensor(flags, dtype=torch.uint8)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.control_group)
        return [bool(f) for f in agreed.tolist()]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank (small control data: trace hashes, checksums),
        over the control group."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out
