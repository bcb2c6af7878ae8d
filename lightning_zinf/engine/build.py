"""Construction: a planned model becomes units of flat groups, sharded across the ranks.

:func:`~lightning_zinf.engine.partition.plan_units` says which parameters form each unit;
:class:`UnitBuilder` materialises them (a model on the meta device is initialised unit by unit, from
rank 0's random state, so no rank ever holds it whole), flattens each unit's parameters into one
:class:`~lightning_zinf.engine.flat.FlatGroup` per dtype and ``requires_grad``, keeps this rank's
shard of each on its tier (device, CPU or an NVMe swap file; frozen ones stored quantized with
``frozen_bits``), and marks small units persistent (ZeRO-3's persistence threshold, Rajbhandari et
al., SC'20, §5.3). The helpers below check the ZeRO++ group sizes and open the NVMe swap space
before any shard exists.
"""

from __future__ import annotations

import multiprocessing.util
import os
from typing import Collection, Optional

import torch
from torch import nn

from lightning_zinf.comm import Collectives
from lightning_zinf.comm.topology import require_divisor
from lightning_zinf.config import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroPPConfig
from lightning_zinf.engine.buffers import GatherPool
from lightning_zinf.engine.flat import FlatGroup, shard_numel
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.construction import Replayer, recorder_of
from lightning_zinf.engine.partition import UnitSpec, materialize, parameter_slots, parent_modules, persistent_units
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.engine.units import Unit
from lightning_zinf.offload.host import DEVICE_STATE_BYTES
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.preflight import ensure_space
from lightning_zinf.offload.stale import reclaim_stale_folders, swap_folder_name
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapped import SwapSpace
from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["UnitBuilder", "check_group_sizes", "make_swap_space", "split_by_kind", "stored_quantized", "swapped_shards"]


