"""Writing a sharded checkpoint, crash-safe (:mod:`lightning_zinf.checkpoint.durable`): each rank's shard
file into a new ``save-<id>/`` folder, flushed to the disk, committed by one atomic replacement of
``meta.pt`` (or the rename of a staged folder), the previous save removed after; free space checked
first, and every rank raises the same error when any rank's write fails."""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from lightning_zinf.checkpoint.format import (_META_PICKLE, FORMAT, META_FILE, MODELS_DIR_KEY, MODELS_KEY,
                                             SAFETENSORS_DTYPES, VERSION, _layout, _sha256, is_sharded_checkpoint,
                                             refuse_reserved_keys, shard_file)
from lightning_zinf.checkpoint.durable import (STAGING_SUFFIX, CheckpointWriteError, clean_stale,
                                               describe_write_failure, fsync_file, fsync_folder, is_torch_file, put_new,
                                               remove_path, replace_file, replace_kind, space_message)
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.offload.preflight import shortfall

log = logging.getLogger(__name__)

__all__ = ["save_sharded", "save_sharded_models", "optimizer_owners", "shard_layout_state"]


def optimizer_owners(optimizers: Iterable[torch.optim.Optimizer] | dict[int, torch.optim.Optimizer]
              ) -> dict[int, tuple[int, torch.optim.Optimizer]]:
    """Fragment id -> ``(optimizer index in the checkpoint, optimizer)``, for the fragments of the
    fp32 master shards the optimizers step; ``optimizers`` in the saved order, or a mapping from
    the index an optimizer's state is saved at to the optimizer that takes it."""
    indexed = optimizers.items() if isinstance(optimizers, dict) else enumerate(optimizers)
    return {
        id(fragment): (o, optimizer)
        for o, optimizer in indexed
        for param_group in optimizer.param_groups
        for fragment in param_group["params"]
    }


def shard_layout_state(group: FlatGroup, owners: dict[int, tuple[int, torch.optim.Optimizer]]) -> dict[str, Tensor]:
    """This rank's optimizer state for ``group``, laid out like its shard, as checkpoints and full
    optimizer state dicts take it.

    Args:
        group: A trainable flat group whose fragments the optimizers step.
        owners: Fragment id -> ``(optimizer index, optimizer)`` (:func:`optimizer_owners`).

    Returns:
        ``"opt<o>.<key>"``: per-element state ``key`` of optimizer ``o``, ``shard_numel`` elements of
        its dtype, on the state's device, zeros where this rank owns no element or a fragment has no
        state; ``"opt<o>.<key>.scalar"``: per-parameter scalar state (Adam's ``step``), one float64
        per parameter of the group, NaN where a parameter has none.
    """
    tensors: dict[str, Tensor] = {}
    ranges = group.owned_ranges()
    for j, fragment in enumerate(group.fragments):
        if id(fragment) not in owners:
            continue
        o, optimizer = owners[id(fragment)]
        for key, value in optimizer.state.get(fragment, {}).items():
            if not isinstance(value, Tensor):
                continue
            if value.dim() == 0:
                name = f"opt{o}.{key}.scalar"
                if name not in tensors:
                    tensors[name] = torch.full((len(group.params),), float("nan"), dtype=torch.float64)
                tensors[name][j] = value.double()
            elif value.shape == fragment.shape:
                name = f"opt{o}.{key}"
                if name not in tensors:
                    tensors[name] = torch.zeros(group.shard_numel, dtype=value.dtype, device=value.device)
                lo, hi = ranges[j]
                tensors[name][lo:hi] = value
    return tensors


def _group_tensors(i: int, group: FlatGroup, owners: dict[int, tuple[int, torch.optim.Optimizer]]) -> dict[str, Tensor]:
    tensors = {f"{i}.param": group.shard}
    # An fp32 master that is the shard's own memory (NVMe offload shares one record) is not saved
    # twice: loading takes the master from ".param" when ".master" is absent.
    if group.master is not None and group.master.data_ptr() != group.shard.data_ptr():
        tensors[f"{i}.master"] = group.master
    tensors.update({f"{i}.{name}": value for name, value in shard_layout_state(group, owners).items()})
    return tensors


@dataclass(frozen=True)
class _Save:
    """Where one save writes. ``root`` is the folder ``meta.pt`` goes in: the checkpoint itself when
    one is already at ``path`` (its new ``meta.pt`` replaces the old one in one atomic step), else a
    staging folder beside it that is renamed to ``path`` once complete. ``data`` (``root / tag``)
    holds the new shard files; ``tag`` is unique per save."""

    path: Path
    root: Path
    tag: str

    @property
    def data(self) -> Path:
        return self.root / self.tag


