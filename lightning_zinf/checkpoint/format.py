"""The on-disk format of a sharded checkpoint, and its reader: ``meta.pt`` (read without running
code from it), the layout record of every flat group and its check against a model, and the shard
files (safetensors, read by byte range, checked against the checksums and the save that wrote
them). The layout is described in :mod:`lightning_zinf.checkpoint`."""

from __future__ import annotations

import copyreg
import hashlib
import json
import os
import pathlib
import pickle
import struct
import types
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict
from torch import Tensor

from lightning_zinf.engine import ZeroEngine
from lightning_zinf.tiling import tile_views

__all__ = ["META_FILE", "FORMAT", "VERSION", "CHECKPOINT_GLOBALS", "CheckpointError", "CheckpointNotFoundError",
           "OptimizerCountError", "check_version", "read_meta", "shard_file", "is_sharded_checkpoint",
           "enclosing_checkpoint", "require_checkpoint", "MODELS_KEY", "MODELS_DIR_KEY", "OPTIMIZER_KEYS", "MODEL_KEY",
           "USER_STATE_KEY", "RESERVED_KEYS", "OWN_ENTRIES", "user_entries", "refuse_reserved_keys", "model_folders",
           "SAFETENSORS_DTYPES", "ShardReader"]


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


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for: the path does not exist, is a folder that holds none,
    or is a part of a sharded checkpoint (its ``meta.pt``, its ``save-<id>/`` folder, a shard file)
    rather than the checkpoint folder itself, which the message names. A ``FileNotFoundError``, as
    Lightning's DDP (``TorchCheckpointIO``) and DeepSpeed strategies raise for these, so that
    ``except FileNotFoundError: start afresh`` works; and a :class:`CheckpointError`."""


class OptimizerCountError(CheckpointError, RuntimeError):
    """A checkpoint holding the state of more or fewer optimizers than the run has. A
    ``RuntimeError``, as Lightning's ``FSDPStrategy`` raises for it; and a :class:`CheckpointError`."""


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


def enclosing_checkpoint(path: os.PathLike) -> Optional[Path]:
    """The sharded checkpoint folder that ``path`` is a part of (its ``meta.pt``, its
    ``save-<id>/`` folder, a shard file in that, a model's folder or file in a checkpoint of several
    models: at most three levels down), the outermost one, or ``None``."""
    found = None
    for parent in list(Path(path).parents)[:3]:
        if is_sharded_checkpoint(parent):
            found = parent
    return found


def require_checkpoint(path: os.PathLike, *, folders: bool = False) -> None:
    """Check that something loadable is at ``path``: a sharded checkpoint folder, a file (a full
    checkpoint), or with ``folders`` any folder that is not inside a sharded checkpoint (a Hugging
    Face model folder, which its reader checks).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist; is a part of a sharded checkpoint (the
            message names the checkpoint folder to pass instead); or is a folder without
            ``meta.pt`` (unless ``folders``).
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        return
    root = enclosing_checkpoint(path)
    if root is not None:
        part = path.relative_to(root)
        raise CheckpointNotFoundError(
            f"{path} is a part of the sharded checkpoint {root} ({part}), not a checkpoint itself: a sharded "
            f"checkpoint is the whole folder its save wrote. Load {root} instead."
        )
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint not found: {path} does not exist.")
    if path.is_dir() and not folders:
        raise CheckpointNotFoundError(
            f"{path} is not a lightning_zinf checkpoint: the folder holds no {META_FILE} (a sharded checkpoint is "
            f"the folder a save wrote, with {META_FILE} and a save-<id>/ folder of one shard file per rank)."
        )


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


def check_prefix(saved: list[str], current: list[str], path: Path) -> None:
    """Raise :class:`CheckpointError` naming the prefix when the checkpoint's parameter names
    (``saved``, in order) are the model's (``current``) with one prefix added or removed."""
    if saved and current and _prefixed(saved, current):
        raise CheckpointError(
            f"{path} names the model's parameters with another prefix ({saved[0]!r} in the checkpoint, "
            f"{current[0]!r} in the model): it was saved from a module that holds this one, or is held "
            "by it (a LightningModule's checkpoint loaded into its bare model, or the reverse). Load it into "
            "the same module class it was saved from (with Fabric, set up the LightningModule itself), or "
            "consolidate it and load it with load_full_state_dict(..., prefix=...)."
        )