class UnitBuilder:
    """Builds an engine's units from the plan.

    Args:
        module: The model (parameters real, or on the meta device).
        comm: The engine's collectives (broadcasts of rank 0's values and random state).
        device: The compute device (gathered parameters, and shards unless offloaded).
        shard_device: Where parameter shards live (the CPU with parameter offload).
        mixed_precision: The storage and compute dtypes of each group.
        zero_pp: ``frozen_bits`` and ``block``: frozen groups stored quantized.
        persistence_threshold: Units of at most this many elements stay gathered, smallest first
            while all of them hold at most ``persistence_limit`` elements
            (:func:`~lightning_zinf.engine.partition.persistent_units`).
        persistence_limit: See ``persistence_threshold``.
        ledger: The engine's ledger (groups account their buffers there).
        transfers: The engine's host/device copy queue.
        gathers: The engine's gather-buffer memory (shared by its groups).
        param_offload: NVMe parameter offload (each group's shard gets a swap record, frozen ones too,
            except groups stored quantized), or None.
        host_copies: Parameter offload to the ``cpu`` tier: groups keep their 16-bit compute copies
            in host memory (:class:`FlatGroup`'s ``host_copy``).
        device_copies: Optimizer offload (``cpu`` or ``nvme`` tier) without parameter offload:
            trainable groups keep their fp32 shard on the host (the ``cpu`` tier's master; beside
            the ``nvme`` tier's swapped master, the values exact reads read) and a 16-bit compute
            copy on the device (:class:`FlatGroup`'s ``device_copy``).
        device_state_bytes: With ``device_copies`` under the ``cpu`` tier: ``OffloadConfig.device_bytes``.
            The first trainable groups, as they are made, until the next does not fit at
            :data:`~lightning_zinf.offload.host.DEVICE_STATE_BYTES` per shard element, are placed
            as without offload instead (no device copy) and marked
            :attr:`FlatGroup.optimizer_on_device`.
        preloaded: Qualified names of parameters the caller loads right after construction: built on
            the meta device, they get memory but no initialisation.
    """

    def __init__(self, module: nn.Module, comm: Collectives, *, device: torch.device, shard_device: torch.device,
                 mixed_precision: MixedPrecisionConfig, zero_pp: ZeroPPConfig, persistence_threshold: int,
                 persistence_limit: int = PrefetchConfig.persistence_limit,
                 ledger: MemoryLedger, transfers: Transfers, param_offload: Optional[ParamOffload],
                 host_copies: bool = False, device_copies: bool = False, device_state_bytes: int = 0,
                 preloaded: Collection[str] = (), gathers: Optional[GatherPool] = None) -> None:
        self.module = module
        self.comm = comm
        self.device = device
        self.shard_device = shard_device
        self.mixed_precision = mixed_precision
        self.zero_pp = zero_pp
        self.persistence_threshold = persistence_threshold
        self.persistence_limit = persistence_limit
        self.ledger = ledger
        self.transfers = transfers
        self.gathers = gathers or GatherPool(device, ledger)
        self.param_offload = param_offload
        self.host_copies = host_copies
        self.device_copies = device_copies
        self._device_room = device_state_bytes  # left for groups stepped on the device; < 0: one did not fit
        self.preloaded = preloaded
        self._created_groups = 0

    def build(self, specs: list[UnitSpec]) -> list[Unit]:
        """One :class:`Unit` per spec, in plan order (the trace's unit ids).

        A model built on the meta device is materialised unit by unit
        (:func:`~lightning_zinf.engine.partition.materialize`): recorded parameters with the values
        eager construction gives them on rank 0 (every rank replays rank 0's recorded random states;
        a unit whose values come from tensors outside construction, or all of them if the ranks
        recorded different draws, takes rank 0's values by broadcast), others by their module's
        initialisation route from rank 0's random state.

        Raises:
            NotReproducible: a recorded value cannot be rebuilt (names the parameter and why).
            ValueError: a module with unrecorded meta parameters has no initialisation route.
        """
        on_meta = any(p.is_meta for spec in specs for _, p in spec.params)
        names = {m: n for n, m in self.module.named_modules()}
        slots = parameter_slots(self.module) if on_meta else {}
        parents = parent_modules(self.module) if on_meta else {}
        built_real = frozenset(id(p) for p in self.module.parameters() if not p.is_meta)
        to_load = set(self.preloaded)
        preloaded = frozenset(id(p) for n, p in self.module.named_parameters(remove_duplicate=False)
                              if p.is_meta and n in to_load)
        shapes = {id(p): p.shape for p in self.module.parameters()}
        own_rng = torch.get_rng_state()
        replayer = Replayer()
        same_draws = True
        if on_meta:
            recorders = {id(r): r for _, p in self.module.named_parameters() if (r := recorder_of(p)) is not None}
            for recorder in recorders.values():  # collective: every rank built the model the same way
                same_draws = recorder.adopt_rank0_draws(self.comm.broadcast, self.comm.all_equal) and same_draws
            # The initialisation routes of parameters built on the meta device draw from rank 0's state.
            torch.set_rng_state(self.comm.broadcast(own_rng.clone()))
        units: list[Optional[Unit]] = [None] * len(specs)
        persistent = persistent_units(specs, self.persistence_threshold, self.persistence_limit)
        try:
            for index, spec in enumerate(specs):
                outside = False
                if on_meta:
                    outside = materialize(spec, names, slots, shapes, parents, replayer, preloaded)
                # Values built for real (in __init__, or loaded) or from outside construction are rank
                # 0's, as DDP broadcasts them; the rest are drawn alike on every rank.
                rank0 = outside or not same_draws
                groups = [self._flat_group(members, rank0 or any(id(p) in built_real for _, p in members))
                          for members in split_by_kind(spec.params)]
                units[index] = Unit(index, spec.name, groups, persistent[index], spec.module, run=spec.run)
        finally:
            replayer.close()
            torch.set_rng_state(own_rng)
        return units  # type: ignore[return-value]  # every index filled

    def _fits_on_device(self, numel: int) -> bool:
        """Whether the next trainable group (``numel`` shard elements) is stepped on the device:
        it and the ones before it fit ``device_state_bytes``, and none before it did not."""
        cost = DEVICE_STATE_BYTES * numel
        if not 0 <= cost <= self._device_room:
            self._device_room = -1  # the first groups only: once one does not fit, none after it does
            return False
        self._device_room -= cost
        return True

    def _flat_group(self, members: list[tuple[str, nn.Parameter]], from_rank0: bool) -> FlatGroup:
        params = [p for _, p in members]
        # Replayed values are where eager construction made them (an accelerator, or the CPU).
        source = torch.cat([p.detach().reshape(-1).to(self.device) for p in params])
        if from_rank0:
            self.comm.broadcast(source)  # ranks must shard identical values
        on_device = self.device_copies and params[0].requires_grad and self._fits_on_device(
            shard_numel(sum(p.numel() for p in params), self.comm.shard_size))
        group = FlatGroup([n for n, _ in members], params, source, self.comm, self.device, self.shard_device,
                          storage_dtype=self.mixed_precision.storage_dtype(params[0].dtype, params[0].requires_grad),
                          compute_dtype=self.mixed_precision.compute_dtype(params[0].dtype),
                          reduce_dtype=self.mixed_precision.gradient_reduce_dtype, ledger=self.ledger,
                          transfers=self.transfers, pin_shard=self.param_offload is None,
                          host_copy=self.host_copies, device_copy=self.device_copies and not on_device,
                          gathers=self.gathers)
        group.optimizer_on_device = on_device
        if stored_quantized(self.zero_pp, group.trainable):
            group.store_quantized(self.zero_pp.frozen_bits, self.zero_pp.block)
        elif self.param_offload is not None:
            self.param_offload.add(group, f"p{self._created_groups}")
        self._created_groups += 1
        return group


