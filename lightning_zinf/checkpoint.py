"""Sharded checkpoints: every rank writes its own shards, any world size can read them back.

A checkpoint is a directory::

    meta.pt                        rank 0: the caller's state (Lightning's loops, callbacks,
                                   schedulers, buffers...) plus ``"zinf"``: the layout of every flat
                                   group (parameter names and tied aliases, shapes, offsets in the
                                   flat buffer, dtype), the world size that wrote it, the save's id,
                                   the folder holding its shards and a SHA-256 checksum of each
    save-<id>/                     the shard files of the save ``meta.pt`` names
        rank_00000.safetensors     rank r's shards: per flat group ``g``, ``g.param`` (its shard in
        rank_00001.safetensors     the parameter dtype), ``g.master`` (fp32 master, when separate)
        ...                        and ``g.opt<o>.<key>`` (optimizer ``o``'s per-element state, laid
                                   out like the shard); per-parameter scalar state (Adam's ``step``)
                                   as ``g.opt<o>.<key>.scalar``, one value per parameter. The header
                                   records the save's id, the rank and the world size.

(Checkpoints of earlier versions keep the shard files beside ``meta.pt``; they load the same way.)

``meta.pt`` is a pickle, so reading it could run code the file names. It is read with torch's
weights-only unpickler, which builds tensors, containers and primitives only, plus the few classes
Lightning's checkpoint state holds (:data:`CHECKPOINT_GLOBALS`); anything else is refused unless the
caller passes ``weights_only=False`` for a file they trust.

Because every per-element tensor is stored in the flat layout of its group, a rank of any new world
size computes which elements it owns and reads just those byte ranges of the old files
(safetensors reads slices without loading whole tensors).

Saves are crash-safe (:mod:`lightning_zinf.durable`): a save writes its shards into a new
``save-<id>`` folder and flushes them to the disk, then replaces ``meta.pt`` in one atomic step (a
new checkpoint's whole folder is staged beside it and renamed into place), and only then removes the
previous save's folder. Whenever a process dies, the checkpoint's name holds the previous complete
checkpoint or the new one.
"""

from __future__ import annotations

import copyreg
import errno
import hashlib
import json
import logging
import os
import pathlib
import pickle
import secrets
import shutil
import struct
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict
from torch import Tensor, nn

from lightning_zinf.durable import (STAGING_SUFFIX, CheckpointWriteError, clean_stale, describe_write_failure, fsync_file,
                                    fsync_folder, is_torch_file, put_new, replace_file, replace_kind, space_message)
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.offload.preflight import shortfall
from lightning_zinf.tiling import tile_views

log = logging.getLogger(__name__)

__all__ = ["save_sharded", "save_sharded_models", "shard_layout_state", "optimizer_owners", "placed_scalar_state",
           "MODELS_KEY", "MODELS_DIR_KEY", "OPTIMIZER_KEYS", "model_folders", "load_sharded", "load_full_state_dict",
           "is_sharded_checkpoint", "read_meta", "CheckpointError", "CheckpointWriteError", "CHECKPOINT_GLOBALS", "META_FILE"]

META_FILE = "meta.pt"
FORMAT = "lightning_zinf.sharded"
#: Version 2 records each group's ``shard_numel`` (shards padded to whole 16-element runs);
#: version 1 shards held ``ceil(numel / world_size)`` elements. Both are read.
VERSION = 2


#: The globals beyond torch's weights-only set that ``meta.pt`` may name: what Lightning's checkpoint
#: state holds. Found by saving Trainer checkpoints (ModelCheckpoint and EarlyStopping state, LR
#: schedulers of every kind, loops, 16-mixed and bf16 precision, model and datamodule
#: ``save_hyperparameters()``) and reading them back with ``weights_only=True``: a ``pathlib`` path
#: (``PosixPath`` saved on Linux, ``WindowsPath`` on Windows), and an ``AttributeDict`` nested in the
#: hyper-parameters (Lightning saves the outer one as a dict; Fabric's class is its base). Building
#: any of them runs nothing but the class's own constructor.
CHECKPOINT_GLOBALS = (AttributeDict, FabricAttributeDict, pathlib.PosixPath, pathlib.WindowsPath)


def _as_call(mapping: dict) -> tuple:
    return type(mapping), (dict(mapping),)


class _MetaPickler(pickle.Pickler):
    """Pickles an ``AttributeDict`` as a call of its class on a plain dict. Pickle's own form for a
    dict subclass (an empty instance, then its items set one by one) is one torch's weights-only
    unpickler refuses whatever the allow-list: it sets items on plain dicts only."""

    dispatch_table = {**copyreg.dispatch_table, AttributeDict: _as_call, FabricAttributeDict: _as_call}


