"""Loading a sharded checkpoint at this or any other world size, and into the same or other units
(:mod:`~lightning_zinf.checkpoint.regroup`): each rank reads only the byte ranges of the old shard
files that overlap its own shards, one flat group at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from lightning_zinf.checkpoint.format import (FORMAT, META_FILE, MODELS_KEY, CheckpointError, ShardReader, _layout,
                                             is_sharded_checkpoint, model_folders, read_meta, require_checkpoint)
from lightning_zinf.checkpoint.regroup import SavedRanges, match_layout
from lightning_zinf.checkpoint.save import optimizer_owners
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.engine.flat import FlatGroup

__all__ = ["load_sharded", "placed_scalar_state"]


def load_sharded(
    engine: ZeroEngine, optimizers: Iterable[torch.optim.Optimizer] | dict[int, torch.optim.Optimizer],
    path: os.PathLike, load_optimizer: bool = True,
    *, weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_sharded`, at this or any other world size.

    Each rank reads only the byte ranges of the old shard files that overlap its own shards.
    Collective: every rank must call it.

    Args:
        engine: The engine partitioning the same model.
        optimizers: The engine's sharded optimizers, in the order they were saved, or a mapping
            from the index an optimizer's state was saved at to the optimizer that takes it.
        path: The checkpoint directory.
        load_optimizer: Restore optimizer state (and fp32 masters); ``False`` loads weights only.
        weights_only: How ``meta.pt`` is unpickled (:func:`read_meta`): ``None``/``True`` runs no
            code from the file; ``False`` trusts it.

    Returns:
        The ``meta`` dict that was saved (with the ``"zinf"`` layout entry).

    Raises:
        CheckpointNotFoundError: nothing at ``path``, a folder without ``meta.pt``, or a part of a
            checkpoint (its ``save-<id>/`` folder, a shard file: the message names the checkpoint).
        CheckpointError: ``path`` is a file, a shard file is missing or corrupt, the checkpoint was
            saved from a different model, or ``meta.pt`` names code the safe load refuses.

    Frozen groups saved with ``exclude_frozen`` keep the values they have now.
    """
    path = Path(path)
    require_checkpoint(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{path} is not a lightning_zinf checkpoint (expected a directory with {META_FILE} and one "
            "rank_*.safetensors file per rank)."
        )
    meta = read_meta(path, weights_only)
    if MODELS_KEY in meta:
        raise CheckpointError(
            f"{path} holds several models ({', '.join(meta[MODELS_KEY])}), each in a folder of its own: load it with "
            "fabric.load(path, {...}) naming each model, or load one model's folder (e.g. "
            f"{next(iter(model_folders(path, meta).values()))})."
        )
    zinf = meta.get("zinf", {})
    if zinf.get("format") != FORMAT:
        raise CheckpointError(f"{path / META_FILE} is not a lightning_zinf checkpoint's metadata.")
    reader = ShardReader(path, zinf)
    # Other units than the save's (another block_classes or unit_size) read each parameter's range.
    saved = SavedRanges(reader, zinf["groups"], match_layout(zinf["groups"], _layout(engine), path))
    if load_optimizer:
        # Optimizer state saved for groups frozen since partitioning (trained before the save, frozen
        # when the model was built again): they get masters to hold it, as a plain optimizer keeps it.
        engine.sharded.give_masters([group for i, group in enumerate(engine.groups) if group.master is None
                                     and not saved.excluded(i) and saved.state_names(i, "opt")])
    owners = optimizer_owners(optimizers if isinstance(optimizers, dict) else list(optimizers))
    engine.release_all()
    for i, group in enumerate(engine.groups):
        if saved.excluded(i):
            continue  # saved without its frozen values: the model's own stay
        # One group's state in memory at a time (with NVMe offload the rest stays in swap files).
        with engine.state_resident(write_back=True, groups=[group]):
            # A rank may own only padding (a small group over many ranks): then lo == hi.
            lo = min(group.shard_start, group.numel)
            hi = min(group.shard_start + group.shard_numel, group.numel)
            # Elements saved without values (a frozen part of a group, exclude_frozen) keep the model's.
            group.shard[hi - lo:].zero_()
            saved.read(i, "param", lo, hi, group.shard)
            if load_optimizer and group.master is not None and group.master is not group.shard:
                # The loaded weights, then the saved masters where there are any (a group saved
                # without one kept its master in its weights; frozen elements keep the model's).
                group.master[hi - lo:].zero_()
                group.master[: hi - lo].copy_(group.shard[: hi - lo])
                saved.read(i, "master", lo, hi, group.master)
            elif group.master is not None and group.master is not group.shard:
                group.master.copy_(group.shard)
            if load_optimizer:
                _load_group_state(i, group, owners, saved, lo, hi)
    engine.after_step()  # re-gather persistent units from the loaded shards
    return meta


def placed_scalar_state(key: str, value: Tensor, fragment: Tensor, optimizer: torch.optim.Optimizer) -> Tensor:
    """A restored per-parameter scalar state placed as torch's own ``Optimizer.load_state_dict``
    places it: ``step`` in fp32, on the fragment's device for a ``fused`` or ``capturable`` param
    group (their kernels read it there), else on the CPU; any other scalar (ASGD's ``eta``, ``mu``)
    in the fragment's dtype, on its device. Always a copy (not a view of a memory-mapped checkpoint)."""
    if key != "step":
        return value.to(dtype=fragment.dtype, device=fragment.device, copy=True)
    group = next(g for g in optimizer.param_groups if any(p is fragment for p in g["params"]))
    on_device = group.get("fused") or group.get("capturable")
    return value.to(dtype=torch.float32, device=fragment.device if on_device else "cpu", copy=True)


def _load_group_state(i: int, group: FlatGroup, owners: dict[int, tuple[int, torch.optim.Optimizer]],
                      saved: SavedRanges, lo: int, hi: int) -> None:
    ranges = group.owned_ranges()
    flat: dict[str, Tensor] = {}
    for j, fragment in enumerate(group.fragments):
        if id(fragment) not in owners:
            continue
        o, optimizer = owners[id(fragment)]
        prefix = f"opt{o}."
        state: dict[str, Tensor] = {}
        for name in saved.state_names(i, prefix):
            if not saved.holds(i, j, prefix + name):
                continue
            if name.endswith(".scalar"):
                value = saved.scalar(i, j, prefix + name)
                if value is not None and not torch.isnan(value):
                    key = name.removesuffix(".scalar")
                    state[key] = placed_scalar_state(key, value, fragment, optimizer)
                continue
            if name not in flat:
                flat[name] = torch.zeros(group.shard_numel, dtype=saved.dtype(i, prefix + name),
                                         device=group.state_device)
                saved.read(i, prefix + name, lo, hi, flat[name])
            a, b = ranges[j]
            state[name] = flat[name][a:b]
        if state:
            optimizer.state[fragment] = state
        else:
            optimizer.state.pop(fragment, None)