def stored_quantized(zero_pp: ZeroPPConfig, trainable: bool) -> bool:
    """Whether a group is stored as ``frozen_bits`` codes (frozen, with ``frozen_bits`` set).
    Codes are a fraction of the shard: they stay in memory, not in a swap file."""
    return zero_pp.frozen_bits is not None and not trainable


def swapped_shards(specs: list[UnitSpec], mixed_precision: MixedPrecisionConfig, zero_pp: ZeroPPConfig,
                   world_size: int) -> list[tuple[torch.dtype, torch.dtype, int]]:
    """``(storage dtype, compute dtype, shard elements)`` of each flat group that parameter offload
    will put in a swap file, from the plan alone (the parameters may still be on the meta device)."""
    shards = []
    for spec in specs:
        for members in split_by_kind(spec.params):
            first = members[0][1]
            if not stored_quantized(zero_pp, first.requires_grad):
                shards.append((mixed_precision.storage_dtype(first.dtype, first.requires_grad),
                               mixed_precision.compute_dtype(first.dtype),
                               shard_numel(sum(p.numel() for _, p in members), world_size)))
    return shards


def split_by_kind(params: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Split a unit's parameters into runs of one dtype and one ``requires_grad``, order kept."""
    kinds: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, p in params:
        kinds.setdefault((p.dtype, p.requires_grad), []).append((name, p))
    return list(kinds.values())


def check_group_sizes(zero_pp: ZeroPPConfig, world: int, ranks_per_node: int) -> None:
    """Refuse, naming the option the user set, a ``ZeroPPConfig`` group size that does not divide
    the world into equal groups (before any process group is built from it).

    Raises:
        ValueError: ``zero_pp.ranks_per_node`` or, with ``hpz=True``, ``zero_pp.hpz_partition_size``
            does not divide ``world``.
    """
    if zero_pp.ranks_per_node is not None:
        require_divisor(
            "ZeroPPConfig.ranks_per_node", zero_pp.ranks_per_node, world,
            "ranks are numbered node by node, the same number on every node",
            "Set zero_pp.ranks_per_node to the processes per machine, or leave it unset (the strategy's devices "
            "per node, else LOCAL_WORLD_SIZE, else one node).",
        )
    if zero_pp.hpz and zero_pp.hpz_partition_size is not None:
        require_divisor(
            "ZeroPPConfig.hpz_partition_size", zero_pp.hpz_partition_size, world,
            "hpZ's secondary partitions are held by groups of that many consecutive ranks",
            f"Set zero_pp.hpz_partition_size to one of those, normally the ranks per node ({ranks_per_node}, which "
            "keeps each group inside a node), or leave it unset (= ranks_per_node).",
        )


def hybrid_group_size(sharding: str, shard_group_size: Optional[int], zero_pp: ZeroPPConfig, world: int,
                      ranks_per_node: int) -> Optional[int]:
    """The shard group's size under ``sharding="hybrid"`` (``shard_group_size``, by default the
    ranks per node), or ``None`` for the other modes; checked before any process group is built.

    Raises:
        ValueError: ``shard_group_size`` without ``sharding="hybrid"``; one that does not divide
            ``world``; hybrid sharding with hpZ (the message says why they do not combine).
    """
    if sharding != "hybrid":
        if shard_group_size is not None:
            raise ValueError(f"shard_group_size={shard_group_size} sets the groups of hybrid sharding: give "
                             "sharding='hybrid' with it (Lightning's 'HYBRID_SHARD'), or drop it.")
        return None
    size = ranks_per_node if shard_group_size is None else shard_group_size
    require_divisor("shard_group_size", size, world,
                    "each group of that many consecutive ranks holds one copy of the sharded state",
                    f"Set shard_group_size to one of those, normally the ranks per node ({ranks_per_node}), or leave "
                    "it unset.")
    if zero_pp.hpz:
        raise ValueError("ZeroPPConfig(hpz=True) does not combine with sharding='hybrid': hpZ keeps a copy of the "
                         "weights within each node for backward's gathers, and a hybrid shard group gathers within "
                         "itself already (a node by default). Drop hpz, or use sharding='full' with it.")
    return size


def make_swap_space(config: OffloadConfig, comm: Collectives, device: torch.device,
                    planned: int) -> Optional[SwapSpace]:
    """The rank's NVMe swapper, in a folder of its own under ``config.nvme_path``, and its staging
    pool (``nvme`` only). The folder and its files are removed when the swapper is closed or the
    process exits cleanly; folders that killed processes of this host left in ``nvme_path`` are
    removed first (:func:`reclaim_stale_folders`). Then, before the folder is made, the preflight
    checks that ``planned`` bytes per rank (the parameter shards' swap files) fit there
    (:func:`ensure_space`; collective).

    Raises:
        ValueError: ``pin_memory=True`` with a CPU compute device.
        SwapError: ``planned`` does not fit in the free space (on every rank), or the folder cannot
            be created (see :class:`NvmeSwapper`).
    """
    if "nvme" not in (config.param, config.optimizer):
        return None
    pin = config.pin_memory if config.pin_memory is not None else device.type != "cpu"
    if pin and device.type == "cpu":
        raise ValueError(
            "OffloadConfig.pin_memory=True needs an accelerator: page-locking host memory fails without "
            "one. Leave pin_memory unset (it is on exactly when the compute device is an accelerator)."
        )
    cap = config.staging_bytes
    if cap is None:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (8 * max(ranks_here, 1))
    reclaim_stale_folders(config.nvme_path)  # what killed runs left behind, before we need the space
    total = ensure_space(comm, config.nvme_path, planned, "parameter shards")
    folder = os.path.join(config.nvme_path, swap_folder_name(comm.rank))
    swapper = NvmeSwapper(folder, config.aio)
    swapper.planned_bytes = total
    # At a clean exit: multiprocessing's exit hook covers worker processes (which leave through
    # os._exit, skipping atexit), and it is itself registered with atexit in a main process.
    multiprocessing.util.Finalize(swapper, swapper.close, exitpriority=10)
    return SwapSpace(swapper, StagingPool(cap, pin_memory=pin, device=device))