_META_PICKLE = types.ModuleType("lightning_zinf_meta_pickle")
_META_PICKLE.Pickler = _MetaPickler  # type: ignore[attr-defined]  # what torch.save takes from a pickle module


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, of a different model, or naming code
    that the safe (weights-only) unpickler refuses to run."""


def _sha256(file: Path, chunk: int = 1 << 23) -> str:
    """SHA-256 of a file, read in 8 MiB chunks (a shard file can be larger than free memory)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_version(zinf: dict[str, Any], path: Path) -> int:
    """The checkpoint format version of ``zinf`` (the layout entry of ``meta.pt``; 1 if absent).

    Raises:
        CheckpointError: a version newer than this code reads, naming the fix (upgrade).
    """
    version = zinf.get("version", 1)
    if version > VERSION:
        raise CheckpointError(
            f"{path} was written in checkpoint format version {version} by a newer lightning_zinf; this one "
            f"reads versions up to {VERSION}: upgrade lightning_zinf to load it."
        )
    return version


def read_meta(path: os.PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The dict saved in ``path``'s ``meta.pt`` (on the CPU), read without running code from the file
    unless ``weights_only=False``.

    Args:
        path: A checkpoint directory (:func:`is_sharded_checkpoint`).
        weights_only: ``None`` (Lightning's default) or ``True``: torch's weights-only unpickler,
            which allows tensors, containers and primitives, :data:`CHECKPOINT_GLOBALS` (for this
            call only) and whatever the user allowed with ``torch.serialization.add_safe_globals``.
            ``False``: the full unpickler, for a file the user trusts; it runs whatever code the file
            names. (torch >= 2.6 also reads ``None`` as ``True``; here it is so on every version.)

    Raises:
        CheckpointError: the file names a global the safe load refuses (the message names it, the
            file and both fixes), or it cannot be read at all (corrupt).
    """
    file = Path(path) / META_FILE
    if weights_only is False:
        loaded = _load_meta(file, weights_only=False)
    else:
        with torch.serialization.safe_globals(list(CHECKPOINT_GLOBALS)):
            try:
                loaded = _load_meta(file, weights_only=True)
            except CheckpointError as error:
                refused = _refused_globals(file)
                if not refused:
                    raise CheckpointError(
                        f"{file} cannot be read with the safe (weights-only) load ({error.__cause__}). Either it "
                        "is corrupt, or it holds an object that load cannot build (a checkpoint written by "
                        "lightning_zinf before it read meta.pt safely, with an AttributeDict in its "
                        "hyper-parameters): if you trust the file, load it with weights_only=False, as "
                        "trainer.fit(model, ckpt_path=..., weights_only=False) or zinf-consolidate --no-weights-only."
                    ) from error.__cause__
                raise CheckpointError(
                    f"{file} names {', '.join(refused)}, which the safe (weights-only) load refuses to import: "
                    "unpickling it could run code from the file. If it is a class you know to be harmless, allow "
                    f"it with torch.serialization.add_safe_globals([{refused[0]}]) before loading. If you trust "
                    "the file, load it with weights_only=False: trainer.fit(model, ckpt_path=..., "
                    "weights_only=False) (likewise validate/test/predict), fabric.load(..., weights_only=False), "
                    "load_sharded(..., weights_only=False), consolidate(..., weights_only=False) or "
                    "zinf-consolidate --no-weights-only."
                ) from error.__cause__
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{file} holds a {type(loaded).__name__}, not a checkpoint's metadata dict.")
    return loaded


def _load_meta(file: Path, weights_only: bool) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as error:  # the full unpickler can fail with anything the file's code raises
        raise CheckpointError(f"{file} cannot be read ({error}); the checkpoint is corrupt.") from error


def _refused_globals(file: Path) -> list[str]:
    """The globals ``file``'s pickle names that the weights-only unpickler (with the allow-list in
    force) refuses; empty if there are none or the file cannot be parsed."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # a corrupt file: reported as such by the caller
        return []


def shard_file(rank: int) -> str:
    """The name of rank ``rank``'s shard file inside a checkpoint directory."""
    return f"rank_{rank:05d}.safetensors"


def is_sharded_checkpoint(path: os.PathLike) -> bool:
    """True if ``path`` is a directory written by :func:`save_sharded`."""
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


# --- layout -----------------------------------------------------------------------------------------
def _layout(engine: ZeroEngine) -> list[dict[str, Any]]:
    aliases: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    views = tile_views(engine.module)

    def view(p: Tensor) -> Optional[dict[str, Any]]:
        v = views.get(id(p))
        return None if v is None else {"of": v.name, "shape": list(v.shape), "start": list(v.start)}

    return [
        {
            "unit": unit.name,
            "names": group.names,
            "aliases": [aliases.get(id(p), [n]) for p, n in zip(group.params, group.names)],
            # A TiledLinear's tiles: which part of the untiled layer's tensor each one is.
            "views": [view(p) for p in group.params],
            "shapes": [list(s) for s in group.shapes],
            "offsets": group.offsets,
            "dtype": str(group.dtype).removeprefix("torch."),
            "numel": group.numel,
            "shard_numel": group.shard_numel,
            "trainable": group.trainable,
        }
        for unit in engine.units
        for group in unit.groups
    ]


def _prefixed(old: list[str], new: list[str]) -> bool:
    """The same names up to one prefix added to or removed from all of them."""
    longer, shorter = (old, new) if len(old[0]) > len(new[0]) else (new, old)
    extra = longer[0][: len(longer[0]) - len(shorter[0])]
    return len(old) == len(new) and bool(extra) and all(a == extra + b for a, b in zip(longer, shorter))


def _check_layout(saved: list[dict[str, Any]], current: list[dict[str, Any]], path: Path) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"{path} holds {len(saved)} flat groups but the model has {len(current)}: it was saved from a "
            "different model (or with different block_classes or tiling; to move weights between tilings, "
            "consolidate the checkpoint and load it with load_full_state_dict)."
        )
    for old, new in zip(saved, current):
        for key in ("names", "shapes", "dtype", "trainable"):
            if old[key] != new[key] and key == "dtype":
                raise CheckpointError(
                    f"{path} stores unit '{new['unit']}' in {old[key]}, but the model now stores it in "
                    f"{new[key]} (a different MixedPrecisionConfig.frozen_dtype, or parameters cast after "
                    "saving?): use the settings it was saved with, or consolidate the checkpoint and load "
                    "it with load_full_state_dict, which converts."
                )
            if old[key] != new[key] and key == "names" and _prefixed(old[key], new[key]):
                raise CheckpointError(
                    f"{path} names the model's parameters with another prefix ({old[key][0]!r} in the checkpoint, "
                    f"{new[key][0]!r} in the model): it was saved from a module that holds this one, or is held "
                    "by it (a LightningModule's checkpoint loaded into its bare model, or the reverse). Load it into "
                    "the same module class it was saved from (with Fabric, set up the LightningModule itself), or "
                    "consolidate it and load it with load_full_state_dict(..., prefix=...)."
                )
            if old[key] != new[key]:
                raise CheckpointError(
                    f"{path} was saved from a different model: unit '{new['unit']}' has {key} "
                    f"{new[key]} in the model but {old[key]} in the checkpoint (a different tiling? "
                    "consolidate the checkpoint and load it with load_full_state_dict)."
                )


