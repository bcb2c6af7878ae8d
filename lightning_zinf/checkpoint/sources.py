"""Plain (unpartitioned) weights from outside: a Hugging Face model folder, a ``.safetensors`` or
``torch.save`` file, or a mapping, memory-mapped and loaded through the model's own
``load_state_dict``, one unit at a time (for starting fine-tuning from pretrained weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zinf.checkpoint.format import (CheckpointError, CheckpointNotFoundError, _RangeFile,
                                             is_sharded_checkpoint, require_checkpoint)
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.tiling import tile_views

__all__ = ["load_full_state_dict", "load_full_state_dicts", "overlapping_prefixes", "checkpoint_keys", "matching_prefix",
           "provided_parameters", "tensor_source"]


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
    require_checkpoint(path, folders=True)  # names the checkpoint a shard file or save folder belongs to
    if path.is_file():
        return [path]
    if is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is a lightning_zinf sharded checkpoint, not a full state dict: load it with "
                              "the strategy (trainer.fit(ckpt_path=...), fabric.load) or load_sharded, or consolidate "
                              "it into one file first (zinf-consolidate).")
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
    raise CheckpointNotFoundError(
        f"{path} holds none of {', '.join(_HF_CHECKPOINTS)}: not a Hugging Face model folder "
        "(pass the checkpoint file itself, or the folder `save_pretrained` wrote)."
    )


def tensor_source(source: os.PathLike | str) -> dict[str, Tensor]:
    """Every tensor of a checkpoint (a Hugging Face model folder, a ``.safetensors`` or ``torch.save``
    file) by name, memory-mapped: a tensor's bytes are read only where it is used.

    Raises:
        CheckpointNotFoundError, CheckpointError: as :func:`checkpoint_keys`.
    """
    src = _Source(source)
    return {key: src.tensor(key) for key in sorted(src.keys())}


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
        CheckpointNotFoundError: nothing at ``source``, a folder that is not a Hugging Face model's,
            or a part of a sharded checkpoint (the message names the checkpoint folder).
        CheckpointError: a sharded checkpoint (consolidate it first), a shape differs, or (``strict``)
            keys are missing or unexpected by name (checked before anything is loaded, so a model whose modules
            rename keys themselves loads with ``strict=False``); the message names them.
    """
    return load_full_state_dicts(engine, {prefix: source}, strict=strict)[prefix]


def overlapping_prefixes(prefixes: Sequence[str]) -> Optional[tuple[str, str]]:
    """Two of ``prefixes`` of which one starts with the other (the same parameter names could fall
    under both), or ``None`` when each parameter name falls under at most one of them."""
    for i, first in enumerate(prefixes):
        for second in prefixes[i + 1:]:
            if first.startswith(second) or second.startswith(first):
                return first, second
    return None


def load_full_state_dicts(
    engine: ZeroEngine,
    sources: Mapping[str, os.PathLike | str | dict[str, Tensor]],
    *,
    strict: bool = True,
) -> dict[str, list[str]]:
    """:func:`load_full_state_dict` of several sources, each into its own part of the model, in one
    ``load_state_dict`` pass (each unit gathered and written back once, whatever the number of
    sources): a LightningModule holding several pretrained models (an RLHF actor and reward model)
    starts each from its own checkpoint. Each rank reads only the bytes its shards need, as for one
    source.

    Collective: call it on every rank, with the same ``sources``.

    Args:
        engine: The engine partitioning the model.
        sources: ``{prefix: source}``: parameter ``prefix + key`` of the partitioned model takes
            that source's entry ``key`` (each source as :func:`load_full_state_dict` takes it).
            Parameters under no prefix are left as they are.
        strict: As for :func:`load_full_state_dict`, checked for every source before anything is loaded.

    Returns:
        For each prefix, the keys of its source that no module took (empty when ``strict``).

    Raises:
        ValueError: two prefixes overlap (one starts with the other); the message names both.
        CheckpointError: as :func:`load_full_state_dict` raises it, for any source.
    """
    clash = overlapping_prefixes(list(sources))
    if clash is not None:
        raise ValueError(f"The prefixes {clash[0]!r} and {clash[1]!r} overlap: parameters under both would be "
                         "loaded from two sources. Give each pretrained model its own submodule.")
    opened = {prefix: _Source(source) for prefix, source in sources.items()}
    mapping: dict[str, Tensor] = {}
    for prefix, src in opened.items():
        mapping.update(_entries(engine, src, prefix, strict))
    unexpected = engine.module.load_state_dict(mapping, strict=False).unexpected_keys
    found: dict[str, list[str]] = {}
    for prefix, src in opened.items():
        available = src.keys()
        found[prefix] = sorted(k[len(prefix):] for k in unexpected
                               if k.startswith(prefix) and k[len(prefix):] in available)
    return found


def _entries(engine: ZeroEngine, src: _Source, prefix: str, strict: bool) -> dict[str, Tensor]:
    """The ``load_state_dict`` entries (qualified names in ``engine.module``) that load ``src``
    under ``prefix``: memory-mapped tensors, read when their unit loads.

    Raises:
        CheckpointError: a shape differs, or (``strict``) keys are missing or unexpected by name.
    """
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
    return mapping