def _plan(path: Path) -> _Save:
    if path.exists() and not is_sharded_checkpoint(path) and not is_torch_file(path):
        raise FileExistsError(
            f"{path} exists and is not a checkpoint (neither a lightning_zinf checkpoint folder nor a torch.save "
            "file); refusing to replace it. Choose another path."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    cleaned = clean_stale(path.parent)
    if cleaned:
        log.info("Removed what earlier interrupted saves left in %s: %s", path.parent, ", ".join(cleaned))
    tag = f"save-{secrets.token_hex(6)}"
    root = path if is_sharded_checkpoint(path) else path.parent / f".{path.name}{STAGING_SUFFIX}"
    if root != path:
        root.mkdir()  # (clean_stale removed any earlier one)
    (root / tag).mkdir()
    fsync_folder(root)
    return _Save(path, root, tag)


def _begin(path: Path, comm: Any) -> _Save:
    """Rank 0 checks ``path``, removes debris of interrupted saves beside it and makes the new
    save's folders; every rank gets the plan, or the same error (collective)."""
    outcome: _Save | BaseException | None = None
    if comm.rank == 0:
        try:
            outcome = _plan(path)
        except OSError as error:
            outcome = error
    outcome = comm.all_gather_object(outcome)[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _abort(save: _Save, rank: int) -> None:
    """Remove what a failed save wrote (rank 0): its data folder, or the whole staging folder."""
    if rank == 0:  # best effort: what is left is removed by the next save in the folder
        shutil.rmtree(save.root if save.root != save.path else save.data, ignore_errors=True)


def _commit(save: _Save, record: Optional[dict[str, Any]], comm: Any, parts: Optional[dict[Path, dict[str, Any]]] = None) -> None:
    """Rank 0 makes the written save the checkpoint at ``save.path`` in one atomic step (the new
    ``meta.pt`` replacing the old, or the complete staging folder renamed into place) after every
    file and folder is on the disk, then removes the previous save's files. ``parts``: more
    ``meta.pt`` files to write first (one per model of a checkpoint of several). Every rank
    returns, or raises the same error (collective)."""
    outcome: Optional[BaseException] = None
    if comm.rank == 0:
        assert record is not None
        staging = save.root / f".{META_FILE}{STAGING_SUFFIX}"
        try:
            for file, part in (parts or {}).items():
                _write_meta(file, part, save.path)
                fsync_folder(file.parent)
            fsync_folder(save.data)
            _write_meta(staging, record, save.path)
            replace_file(staging, save.root / META_FILE)  # the commit, for a checkpoint already at path
        except OSError as error:
            _abort(save, 0)
            outcome = error
        if outcome is None:
            try:
                if save.root != save.path and save.path.exists():
                    replace_kind(save.root, save.path)  # a full checkpoint file was there
                elif save.root != save.path:
                    put_new(save.root, save.path)  # the commit, for a new name
                else:
                    _remove_previous(save)
            except OSError as error:
                outcome = error
    outcome = comm.all_gather_object(outcome)[0]
    if outcome is not None:
        raise outcome


#: The entries of ``meta.pt`` a save writes itself: the layout record, and which model is where.
_WRITTEN_HERE = ("zinf", MODELS_KEY, MODELS_DIR_KEY)


_told_folder = False  # whether this process has said that a file-like name got a folder


def _say_it_is_a_folder(path: Path, comm: Any) -> None:
    """Once per process, on rank 0: a save to a name that looks like a file's (``model.pt``,
    ``last.ckpt``) wrote a folder, and how to get one file (as Lightning's DeepSpeed strategy warns
    that a ZeRO-3 checkpoint is a directory)."""
    global _told_folder
    if comm.rank != 0 or _told_folder or not path.suffix:
        return
    _told_folder = True
    warnings.warn(
        f"{path} was written as a folder, not a file: a sharded checkpoint is a directory ({META_FILE} and one "
        "shard file per rank), whatever its name. trainer.fit(ckpt_path=...), fabric.load and zinf-consolidate take "
        f"the folder; for one file, consolidate it (zinf-consolidate {path} model.pt) or save with "
        "state_dict_type='full'.",
        UserWarning, stacklevel=4,
    )


def _remove_previous(save: _Save) -> None:
    """Remove everything in the checkpoint folder but ``meta.pt`` and the save it names: the
    previous save's data folder, or files of the older layout (shards beside ``meta.pt``). A crash
    here leaves files no ``meta.pt`` names, removed by the next save of this name."""
    for entry in save.root.iterdir():
        if entry.name not in (META_FILE, save.tag):
            remove_path(entry)
    fsync_folder(save.root)


def _shard_bytes(engine: ZeroEngine, owners: dict[int, tuple[int, torch.optim.Optimizer]], exclude_frozen: bool) -> int:
    """About the bytes this rank writes, from the shapes and dtypes alone (nothing is read from
    NVMe): each group's shard, its fp32 master when separate, and the per-element state of the
    optimizer stepping it, plus the header's room; on rank 0 also room for ``meta.pt`` (the layout
    takes about a kilobyte per group, the caller's state usually less than the 64 KiB added)."""
    if engine.comm.replica != 0:
        return 0  # hybrid sharding: the first shard group writes the one copy of the state
    total = _HEADER_ROOM_BASE + _HEADER_ROOM_PER_GROUP * len(engine.groups)
    if engine.comm.rank == 0:
        total += (64 << 10) + 1024 * len(engine.groups)
    for group in engine.groups:
        if exclude_frozen and not group.trainable:
            continue
        total += group.shard_numel * group.dtype.itemsize
        if group.master is not None and group.master is not group.shard:
            total += group.shard_numel * group.master.dtype.itemsize
        for fragment in group.fragments:
            if id(fragment) not in owners:
                continue
            state = owners[id(fragment)][1].state.get(fragment, {})
            total += sum(group.shard_numel * v.dtype.itemsize for v in state.values()
                         if isinstance(v, Tensor) and v.dim() > 0)
            break
    return total


def _check_space(save: _Save, comm: Any, need: int) -> None:
    """Refuse the save on every rank, before anything is written, if the ranks sharing a filesystem
    need more than it has free."""
    lack, _ = shortfall(comm, str(save.root), need)
    if lack is not None:
        raise CheckpointWriteError(errno.ENOSPC, space_message(save.path, lack.path, lack.needed, lack.free, lack.ranks))


def _write_shards(
    engine: ZeroEngine, optimizers: list[torch.optim.Optimizer], folder: Path, save: _Save, save_id: str,
    exclude_frozen: bool,
) -> list[str]:
    """Every rank of one copy of the sharded state (every rank; under hybrid sharding the first
    shard group's, world ranks ``0 .. shard_size - 1``) writes its shard file into ``folder`` and
    flushes it to the disk; returns their SHA-256s in shard order (collective). The file's header
    records ``save_id``, the shard's rank and the ranks sharing the state: a hybrid checkpoint is
    the checkpoint of a world of ``shard_size`` ranks, and loads at any world size and mode.

    Raises:
        CheckpointWriteError: on every rank, if any rank's write failed (full disk...), naming it."""
    comm = engine.comm
    file = folder / shard_file(comm.shard_rank)
    metadata = {"zinf_save": save_id, "zinf_rank": str(comm.shard_rank), "zinf_world_size": str(comm.shard_size)}
    checksum = failure = None
    try:
        if comm.replica == 0:
            checksum = _write_shard(engine, optimizer_owners(optimizers), file, exclude_frozen, metadata)
    except OSError as error:
        failure = (error.errno, describe_write_failure(error, save.path, file))
    results = comm.all_gather_object((checksum, failure))
    failed = [(rank, failure) for rank, (_, failure) in enumerate(results) if failure is not None]
    if failed:
        code, text = failed[0][1]
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise CheckpointWriteError(code, f"rank{'s' if len(failed) > 1 else ''} {ranks}: {text}")
    return [checksum for checksum, _ in results[:comm.shard_size]]


def _zinf_record(engine: ZeroEngine, optimizers: list[torch.optim.Optimizer], checksums: list[str],
                 exclude_frozen: bool, save_id: str, folder: str) -> dict[str, Any]:
    groups = [{**layout, "excluded": exclude_frozen and not layout["trainable"]} for layout in _layout(engine)]
    # Per optimizer saved, where each parameter it was given went (ZeroEngine.plain_layouts): what
    # consolidation needs to number its state as the plain optimizer would.
    layouts = [engine.plain_layouts[k] for o in optimizers for k, mine in enumerate(engine.optimizers) if mine is o]
    return {"format": FORMAT, "version": VERSION, "world_size": engine.comm.shard_size, "groups": groups,
            "sha256": checksums, "optimizers": layouts, "save": save_id, "dir": folder}


def save_sharded(
    engine: ZeroEngine, optimizers: Iterable[torch.optim.Optimizer], path: os.PathLike, meta: dict[str, Any],
    *, exclude_frozen: bool = False,
) -> None:
    """Write a sharded checkpoint of ``engine``'s model and ``optimizers`` to the directory ``path``.

    Collective: every rank must call it with the same ``path``. Crash-safe (:mod:`lightning_zinf.checkpoint.durable`):
    the shard files go to a new folder and are flushed to the disk (``fsync``), then one atomic step
    makes them the checkpoint (a new ``meta.pt`` replacing the old one, or a complete staging folder
    renamed to ``path``); only then is the previous save removed. At every instant ``path`` holds the
    previous complete checkpoint or the new one. Before writing, the free space is checked.

    Args:
        engine: The engine partitioning the model.
        optimizers: Optimizers sharded by ``engine`` (their per-element state is saved); may be empty.
        path: Target directory.
        meta: Picklable state saved by rank 0 in ``meta.pt`` (e.g. Lightning's checkpoint dict
            without weights and optimizer tensors).
        exclude_frozen: Leave out the frozen flat groups (a LoRA fine-tuning's base model;
            DeepSpeed's ``exclude_frozen_parameters``). :func:`load_sharded` then keeps the values
            those parameters have when it runs, so resuming is exact when the model is built with
            the same frozen values (the same pretrained checkpoint).

    Raises:
        ValueError: ``meta`` holds an entry under a name the save writes itself (``"zinf"``,
            :data:`~lightning_zinf.checkpoint.format.MODELS_KEY`, ``MODELS_DIR_KEY``); nothing is written.
        FileExistsError: ``path`` exists and is neither a checkpoint written by this package nor a
            ``torch.save`` file (a full checkpoint, which it replaces).
        CheckpointWriteError: on every rank: the ranks sharing a filesystem need more room than it
            has (the message gives the bytes needed and free; nothing is written), or a write failed
            (full disk, permissions: the rank, file and cause are named; what was written is removed).
            The previous checkpoint at ``path``, if any, is untouched.

    Warns:
        UserWarning: once per process, when ``path`` has a file's suffix (``model.pt``): it is a folder.
    """
    path = Path(path)
    comm = engine.comm
    optimizers = list(optimizers)
    refuse_reserved_keys(meta, path, _WRITTEN_HERE)
    save = _begin(path, comm)
    try:
        _check_space(save, comm, _shard_bytes(engine, optimizer_owners(optimizers), exclude_frozen))
        engine.release_all()
        checksums = _write_shards(engine, optimizers, save.data, save, save.tag, exclude_frozen)
        record = None
        if comm.rank == 0:
            zinf = _zinf_record(engine, optimizers, checksums, exclude_frozen, save.tag, save.tag)
            record = {**meta, "zinf": zinf}
    except BaseException:
        _abort(save, comm.rank)
        raise
    _commit(save, record, comm)
    _say_it_is_a_folder(path, comm)


def save_sharded_models(
    models: dict[str, tuple[ZeroEngine, dict[str, torch.optim.Optimizer], dict[str, Any]]], path: os.PathLike,
    meta: dict[str, Any], *, exclude_frozen: bool = False,
) -> None:
    """Write several partitioned models (each with its own engine and optimizers) as one checkpoint
    folder: each model's sharded checkpoint (:func:`save_sharded`'s layout) in a subfolder named by
    its key, and ``meta.pt`` with ``meta`` and which optimizers belong to which model. As crash-safe
    as :func:`save_sharded`: the models change together, in one atomic step. Collective; every rank
    passes the same keys.

    Args:
        models: Model key -> ``(engine, {optimizer key: optimizer}, the model's own meta)``.
        path: Target directory.
        meta: Picklable state of the rest (saved by rank 0).
        exclude_frozen: As :func:`save_sharded`'s.

    Raises:
        ValueError: ``meta`` or a model's own meta holds an entry under a reserved name (as
            :func:`save_sharded`); nothing is written.
        FileExistsError: as :func:`save_sharded`.
        CheckpointWriteError: as :func:`save_sharded`; the previous checkpoint at ``path`` is untouched.

    Warns:
        UserWarning: as :func:`save_sharded`.
    """
    path = Path(path)
    comm = next(iter(models.values()))[0].comm
    for part in [meta] + [own for _, _, own in models.values()]:
        refuse_reserved_keys(part, path, _WRITTEN_HERE)
    save = _begin(path, comm)
    try:
        need = sum(_shard_bytes(engine, optimizer_owners(list(optimizers.values())), exclude_frozen)
                   for engine, optimizers, _ in models.values())
        _check_space(save, comm, need)
        parts: dict[Path, dict[str, Any]] = {}
        for key, (engine, optimizers, own_meta) in models.items():
            folder = save.data / key
            folder.mkdir(exist_ok=True)
            engine.release_all()
            checksums = _write_shards(engine, list(optimizers.values()), folder, save, f"{save.tag}/{key}", exclude_frozen)
            if comm.rank == 0:
                zinf = _zinf_record(engine, list(optimizers.values()), checksums, exclude_frozen, f"{save.tag}/{key}", "")
                parts[folder / META_FILE] = {**own_meta, "zinf": zinf}
        record = {**meta, MODELS_KEY: {key: list(optimizers) for key, (_, optimizers, _) in models.items()},
                  MODELS_DIR_KEY: save.tag} if comm.rank == 0 else None
    except BaseException:
        _abort(save, comm.rank)
        raise
    _commit(save, record, comm, parts)
    _say_it_is_a_folder(path, comm)


def _write_meta(file: Path, record: dict[str, Any], checkpoint: Path) -> None:
    """``torch.save`` ``record`` to ``file`` with the safe-load pickler, flushed to the disk."""
    try:
        torch.save(record, file, pickle_module=_META_PICKLE)
        fsync_file(file)
    except OSError as error:
        raise CheckpointWriteError(error.errno, describe_write_failure(error, checkpoint, file)) from error


def _write_shard(engine: ZeroEngine, owners: dict[int, tuple[int, torch.optim.Optimizer]], target: Path,
                 exclude_frozen: bool = False, metadata: Optional[dict[str, str]] = None) -> str:
    """Write this rank's shard file (safetensors) one flat group at a time, so that no more than one
    group's state is in memory (with NVMe offload the rest stays in swap files), and flush it to the
    disk; returns its SHA-256. ``metadata`` goes in the header's ``__metadata__`` (which save wrote it).

    The header (names, dtypes, shapes, offsets) is known only once every group has been visited, so
    the tensors go straight into ``target`` after room reserved for it; the header then fills that
    room, padded with spaces as the safetensors format allows. If it outgrew the room, the tensor
    bytes are moved up in place. The disk holds one copy of the shard at any time, and every byte
    is written once (the tensor bytes twice on the move-up path); the file is read back once for
    its checksum.
    """
    room = _HEADER_ROOM_BASE + _HEADER_ROOM_PER_GROUP * len(engine.groups)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    with open(target, "w+b") as out:
        out.seek(8 + room)
        for i, group in enumerate(engine.groups):
            if exclude_frozen and not group.trainable:
                continue
            with engine.state_resident(write_back=False, groups=[group]):
                for name, tensor in _group_tensors(i, group, owners).items():
                    data = tensor.detach().contiguous().cpu()
                    nbytes = data.numel() * data.element_size()
                    header[name] = {"dtype": SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape),
                                    "data_offsets": [offset, offset + nbytes]}
                    if nbytes:
                        out.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                    offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        if len(encoded) > room:
            grow = -(-(len(encoded) - room) // 8) * 8
            _move_up(out, 8 + room, offset, grow)
            room += grow
        out.seek(0)
        out.write(struct.pack("<Q", room) + encoded + b" " * (room - len(encoded)))
        out.flush()
        os.fsync(out.fileno())
    return _sha256(target)


# Room for a shard file's header: about 5 entries of ~100 bytes per group fit in the share per
# group; a larger header costs one in-place move of the tensor bytes, nothing else. Multiples of
# 8, so the tensor bytes stay 8-byte aligned as safetensors wants.
_HEADER_ROOM_BASE = 4096


_HEADER_ROOM_PER_GROUP = 1024


def _move_up(f: Any, start: int, length: int, by: int, chunk: int = 1 << 23) -> None:
    """Move bytes ``[start, start + length)`` of open file ``f`` to ``start + by``, last chunk first
    (so nothing is overwritten before it is moved)."""
    end = start + length
    while end > start:
        begin = max(start, end - chunk)
        f.seek(begin)
        block = f.read(end - begin)
        f.seek(begin + by)
        f.write(block)
        end = begin