# --- save -------------------------------------------------------------------------------------------
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
    if rank != 0:
        return
    try:
        shutil.rmtree(save.root if save.root != save.path else save.data, ignore_errors=True)
    except OSError:  # best effort: debris is removed by the next save in the folder
        pass


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


def _remove_previous(save: _Save) -> None:
    """Remove everything in the checkpoint folder but ``meta.pt`` and the save it names: the
    previous save's data folder, or files of the older layout (shards beside ``meta.pt``). A crash
    here leaves files no ``meta.pt`` names, removed by the next save of this name."""
    for entry in save.root.iterdir():
        if entry.name in (META_FILE, save.tag):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    fsync_folder(save.root)


def _shard_bytes(engine: ZeroEngine, owners: dict[int, tuple[int, torch.optim.Optimizer]], exclude_frozen: bool) -> int:
    """About the bytes this rank writes, from the shapes and dtypes alone (nothing is read from
    NVMe): each group's shard, its fp32 master when separate, and the per-element state of the
    optimizer stepping it, plus the header's room; on rank 0 also room for ``meta.pt`` (the layout
    takes about a kilobyte per group, the caller's state usually less than the 64 KiB added)."""
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
    """Every rank writes its shard file into ``folder`` and flushes it to the disk; returns every
    rank's SHA-256 (collective). The file's header records ``save_id``, the rank and the world size.

    Raises:
        CheckpointWriteError: on every rank, if any rank's write failed (full disk...), naming it."""
    file = folder / shard_file(engine.comm.rank)
    metadata = {"zinf_save": save_id, "zinf_rank": str(engine.comm.rank), "zinf_world_size": str(engine.comm.world_size)}
    checksum = failure = None
    try:
        checksum = _write_shard(engine, optimizer_owners(optimizers), file, exclude_frozen, metadata)
    except OSError as error:
        failure = (error.errno, describe_write_failure(error, save.path, file))
    results = engine.comm.all_gather_object((checksum, failure))
    failed = [(rank, failure) for rank, (_, failure) in enumerate(results) if failure is not None]
    if failed:
        code, text = failed[0][1]
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise CheckpointWriteError(code, f"rank{'s' if len(failed) > 1 else ''} {ranks}: {text}")
    return [checksum for checksum, _ in results]