def _check_layout(saved: list[dict[str, Any]], current: list[dict[str, Any]], path: Path) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"{path} holds {len(saved)} flat groups but the model has {len(current)}: it was saved from a "
            "different model (or with different block_classes or tiling; to move weights between tilings, "
            "consolidate the checkpoint and load it with load_full_state_dict)."
        )
    for old, new in zip(saved, current):
        # Not "trainable": requires_grad may change during training (a group unfrozen, or frozen
        # again, since the model was partitioned); a group's optimizer state loads either way.
        for key in ("names", "shapes", "dtype"):
            if old[key] != new[key] and key == "dtype":
                raise CheckpointError(
                    f"{path} stores unit '{new['unit']}' in {old[key]}, but the model now stores it in "
                    f"{new[key]} (a different MixedPrecisionConfig.frozen_dtype, or parameters cast after "
                    "saving?): use the settings it was saved with, or consolidate the checkpoint and load "
                    "it with load_full_state_dict, which converts."
                )
            if old[key] != new[key] and key == "names":
                check_prefix(old[key], new[key], path)
            if old[key] != new[key]:
                raise CheckpointError(
                    f"{path} was saved from a different model: unit '{new['unit']}' has {key} "
                    f"{new[key]} in the model but {old[key]} in the checkpoint (a different tiling? "
                    "consolidate the checkpoint and load it with load_full_state_dict)."
                )


#: ``meta.pt`` of a checkpoint of several models: model key -> the keys of its optimizers.
MODELS_KEY = "zinf_models"


#: ``meta.pt`` of a checkpoint of several models: the folder (inside the checkpoint) holding one
#: sharded checkpoint per model key.
MODELS_DIR_KEY = "zinf_dir"


#: ``meta.pt`` of a Fabric checkpoint of one model: the keys its optimizers' states were saved under.
OPTIMIZER_KEYS = "zinf_optimizer_keys"


#: ``meta.pt`` of a Fabric checkpoint of one model: the key the model was saved under.
MODEL_KEY = "zinf_model_key"


#: ``meta.pt`` of a Fabric checkpoint: the entries of ``fabric.save``'s state that are neither a
#: model nor an optimizer, kept apart from the checkpoint's own entries so that none is overwritten
#: (a user's ``"state_dict"`` beside the model's buffers, say).
USER_STATE_KEY = "zinf_user_state"


#: The keys of ``meta.pt`` the checkpoint's own record uses: an entry of the caller's under one of
#: them would be overwritten or misread, so a save refuses it (:func:`refuse_reserved_keys`). The
#: first three are written by every sharded save; the others by ``fabric.save``.
RESERVED_KEYS = ("zinf", MODELS_KEY, MODELS_DIR_KEY, OPTIMIZER_KEYS, MODEL_KEY, USER_STATE_KEY)


#: The entries of a sharded checkpoint's ``meta.pt`` that are the checkpoint's own rather than the
#: saver's state: the layout record, the model's buffers and the optimizers' hyper-parameters
#: (``"state_dict"``, ``"optimizer_states"``, as a Trainer checkpoint has them), and the keys above.
OWN_ENTRIES = ("state_dict", "optimizer_states", "pytorch-lightning_version") + RESERVED_KEYS


def user_entries(meta: dict[str, Any]) -> dict[str, Any]:
    """The saver's own state in a sharded checkpoint's ``meta.pt`` (read as ``meta``): the entries
    of ``fabric.save``'s state that were neither a model nor an optimizer (kept under
    :data:`USER_STATE_KEY`, whatever their names), or, in a Trainer's checkpoint (and an earlier
    ``fabric.save``'s), every entry but :data:`OWN_ENTRIES` (``epoch``, ``global_step``, ``loops``...)."""
    if USER_STATE_KEY in meta:
        return dict(meta[USER_STATE_KEY])
    return {key: value for key, value in meta.items() if key not in OWN_ENTRIES}


def refuse_reserved_keys(meta: dict[str, Any], path: os.PathLike, keys: tuple[str, ...] = RESERVED_KEYS) -> None:
    """Refuse to save ``meta`` to ``path``'s ``meta.pt`` if it holds an entry under one of ``keys``
    (of :data:`RESERVED_KEYS`), which the save writes itself or a load reads as its own; called
    before anything is written.

    Raises:
        ValueError: naming the entry and the fix.
    """
    taken = [key for key in keys if key in meta]
    if taken:
        raise ValueError(
            f"The checkpoint to save at {path} holds an entry named {taken[0]!r}, a name lightning_zinf's sharded "
            f"checkpoints use for their own record ({', '.join(RESERVED_KEYS)}): saving would overwrite it. Nothing "
            "was written. Store it under another name (in on_save_checkpoint, say)."
        )


def model_folders(path: os.PathLike, meta: dict[str, Any]) -> dict[str, Path]:
    """Model key -> the folder of its sharded checkpoint, for a checkpoint of several models
    (:func:`save_sharded_models`) whose ``meta.pt`` holds ``meta``."""
    return {key: Path(path) / meta.get(MODELS_DIR_KEY, "") / key for key in meta[MODELS_KEY]}


# --- shard files ------------------------------------------------------------------------------------
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
