"""An optimizer's full (unsharded) state dict, out of and into the fp32-shard optimizer.

After :meth:`~lightning_zinf.ZeroEngine.shard_optimizer` the user's optimizer steps 1-D fragments
of this rank's master shards, so its own ``state_dict()`` describes fragments. The functions here
give and take the state dict the same optimizer would have over the unpartitioned model, numbered
as torch numbers it (parameters in param-group order, frozen ones included), with each per-element
state (Adam's ``exp_avg``...) at the parameter's full shape, so that a checkpoint moves between this
strategy and DDP, one device, or FSDP's full state dicts. As for FSDP's full optimizer state dict
(Zhao et al., VLDB'23, §3.4), the state is gathered and scattered one flat group at a time.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lightning_zinf.checkpoint.durable import (STAGING_SUFFIX, CheckpointWriteError, clean_stale,
                                               describe_write_failure, replace_file, replace_kind, space_message)
from lightning_zinf.checkpoint.format import (CHECKPOINT_GLOBALS, CheckpointError, is_sharded_checkpoint,
                                             require_checkpoint)
from lightning_zinf.checkpoint.load import placed_scalar_state
from lightning_zinf.checkpoint.save import optimizer_owners, shard_layout_state
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.offload.errors import free_bytes
from lightning_zinf.tiling import tile_views

__all__ = ["full_optimizer_state_dict", "load_full_optimizer_state_dict", "save_full_checkpoint", "load_full_checkpoint",
           "trainable_state_dict", "load_trainable_state_dict", "trainable_only", "load_trainable_checkpoint"]


def _position(engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> int:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
    for k, candidate in enumerate(engine.optimizers):
        if candidate is optimizer:
            return k
    raise ValueError("The optimizer was not set up by this engine (ZeroEngine.shard_optimizer), so it has no "
                     "full state dict; set it up with the model (fabric.setup, or configure_optimizers).")


def _numbering(engine: ZeroEngine, k: int) -> tuple[list[list[int]], dict[tuple[int, int], int]]:
    """Plain indices per param group, and (flat group, position) -> plain index."""
    ids, where, index = [], {}, 0
    for entries in engine.plain_layouts[k]:
        ids.append(list(range(index, index + len(entries))))
        for i, entry in zip(ids[-1], entries):
            if entry is not None:
                where[entry] = i
        index += len(entries)
    return ids, where


def full_optimizer_state_dict(engine: ZeroEngine, optimizer: torch.optim.Optimizer, *,
                              rank0_only: bool = True) -> dict[str, Any]:
    """The state dict ``optimizer`` would have over the unpartitioned model (collective).

    Args:
        engine: The engine that sharded ``optimizer``.
        optimizer: One of ``engine.optimizers`` (or a ``LightningOptimizer`` around it).
        rank0_only: Only rank 0 keeps the full tensors (the others return the hyper-parameters
            and no ``state``), so a large model's state is never whole on every rank.

    Returns:
        ``{"state": {index: {key: tensor}}, "param_groups": [{..., "params": [index, ...]}]}`` as
        ``torch.optim.Optimizer.state_dict()`` returns it: per-element states at the parameter's
        full shape on the CPU (fp32 for Adam's moments), scalars (``step``) as 0-d fp32 tensors.

    Raises:
        ValueError: ``optimizer`` was not sharded by ``engine``.
    """
    k = _position(engine, optimizer)
    optimizer = engine.optimizers[k]
    ids, where = _numbering(engine, k)
    param_groups = [{**{key: v for key, v in group.items() if key != "params"}, "params": i}
                    for group, i in zip(optimizer.param_groups, ids)]
    comm = engine.comm
    keep = not rank0_only or comm.rank == 0
    state: dict[int, dict[str, Tensor]] = {}
    groups = engine.groups
    engine.begin_unit_access()
    for gi, group in enumerate(groups):
        if not group.fragments:  # no master: never stepped (a group frozen again keeps its state)
            continue
        with engine.state_resident(write_back=False, groups=[group]):
            local = {k.removeprefix("opt0."): v for k, v in shard_layout_state(group, optimizer_owners([optimizer])).items()}
        # Every rank steps the same parameters, so the keys agree; checked, since a mismatch would hang.
        keys = sorted(local)
        if comm.world_size > 1 and not comm.all_equal(zlib.crc32(",".join(keys).encode())):
            raise RuntimeError(f"The ranks hold different optimizer state keys for '{group.names[0]}': their "
                               "optimizers were not stepped alike.")
        # One key at a time, its gathered buffer sliced to the CPU and dropped before the next: the
        # device holds one state tensor of one group at once, whatever rank keeps the result.
        for key in keys:
            piece = local.pop(key).to(engine.device)
            gathered = piece.new_empty(piece.numel() * comm.shard_size)
            comm.all_gather(gathered, piece)
            del piece
            if not keep:
                del gathered
                continue
            scalar = key.endswith(".scalar")
            values = gathered.view(comm.shard_size, -1).cpu() if scalar else gathered
            for j, (p_offset, numel, shape) in enumerate(zip(group.offsets, group.numels, group.shapes)):
                index = where.get((gi, j))
                if index is None:
                    continue
                if scalar:
                    known = [v for v in values[:, j].tolist() if v == v]  # the first rank that has one
                    if known:
                        state.setdefault(index, {})[key.removesuffix(".scalar")] = torch.tensor(known[0],
                                                                                               dtype=torch.float32)
                else:
                    state.setdefault(index, {})[key] = values[p_offset : p_offset + numel].view(shape).to("cpu", copy=True)
            del gathered, values
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def load_full_optimizer_state_dict(engine: ZeroEngine, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Load a plain optimizer state dict (what :func:`full_optimizer_state_dict`, DDP or one device
    save) into ``optimizer``, sharded by ``engine``: each rank keeps its fragments' elements of every
    per-element state; hyper-parameters are restored per param group. Every rank must pass the same
    state dict (each reads only its slices). Not collective.

    Raises:
        ValueError: ``optimizer`` was not sharded by ``engine``, or ``state_dict`` has other param
            groups or another number of parameters in one (an optimizer built differently), or a
            state tensor's shape is not its parameter's.
    """
    k = _position(engine, optimizer)
    optimizer = engine.optimizers[k]
    ids, where = _numbering(engine, k)
    saved_groups = state_dict.get("param_groups", [])
    counts = [len(g.get("params", [])) for g in saved_groups]
    if counts != [len(i) for i in ids]:
        raise ValueError(
            f"The optimizer state dict has param groups of {counts} parameters, but the optimizer has "
            f"{[len(i) for i in ids]}: it was saved from an optimizer built over other parameters (configure "
            "the optimizer as in the run that saved it)."
        )
    plain_of = {i: saved for saved_group, mine in zip(saved_groups, ids) for i, saved in zip(mine, saved_group["params"])}
    saved_state = state_dict.get("state", {})
    # State saved for parameters frozen since partitioning (trained before the save, frozen when the
    # model was built again): their groups get masters to hold it, as a plain optimizer keeps it.
    engine.sharded.give_masters([group for gi, group in enumerate(engine.groups) if group.master is None and any(
        saved_state.get(plain_of.get(where.get((gi, j)))) for j in range(len(group.params)))])
    for gi, group in enumerate(engine.groups):
        if not group.fragments:
            continue
        with engine.state_resident(write_back=True, groups=[group]):
            flat: dict[str, Tensor] = {}
            for j, fragment in enumerate(group.fragments):
                index = where.get((gi, j))
                entry = saved_state.get(plain_of.get(index)) if index is not None else None
                if not entry:
                    optimizer.state.pop(fragment, None)
                    continue
                lo, hi = group.owned_ranges()[j]
                start = group.shard_start + lo - group.offsets[j]  # the fragment's first element in the parameter
                mine: dict[str, Any] = {}
                for key, value in entry.items():
                    if not isinstance(value, Tensor) or value.dim() == 0:
                        mine[key] = placed_scalar_state(key, value, fragment, optimizer) if isinstance(value, Tensor) else value
                        continue
                    if value.shape != group.shapes[j]:
                        raise ValueError(f"Optimizer state '{key}' of '{group.names[j]}' has shape {tuple(value.shape)}, "
                                         f"the parameter {tuple(group.shapes[j])}.")
                    if key not in flat:
                        # As torch's load_state_dict casts floating state to its parameter's dtype (a bf16
                        # model's moments go with the fp32 masters as fp32).
                        dtype = fragment.dtype if value.is_floating_point() else value.dtype
                        flat[key] = torch.zeros(group.shard_numel, dtype=dtype, device=group.state_device)
                    flat[key][lo:hi].copy_(value.reshape(-1)[start : start + hi - lo])
                    mine[key] = flat[key][lo:hi]
                optimizer.state[fragment] = mine
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({key: v for key, v in saved.items() if key != "params"})


def _trainable_groups(engine: ZeroEngine) -> Iterator[tuple[FlatGroup, list[list[str]]]]:
    """The trainable flat groups, each with every name of each of its parameters (a tied one has
    several).

    Raises:
        CheckpointError: a trainable parameter is a tile of a ``TiledLinear`` (its plain state dict
            names the untiled weight, which these functions do not assemble)."""
    aliases: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    views = tile_views(engine.module)
    for group in engine.groups:
        if not group.trainable:
            continue
        tiled = [n for p, n in zip(group.params, group.names) if id(p) in views]
        if tiled:
            raise CheckpointError(
                f"'{tiled[0]}' is a trainable TiledLinear tile: a full checkpoint of the trainable parameters alone "
                "(exclude_frozen_parameters=True) does not assemble tiles. Use state_dict_type='sharded', or "
                "exclude_frozen_parameters=False."
            )
        yield group, [aliases.get(id(p), [n]) for p, n in zip(group.params, group.names)]


def trainable_state_dict(engine: ZeroEngine, *, rank0_only: bool = True) -> dict[str, Tensor]:
    """The full values of the trainable parameters of ``engine``'s model, keyed as its
    ``state_dict()`` keys them (collective). Frozen parameters are neither gathered nor returned:
    what a full checkpoint under ``exclude_frozen_parameters=True`` holds (DeepSpeed's option of
    that name), at the cost of all-gathering the trainable flat groups, one group at a time
    (FSDP's full state dict gathers one FlatParameter at a time: Zhao et al., VLDB'23, §3.4).

    Args:
        engine: The engine partitioning the model.
        rank0_only: Only rank 0 keeps the values (the others return ``{}``).

    Returns:
        Name -> tensor at the parameter's full shape and own dtype (the shards' exact values, as
        :meth:`~lightning_zinf.ZeroEngine.hold_exact` gathers them), on the CPU; a tied parameter
        under each of its names.

    Raises:
        CheckpointError: a trainable parameter is a ``TiledLinear`` tile (see :func:`_trainable_groups`).
    """
    comm = engine.comm
    keep = not rank0_only or comm.rank == 0
    state: dict[str, Tensor] = {}
    engine.begin_unit_access()
    for group, names in _trainable_groups(engine):
        with engine.state_resident(write_back=False, groups=[group]):
            piece = group.shard.to(engine.device)
            gathered = piece.new_empty(piece.numel() * comm.shard_size)
            comm.all_gather(gathered, piece)
            del piece
        if keep:
            for aliases, offset, numel, shape in zip(names, group.offsets, group.numels, group.shapes):
                value = gathered[offset : offset + numel].view(shape).to("cpu", copy=True)
                state.update(dict.fromkeys(aliases, value))
        del gathered
    return state


def load_trainable_state_dict(engine: ZeroEngine, state_dict: dict[str, Any]) -> None:
    """Load the values :func:`trainable_state_dict` saved into the trainable parameters' shards
    (and fp32 masters): each rank copies its shards' slices, no group is gathered, and the frozen
    groups (the values the model was built or loaded with, or their INT8 codes) are not touched.
    Every rank must pass the same dict. Not collective.

    Raises:
        CheckpointError: a trainable parameter is missing from ``state_dict`` or has another
            shape there (a checkpoint of another model), or is a ``TiledLinear`` tile.
    """
    for group, names in _trainable_groups(engine):
        values = []
        for aliases, shape in zip(names, group.shapes):
            value = next((state_dict[a] for a in aliases if a in state_dict), None)
            if value is None or tuple(value.shape) != tuple(shape):
                found = "missing" if value is None else f"of shape {tuple(value.shape)}"
                raise CheckpointError(
                    f"The checkpoint's state_dict has '{aliases[0]}' {found}; the model's trainable parameter has shape "
                    f"{tuple(shape)}. It was saved from another model: build the model as the run that saved it."
                )
            values.append(value)
        with engine.state_resident(write_back=True, groups=[group]):
            lo = group.shard_start
            for value, offset, numel in zip(values, group.offsets, group.numels):
                # This parameter's elements [a, b) of the flat group that fall in this rank's shard.
                a, b = max(offset, lo), min(offset + numel, lo + group.shard_numel)
                if a >= b:
                    continue
                part = value.reshape(-1)[a - offset : b - offset]
                group.shard[a - lo : b - lo].copy_(part)
                if group.master is not None and group.master is not group.shard:
                    group.master[a - lo : b - lo].copy_(part)
    # Re-gather the persistent units holding a loaded group; frozen groups keep their hpZ secondaries.
    engine.after_step([group for group, _ in _trainable_groups(engine)])


def trainable_only(module: torch.nn.Module, state_dict: dict[str, Any]) -> bool:
    """Whether ``state_dict`` (a full state dict of ``module``: names -> tensors) leaves out every
    frozen parameter, as one saved under ``exclude_frozen_parameters=True`` (DeepSpeed's option of
    that name) does, and ``module`` has some. Raises nothing."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return bool(frozen) and not frozen & set(state_dict)


def load_trainable_checkpoint(engine: ZeroEngine, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load a full state dict that holds the trainable parameters and the buffers of ``engine``'s
    model (:func:`trainable_only`): the parameters into their shards
    (:func:`load_trainable_state_dict`), the replicated buffers copied in place (a module's
    ``load_state_dict`` would gather every unit). Every rank must pass the same dict. Not collective.

    Raises:
        CheckpointError: a trainable parameter is missing or has another shape; with ``strict``, a
            key names neither a parameter nor a buffer of the model.
    """
    load_trainable_state_dict(engine, state_dict)
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    buffers = dict(engine.module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in state_dict.items():
            if name in buffers:
                buffers[name].copy_(value)
    unexpected = [k for k in state_dict if k not in params and k not in buffers]
    if unexpected and strict:
        raise CheckpointError(f"The checkpoint's state_dict has keys the module does not: {unexpected[:5]}. "
                              "It was saved from another model: build the model as the run that saved it.")


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested checkpoint structure (what ``torch.save`` writes, but for
    the pickled rest)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _write_full(checkpoint: dict[str, Any], path: Path) -> None:
    if path.is_dir() and not is_sharded_checkpoint(path):
        # IsADirectoryError, as Lightning's FSDP strategies raise here.
        raise IsADirectoryError(f"{path} is a folder that is not a lightning_zinf checkpoint; refusing to replace it "
                                "with a full checkpoint file. Choose another path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path.parent)
    need = _tensor_bytes(checkpoint)
    free = free_bytes(path.parent)
    if free is not None and need > free:
        raise CheckpointWriteError(errno.ENOSPC, space_message(path, str(path.parent), need, free))
    staging = path.parent / f".{path.name}{STAGING_SUFFIX}"
    try:
        with open(staging, "wb") as out:
            torch.save(checkpoint, out)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        staging.unlink(missing_ok=True)
        raise CheckpointWriteError(error.errno, describe_write_failure(error, path, staging, need)) from error
    if path.is_dir():
        replace_kind(staging, path)  # a sharded checkpoint was there
    else:
        replace_file(staging, path)


def save_full_checkpoint(checkpoint: dict[str, Any], path: os.PathLike | str, *, writer: bool,
                         broadcast: Callable[[Any], Any]) -> None:
    """Write ``checkpoint`` (with full ``state_dict`` and plain optimizer states) as one
    ``torch.save`` file at ``path``, from the ``writer`` rank alone. Collective: every rank calls it
    and returns when the file is in place, or raises the writer's error.

    Crash-safe (:mod:`lightning_zinf.checkpoint.durable`): the file is written beside ``path``, flushed to the
    disk (``fsync``), then renamed over it in one atomic step, so ``path`` always holds a complete
    checkpoint, the previous one until the new one is in place. A sharded checkpoint folder this
    package wrote at ``path`` is replaced (Lightning's FSDP strategy likewise replaces the other type).
    The free space is checked first.

    Args:
        checkpoint: What to save: tensors on the CPU (on the writer; the others' is unused).
        path: The file to write.
        writer: This rank writes (rank 0).
        broadcast: The strategy's ``broadcast(obj, src=0)``, to give every rank the writer's outcome.

    Raises:
        IsADirectoryError: ``path`` is a folder that is not a checkpoint written by this package (as
            Lightning's ``FSDPStrategy(state_dict_type="full")`` raises).
        CheckpointWriteError: the tensors need more room than is free (bytes named; nothing is
            written), or the write failed (full disk, permissions; the partial file is removed);
            ``path`` is untouched.
    """
    outcome: Optional[BaseException] = None
    if writer:
        try:
            _write_full(checkpoint, Path(path))
        except OSError as error:
            outcome = error
    outcome = broadcast(outcome)
    if outcome is not None:
        raise outcome


def load_full_checkpoint(path: os.PathLike | str, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """A single-file checkpoint (DDP's, one device's, or :func:`save_full_checkpoint`'s), memory-
    mapped: its tensors are read from disk as they are used, one unit's at a time by
    ``load_state_dict``, so no rank reads the whole model into memory at once.

    Args:
        path: The file.
        weights_only: ``None``/``True``: torch's weights-only unpickler (with Lightning's checkpoint
            classes allowed); ``False``: the full unpickler, for a file the user trusts.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, a folder, or a part of a sharded checkpoint (the
            message names the checkpoint folder to load instead).
        CheckpointError: the file cannot be read, or is not a checkpoint dict.
    """
    path = Path(path)
    require_checkpoint(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is a sharded checkpoint folder, not a checkpoint file: load it with the "
                              "strategy, or consolidate it into one file (zinf-consolidate).")
    try:
        with torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS)):
            checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only is not False)
    except Exception as error:
        raise CheckpointError(f"{path} cannot be read as a checkpoint file ({error}). If it names classes you "
                              "trust, load it with weights_only=False.") from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    return checkpoint