def _zinf_record(engine: ZeroEngine, optimizers: list[torch.optim.Optimizer], checksums: list[str],
                 exclude_frozen: bool, save_id: str, folder: str) -> dict[str, Any]:
    groups = [{**layout, "excluded": exclude_frozen and not layout["trainable"]} for layout in _layout(engine)]
    # Per optimizer saved, where each parameter it was given went (ZeroEngine.plain_layouts): what
    # consolidation needs to number its state as the plain optimizer would.
    layouts = [engine.plain_layouts[k] for o in optimizers for k, mine in enumerate(engine.optimizers) if mine is o]
    return {"format": FORMAT, "version": VERSION, "world_size": engine.comm.world_size, "groups": groups,
            "sha256": checksums, "optimizers": layouts, "save": save_id, "dir": folder}


def save_sharded(
    engine: ZeroEngine, optimizers: Iterable[torch.optim.Optimizer], path: os.PathLike, meta: dict[str, Any],
    *, exclude_frozen: bool = False,
) -> None:
    """Write a sharded checkpoint of ``engine``'s model and ``optimizers`` to the directory ``path``.

    Collective: every rank must call it with the same ``path``. Crash-safe (:mod:`lightning_zinf.durable`):
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
        FileExistsError: ``path`` exists and is neither a checkpoint written by this package nor a
            ``torch.save`` file (a full checkpoint, which it replaces).
        CheckpointWriteError: on every rank: the ranks sharing a filesystem need more room than it
            has (the message gives the bytes needed and free; nothing is written), or a write failed
            (full disk, permissions: the rank, file and cause are named; what was written is removed).
            The previous checkpoint at ``path``, if any, is untouched.
    """
    path = Path(path)
    comm = engine.comm
    optimizers = list(optimizers)
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


#: ``meta.pt`` of a checkpoint of several models: model key -> the keys of its optimizers.
MODELS_KEY = "zinf_models"
#: ``meta.pt`` of a checkpoint of several models: the folder (inside the checkpoint) holding one
#: sharded checkpoint per model key.
MODELS_DIR_KEY = "zinf_dir"
#: ``meta.pt`` of a Fabric checkpoint of one model: the keys its optimizers' states were saved under.
OPTIMIZER_KEYS = "zinf_optimizer_keys"


def model_folders(path: os.PathLike, meta: dict[str, Any]) -> dict[str, Path]:
    """Model key -> the folder of its sharded checkpoint, for a checkpoint of several models
    (:func:`save_sharded_models`) whose ``meta.pt`` holds ``meta``."""
    return {key: Path(path) / meta.get(MODELS_DIR_KEY, "") / key for key in meta[MODELS_KEY]}


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
        FileExistsError: as :func:`save_sharded`.
        CheckpointWriteError: as :func:`save_sharded`; the previous checkpoint at ``path`` is untouched.
    """
    path = Path(path)
    comm = next(iter(models.values()))[0].comm
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


# --- load -------------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_DTYPE_OF = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


class _RangeFile:
    """Element ranges of the 1-D tensors of one safetensors file, read with ``os.pread``.

    safetensors' own reader maps the file into memory, so every page it touches counts as resident
    memory: consolidating a 1.4 GB checkpoint that way peaked at 0.95x the model. Reading just the
    byte range needed keeps resident memory at the pieces in use.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._mapped: Optional[torch.UntypedStorage] = None
        self._fd = os.open(path, os.O_RDONLY)
        (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        try:
            header = json.loads(os.pread(self._fd, size, 8))
        except (ValueError, MemoryError, OverflowError) as error:
            os.close(self._fd)
            self._fd = -1
            raise CheckpointError(f"{path} is not a safetensors file: its header cannot be read ({error}).") from error
        #: What the writer recorded (a shard file: ``zinf_save``, ``zinf_rank``, ``zinf_world_size``).
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base = 8 + size
        self._entries = header

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> list[int]:
        return list(self._entries[key]["shape"])

    def read(self, key: str, lo: int, hi: int) -> Tensor:
        """Elements ``[lo, hi)`` of the flattened (row-major) tensor ``key``: one byte range."""
        entry = self._entries[key]
        dtype = _DTYPE_OF[entry["dtype"]]
        item = torch.empty(0, dtype=dtype).element_size()
        start = self._base + entry["data_offsets"][0] + lo * item
        data = bytearray(os.pread(self._fd, (hi - lo) * item, start))
        return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)

    def tensor(self, key: str) -> Tensor:
        """The whole tensor ``key``, memory-mapped (copy-on-write): its bytes are read from disk
        only where it is used, so a state dict of every tensor of the file costs no memory."""
        entry = self._entries[key]
        dtype = _DTYPE_OF[entry["dtype"]]
        if self._mapped is None:
            self._mapped = torch.UntypedStorage.from_file(str(self._path), shared=False,
                                                          nbytes=os.fstat(self._fd).st_size)
        start, end = (self._base + at for at in entry["data_offsets"])
        raw = torch.empty(0, dtype=torch.uint8).set_(self._mapped, start, (end - start,))
        if start % raw.new_empty(0, dtype=dtype).element_size():
            raw = raw.clone()  # a misaligned record (the format does not promise alignment): read it
        return raw.view(dtype).reshape(entry["shape"])

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)


class ShardReader:
    """Reads element ranges of flat tensors spread over the old ranks' files."""

    def __init__(self, path: Path, zinf: dict[str, Any]) -> None:
        self._version = check_version(zinf, path)
        self.path = path
        self.folder = path / zinf.get("dir", "")  # older checkpoints keep the shards beside meta.pt
        self.sha256 = zinf["sha256"]
        self._save = zinf.get("save")
        self._groups = zinf["groups"]
        self._world_size = zinf["world_size"]
        self._files: dict[int, Any] = {}

    def shard_numel(self, i: int) -> int:
        """Elements per old rank's shard of flat group ``i`` (version 1 did not pad shards to
        :data:`lightning_zinf.engine.flat.SHARD_ALIGN`, so its size follows from ``numel`` and the world size)."""
        group = self._groups[i]
        if self._version == 1:
            return -(-group["numel"] // self._world_size)
        if "shard_numel" not in group:
            raise CheckpointError(f"{self.path / META_FILE} (format version {self._version}) lacks group {i}'s "
                                  "shard_numel: the checkpoint is corrupt.")
        return group["shard_numel"]

    def _file(self, rank: int) -> Any:
        if rank not in self._files:
            file = self.folder / shard_file(rank)
            if not self.folder.is_dir():
                saves = sorted(p.name for p in self.path.glob("save-*"))
                raise CheckpointError(
                    f"{self.path / META_FILE} names the shard folder {self.folder.name}, which is not in {self.path} "
                    f"(it holds {', '.join(saves) or 'no shard folder'}): {META_FILE} comes from a different save "
                    f"(of {self._world_size} ranks) than the files beside it. Load each checkpoint folder as its save "
                    "wrote it.")
            if not file.is_file():
                held = len(list(self.folder.glob("rank_*.safetensors")))
                raise CheckpointError(f"Shard file {file} is missing: the checkpoint is incomplete ({META_FILE} was "
                                      f"written by {self._world_size} ranks; the folder holds {held} shard files).")
            if _sha256(file) != self.sha256[rank]:
                raise CheckpointError(self._mismatch(file, rank))
            self._files[rank] = _RangeFile(file)
        return self._files[rank]

    def _mismatch(self, file: Path, rank: int) -> str:
        """Why ``file``'s checksum differs from the one ``meta.pt`` records: a file of another save
        (named by the save, rank and world size recorded in both), one laid out for another model
        or world size, or damage."""
        meta = self.path / META_FILE
        mixed = (f"{file} and {meta} come from different saves, so they cannot be loaded together: a checkpoint's "
                 "files were mixed with another's (copied over each other, or a folder merged). Load each "
                 "checkpoint folder as its save wrote it.")
        try:
            reader = _RangeFile(file)
        except (CheckpointError, OSError):
            return f"Shard file {file} is corrupt or truncated (its SHA-256 does not match {META_FILE}; its header cannot be read)."
        saved = reader.metadata
        if saved.get("zinf_save") and self._save and saved["zinf_save"] != self._save:
            return (f"{mixed} The shard was written by save {saved['zinf_save']} as rank {saved.get('zinf_rank')} of "
                    f"{saved.get('zinf_world_size')}; {META_FILE} by save {self._save} of {self._world_size} ranks.")
        for i in range(len(self._groups) + 1):
            key = f"{i}.param"
            found = reader.shape(key) if key in reader.keys() else None
            expected = None if i == len(self._groups) or self._groups[i].get("excluded") else [self.shard_numel(i)]
            if found != expected:
                what = "no such group" if expected is None else f"{expected[0]} elements of '{self._groups[i]['names'][0]}'"
                return (f"{mixed} {META_FILE} describes a model of {len(self._groups)} flat groups saved by "
                        f"{self._world_size} ranks, but the shard's group {i} has {found} where {META_FILE} expects "
                        f"{what} (another world size or another model).")
        if (self.folder / shard_file(self._world_size)).exists():
            return (f"{mixed} The folder holds shard files of more ranks than the {self._world_size} that wrote "
                    f"{META_FILE} ({shard_file(self._world_size)} is there).")
        return f"Shard file {file} is corrupt or truncated (its SHA-256 does not match {META_FILE})."

    def keys(self) -> list[str]:
        """The tensor names (every rank's file has the same)."""
        return self._file(0).keys()

    def has(self, key: str) -> bool:
        return key in self.keys()

    def read(self, key: str, lo: int, hi: int, old_shard: int) -> Tensor:
        """Elements ``[lo, hi)`` of the flat tensor ``key`` (old shards of ``old_shard`` elements)."""
        pieces = []
        for rank in range(lo // old_shard, -(-hi // old_shard)):
            start = max(lo, rank * old_shard) - rank * old_shard
            stop = min(hi, (rank + 1) * old_shard) - rank * old_shard
            pieces.append(self._file(rank).read(key, start, stop))
        if pieces:
            return torch.cat(pieces)
        # This rank owns only padding: an empty tensor of the stored dtype, from a file header
        # (no checksum pass over a whole file this rank does not otherwise read).
        if 0 in self._files or not (self.folder / shard_file(0)).is_file():
            return self._file(0).read(key, 0, 0)  # (a missing file raises the checkpoint's error)
        return _RangeFile(self.folder / shard_file(0)).read(key, 0, 0)


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
        CheckpointError: ``path`` is not a checkpoint, a shard file is missing or corrupt, the
            checkpoint was saved from a different model, or ``meta.pt`` names code the safe load refuses.

    Frozen groups saved with ``exclude_frozen`` keep the values they have now.
    """
    path = Path(path)
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
    _check_layout(zinf["groups"], _layout(engine), path)
    owners = optimizer_owners(optimizers if isinstance(optimizers, dict) else list(optimizers))
    engine.release_all()
    for i, group in enumerate(engine.groups):
        if zinf["groups"][i].get("excluded", False):
            continue  # saved without its frozen values: the model's own stay
        # One group's state in memory at a time (with NVMe offload the rest stays in swap files).
        with engine.state_resident(write_back=True, groups=[group]):
            old_shard = reader.shard_numel(i)
            # A rank may own only padding (a small group over many ranks): then lo == hi.
            lo = min(group.shard_start, group.numel)
            hi = min(group.shard_start + group.shard_numel, group.numel)
            group.shard.zero_()
            group.shard[: hi - lo].copy_(reader.read(f"{i}.param", lo, hi, old_shard))
            if load_optimizer and group.master is not None and group.master is not group.shard:
                source = f"{i}.master" if reader.has(f"{i}.master") else f"{i}.param"
                group.master.zero_()
                group.master[: hi - lo].copy_(reader.read(source, lo, hi, old_shard))
            elif group.master is not None and group.master is not group.shard:
                group.master.copy_(group.shard)
            if load_optimizer:
                _load_group_state(i, group, owners, reader, lo, hi, old_shard)
    engine.after_step()  # re-gather persistent units from the loaded shards
    return meta


def placed_scalar_state(value: Tensor, fragment: Tensor, optimizer: torch.optim.Optimizer) -> Tensor:
    """A restored per-parameter scalar state (Adam's ``step``) placed as torch's own
    ``Optimizer.load_state_dict`` places it: fp32, on the fragment's device for a ``fused`` or
    ``capturable`` param group (their kernels read it there), else on the CPU; always a copy (not a
    view of a memory-mapped checkpoint)."""
    group = next(g for g in optimizer.param_groups if any(p is fragment for p in g["params"]))
    on_device = group.get("fused") or group.get("capturable")
    return value.to(dtype=torch.float32, device=fragment.device if on_device else "cpu", copy=True)


def _load_group_state(
    i: int, group: FlatGroup, owners: dict[int, tuple[int, torch.optim.Optimizer]], reader: ShardReader,
    lo: int, hi: int, old_shard: int,
) -> None:
    ranges = group.owned_ranges()
    keys = reader.keys()
    flat: dict[str, Tensor] = {}
    for j, fragment in enumerate(group.fragments):
        if id(fragment) not in owners:
            continue
        o, optimizer = owners[id(fragment)]
        prefix = f"{i}.opt{o}."
        state: dict[str, Tensor] = {}
        for key in keys:
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if name.endswith(".scalar"):
                value = reader.read(key, 0, len(group.params), len(group.params))[j]
                if not torch.isnan(value):
                    state[name.removesuffix(".scalar")] = placed_scalar_state(value, fragment, optimizer)
                continue
            if name not in flat:
                data = reader.read(key, lo, hi, old_shard)
                flat[name] = torch.zeros(group.shard_numel, dtype=data.dtype, device=group.state_device)
                flat[name][: hi - lo].copy_(data)
            a, b = ranges[j]
            state[name] = flat[name][a:b]
        if state:
            optimizer.state[fragment] = state
        else:
            optimizer.state.pop(fragment, None)


# --- plain (unpartitioned) state dicts ------------------------------------------------------------------
class _TorchFile:
    """The tensors of a ``torch.save`` file (``pytorch_model.bin``), memory-mapped: a slice read
    touches only its own pages."""

    def __init__(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped: read it whole
            state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of tensors.")
        self._tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> list[int]:
        return list(self._tensors[key].shape)

    def tensor(self, key: str) -> Tensor:
        """The whole tensor ``key`` (memory-mapped unless the file's format cannot be)."""
        return self._tensors[key]


#: What a Hugging Face model folder may hold, in the order they are looked for.
_HF_CHECKPOINTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def _checkpoint_files(path: Path) -> list[Path]:
    """The files of a checkpoint: the file itself, or in a Hugging Face model folder the single
    or sharded (``*.index.json``) safetensors checkpoint, else the ``pytorch_model.bin`` one."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist (expected a .safetensors or .bin file, or a Hugging Face model folder).")
    for name in _HF_CHECKPOINTS:
        found = path / name
        if not found.is_file():
            continue
        if name.endswith(".index.json"):
            weight_map = json.loads(found.read_text()).get("weight_map", {})
            files = [path / f for f in sorted(set(weight_map.values()))]
            absent = [str(f) for f in files if not f.is_file()]
            if absent:
                raise CheckpointError(f"{found} names shard files that are not there: {', '.join(absent)}.")
            return files
        return [found]
    raise CheckpointError(
        f"{path} holds none of {', '.join(_HF_CHECKPOINTS)}: not a Hugging Face model folder "
        "(pass the checkpoint file itself, or the folder `save_pretrained` wrote)."
    )


def _checkpoint_names(name: str) -> list[str]:
    """The names a model's parameter may have in a checkpoint of the unwrapped model: its own, and
    without PEFT's ``base_layer`` (a LoRA-wrapped layer keeps the original weight there)."""
    return [name, name.replace(".base_layer.", ".")] if ".base_layer." in name else [name]


def checkpoint_keys(source: os.PathLike | str) -> set[str]:
    """The tensor names a checkpoint holds (as :func:`load_full_state_dict` takes it: a Hugging
    Face model folder, a ``.safetensors`` or ``torch.save`` file); reads headers only.

    Raises:
        CheckpointError: not a checkpoint, or a sharded one's index names absent files.
    """
    return _Source(source).keys()


def matching_prefix(module: nn.Module, keys: set[str]) -> str:
    """Where a checkpoint's model sits inside ``module``: the prefix (``""``, or a submodule's
    qualified name and a dot) under which the most of its ``keys`` (:func:`checkpoint_keys`) name
    a parameter or buffer, counting PEFT-wrapped layers' ``base_layer`` (e.g.
    ``"model.base_model.model."`` for a LightningModule holding a PEFT model as ``self.model``).

    Raises:
        CheckpointError: no prefix matches any key.
    """
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)] + [n for n, _ in module.named_buffers()]
    counts: dict[str, int] = {}
    for prefix in [""] + [f"{n}." for n, _ in module.named_modules() if n]:
        found = {key for n in names if n.startswith(prefix) for key in _checkpoint_names(n[len(prefix):])}
        counts[prefix] = len(keys & found)
    best = max(counts, key=lambda p: (counts[p], -len(p)))
    if counts[best] == 0:
        raise CheckpointError(f"None of the checkpoint's keys ({sorted(keys)[:5]} ...) names a parameter of "
                              f"{type(module).__name__} under any prefix.")
    return best


def provided_parameters(module: nn.Module, keys: set[str], prefix: str) -> list[str]:
    """Qualified names of ``module``'s parameters that a checkpoint with ``keys``
    (:func:`checkpoint_keys`) holds under ``prefix``."""
    return [n for n, _ in module.named_parameters(remove_duplicate=False)
            if n.startswith(prefix) and any(k in keys for k in _checkpoint_names(n[len(prefix):]))]


class _Source:
    """The tensors of a checkpoint, memory-mapped (a ``.safetensors`` or ``torch.save`` file, a
    Hugging Face model folder of either, sharded or not), or of an in-memory mapping."""

    def __init__(self, source: os.PathLike | str | dict[str, Tensor]) -> None:
        self._mapping: Optional[dict[str, Tensor]] = None
        self._file_of: dict[str, Any] = {}
        if isinstance(source, dict):
            self.where, self._mapping = "the state dict", source
            return
        self.where = str(source)
        for path in _checkpoint_files(Path(source)):
            reader = _RangeFile(path) if path.suffix == ".safetensors" else _TorchFile(path)
            for key in reader.keys():
                self._file_of.setdefault(key, reader)

    def keys(self) -> set[str]:
        return set(self._mapping) if self._mapping is not None else set(self._file_of)

    def shape(self, key: str) -> list[int]:
        return list(self._mapping[key].shape) if self._mapping is not None else self._file_of[key].shape(key)

    def tensor(self, key: str) -> Tensor:
        """The whole tensor, memory-mapped from a file (read only where it is used)."""
        return self._mapping[key] if self._mapping is not None else self._file_of[key].tensor(key)


def load_full_state_dict(
    engine: ZeroEngine,
    source: os.PathLike | str | dict[str, Tensor],
    *,
    prefix: str = "",
    strict: bool = True,
) -> list[str]:
    """Load a plain, unpartitioned state dict into the partitioned model, through the model's own
    ``load_state_dict`` (each module's ``_load_from_state_dict`` and load pre-hooks run, as on the
    plain model: a :class:`~lightning_zinf.TiledLinear` cuts the untiled ``weight`` into its tiles,
    a LoRA layer remaps its keys), one unit at a time: each rank gathers a unit, takes the values
    and keeps its slice (:mod:`lightning_zinf.engine.state_dict`). Files are memory-mapped, so a
    rank reads a tensor's bytes when its unit loads and never holds the whole model. For starting
    fine-tuning from pretrained weights.

    Collective: call it on every rank. With NVMe offload one flat group's state is in memory at a
    time.

    Args:
        engine: The engine partitioning the model.
        source: A Hugging Face model folder (what ``save_pretrained`` writes: ``model.safetensors``,
            or shards with ``model.safetensors.index.json``, or ``pytorch_model.bin``, sharded or
            not), a ``.safetensors`` file, a ``torch.save`` file of a state dict, or a mapping of
            names to full tensors. Values are converted to each parameter's dtype (a bf16
            checkpoint into fp32 masters exactly); a tied parameter takes any of its names; a
            PEFT-wrapped layer's ``base_layer`` takes the layer's name.
        prefix: Where the pretrained model sits inside ``engine.module``: parameter ``prefix + key``
            of the partitioned model takes ``source[key]`` (e.g. ``"model."`` for a LightningModule
            holding the network as ``self.model``). Parameters outside the prefix are left as they are.
        strict: Raise if a parameter under ``prefix`` has no entry in ``source`` or ``source`` has
            entries matching no parameter or buffer.

    Returns:
        The keys of ``source`` that no module took (empty when ``strict``).

    Raises:
        CheckpointError: the file does not exist, a shape differs, or (``strict``) keys are missing
            or unexpected by name (checked before anything is loaded, so a model whose modules
            rename keys themselves loads with ``strict=False``); the message names them.
    """
    src = _Source(source)
    available = src.keys()
    module = engine.module
    aliases: dict[int, list[str]] = {}  # parameter id -> its names in the model (tied: several)
    for name, p in module.named_parameters(remove_duplicate=False):
        if name.startswith(prefix):
            aliases.setdefault(id(p), []).append(name)
    shapes = {id(p): shape for g in engine.groups for p, shape in zip(g.params, g.shapes)}
    # A TiledLinear loads as the nn.Linear it replaces ("fc.weight"): its own pre-hook cuts the tiles.
    views = tile_views(module)
    tiled = {view.name: view for view in views.values() if view.name.startswith(prefix)}
    mapping: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for p_id, names in aliases.items():
        if p_id in views:
            continue  # a tile: loaded by its layer's entry below
        keys = [k for n in names for k in _checkpoint_names(n[len(prefix):])]
        key = next((k for k in keys if k in available), None)
        if key is None:
            missing.append(names[0])
            continue
        used.update(k for k in keys if k in available)
        expected = list(shapes.get(p_id, ()))
        if src.shape(key) != expected:
            raise CheckpointError(f"{src.where}: '{key}' has shape {src.shape(key)} but the model's parameter has {expected}.")
        for name in names:
            mapping[name] = src.tensor(key)
    for name, view in tiled.items():
        key = name[len(prefix):]
        if key not in available:
            missing.append(name)
            continue
        if src.shape(key) != list(view.shape):
            raise CheckpointError(f"{src.where}: '{key}' has shape {src.shape(key)} but the model's layer has "
                                  f"{list(view.shape)}.")
        used.add(key)
        mapping[name] = src.tensor(key)
    buffers = {key: n for n, _ in module.named_buffers() if n.startswith(prefix) for key in _checkpoint_names(n[len(prefix):])}
    saved = {f"{m}.{b}" if m else b for m, owner in module.named_modules() for b in owner._buffers
             if b not in owner._non_persistent_buffers_set}
    for key in available & set(buffers):
        used.add(key)  # a buffer the model does not save (BERT's position_ids) is matched, not loaded
        if buffers[key] in saved:
            mapping[buffers[key]] = src.tensor(key)
    unmatched = sorted(available - used)
    if strict and (missing or unmatched):
        raise CheckpointError(
            f"{src.where} does not match the model under prefix {prefix!r}: missing {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected {unmatched[:10]}"
            f"{' ...' if len(unmatched) > 10 else ''}. Pass strict=False to load what matches (a model whose "
            "modules rename keys in their own _load_from_state_dict, as LitGPT's LoRA layers do, loads that way)."
        )
    # Entries that match no name go in too, under the prefix: a module may rename them to its own
    # in its _load_from_state_dict (LitGPT's LoRA layers); what nobody takes is torch's to report.
    mapping.update({prefix + key: src.tensor(key) for key in unmatched})
    result = module.load_state_dict(mapping, strict=False)
    return sorted(k[len(prefix):] for k in result.unexpected_keys if k.startswith(prefix) and k[len(prefix):] in available)
