"""Consolidate a sharded checkpoint into one full state dict, streaming one tensor at a time.

    python -m lightning_zinf.consolidate CKPT_DIR OUT.safetensors [--strip-prefix model.]
    zinf-consolidate CKPT_DIR OUT.pth [--no-weights-only]
    zinf-consolidate CKPT_DIR last.ckpt --format lightning

The output loads with ``load_state_dict`` on the plain (unpartitioned) model; with ``--format
lightning`` it is a checkpoint DDP or one device resumes (``trainer.fit(ckpt_path=...)``); a checkpoint
``fabric.save`` wrote becomes by default (``--format fabric``) what ``fabric.save`` writes under DDP,
which ``fabric.load`` restores: each model's and optimizer's state under its key, and the other
entries (as Lightning's consolidation of an FSDP ``fabric.save`` checkpoint gives). A tied parameter is
written under every name the model's ``state_dict()`` has. Either format is laid out first (the
safetensors header, or a ``torch.save`` archive with empty records) and then each tensor is
assembled from the rank files and written before the next is read, so peak memory is about the
largest tensor, not the model. The tiles of a :class:`~lightning_zinf.TiledLinear` are written as the
untiled layer's ``weight`` and ``bias`` (so the file loads into a tiled or an untiled model), one row
of tiles at a time: a tiled layer never has to fit in memory whole.

The checkpoint's ``meta.pt`` is read without running code from it; ``--no-weights-only``
(``weights_only=False``) unpickles it fully, for a file you trust.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from lightning_zinf.checkpoint import (
    META_FILE,
    MODEL_KEY,
    MODELS_KEY,
    OPTIMIZER_KEYS,
    RESERVED_KEYS,
    SAFETENSORS_DTYPES,
    USER_STATE_KEY,
    CheckpointError,
    ShardReader,
    check_version,
    is_sharded_checkpoint,
    model_folders,
    read_meta,
    require_checkpoint,
    user_entries,
)

__all__ = ["consolidate", "main", "FORMATS"]

_Item = tuple[list[str], torch.dtype, list[int]]  # every name of one tensor, its dtype and shape
# Where an item's values are: (group index, offset in the flat group, piece shape, piece start in the
# item), one piece for a plain parameter, one per tile for a TiledLinear's weight.
_Piece = tuple[int, int, list[int], list[int]]


def _sharded_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """``meta.pt`` of the sharded checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``path`` (:func:`~lightning_zinf.checkpoint.require_checkpoint`).
        CheckpointError: a file.
    """
    require_checkpoint(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint folder (no {META_FILE}): there is nothing "
                              "to consolidate.")
    return read_meta(path, weights_only)


def _one_model_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """``meta.pt`` of the sharded checkpoint of one model at ``path``.

    Raises:
        CheckpointNotFoundError, CheckpointError: as :func:`_sharded_meta`, and a checkpoint of
            several models (naming a model's folder, which holds one).
    """
    meta = _sharded_meta(path, weights_only)
    if MODELS_KEY in meta:
        raise CheckpointError(
            f"{path} holds several models ({', '.join(meta[MODELS_KEY])}), each in a folder of its own: write them "
            "all with --format fabric (fmt='fabric'), or consolidate one model's folder (e.g. "
            f"{next(iter(model_folders(path, meta).values()))})."
        )
    return meta


def _items(path: Path, strip_prefix: str, skip_excluded: bool = False, weights_only: Optional[bool] = None
           ) -> tuple[list[_Item], list[list[_Piece]], dict[str, Any], dict[str, Tensor]]:
    """Every output tensor (with all its names: a tied parameter has several) and its pieces, in
    file order. A TiledLinear's tiles make one ``weight`` (and one ``bias``), as the untiled layer has.
    Groups saved without their values (``exclude_frozen``) are left out with ``skip_excluded``, else
    they are an error. ``weights_only`` as in :func:`~lightning_zinf.checkpoint.read_meta`."""
    meta = _one_model_meta(path, weights_only)
    zinf = meta["zinf"]
    check_version(zinf, path)

    def rename(name: str) -> str:
        return name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix) else name

    items: list[_Item] = []
    pieces: list[list[_Piece]] = []
    tiled: dict[str, int] = {}
    excluded = [g["names"][0] for g in zinf["groups"] if g.get("excluded", False)]
    if excluded and not skip_excluded:
        raise CheckpointError(
            f"{path} was saved with exclude_frozen_parameters: it does not hold the frozen parameters "
            f"({excluded[0]} and {len(excluded) - 1} more groups), so it cannot give the whole model. "
            "Export the adapters only (LoRA: lightning_zinf.hf_export.export_peft_adapters(checkpoint, folder, "
            "peft_config=..., strip_prefix=...) writes a folder PeftModel.from_pretrained loads), or use a "
            "checkpoint saved with them."
        )
    for i, group in enumerate(zinf["groups"]):
        if group.get("excluded", False):
            continue
        dtype = getattr(torch, group["dtype"])
        views = group.get("views") or [None] * len(group["shapes"])
        for aliases, shape, offset, view in zip(group["aliases"], group["shapes"], group["offsets"], views):
            if view is None:
                items.append(([rename(a) for a in aliases], dtype, shape))
                pieces.append([(i, offset, shape, [0] * len(shape))])
                continue
            if view["of"] not in tiled:
                tiled[view["of"]] = len(items)
                items.append(([rename(view["of"])], dtype, view["shape"]))
                pieces.append([])
            pieces[tiled[view["of"]]].append((i, offset, shape, view["start"]))
    buffers = meta.get("state_dict", {})
    items.extend(([rename(name)], value.dtype, list(value.shape)) for name, value in buffers.items())
    return items, pieces, zinf, buffers


def _row_blocks(name: str, shape: list[int], pieces: list[_Piece]) -> list[list[_Piece]]:
    """The pieces of one tensor as row blocks, top to bottom, each block's pieces left to right;
    raises :class:`CheckpointError` unless they tile the tensor exactly."""
    blocks: dict[int, list[_Piece]] = {}
    for piece in pieces:
        blocks.setdefault(piece[3][0], []).append(piece)
    ordered = [sorted(blocks[r], key=lambda q: q[3][1:]) for r in sorted(blocks)]
    row = 0
    for block in ordered:
        height = block[0][2][0]
        col = 0
        for _, _, piece_shape, start in block:
            if start[0] != row or piece_shape[0] != height or (len(shape) == 2 and start[1] != col):
                raise CheckpointError(f"The checkpoint's tiles of '{name}' do not cover it exactly (corrupt meta.pt?).")
            col += piece_shape[1] if len(shape) == 2 else 0
        if len(shape) == 2 and col != shape[1]:
            raise CheckpointError(f"The checkpoint's tiles of '{name}' do not cover it exactly (corrupt meta.pt?).")
        row += height
    if row != shape[0]:
        raise CheckpointError(f"The checkpoint's tiles of '{name}' do not cover it exactly (corrupt meta.pt?).")
    return ordered


def _tensors(path: Path, zinf: dict[str, Any], items: list[_Item], pieces: list[list[_Piece]],
             buffers: dict[str, Tensor]) -> Iterator[Iterator[Tensor]]:
    """For each item of :func:`_items`, in order, its values as consecutive row blocks (one block
    for a plain tensor, one per row of tiles for a tiled weight), read one block at a time."""
    reader = ShardReader(path, zinf)

    def read(piece: _Piece) -> Tensor:
        i, offset, shape, _ = piece
        end = offset + torch.Size(shape).numel()
        return reader.read(f"{i}.param", offset, end, reader.shard_numel(i)).reshape(shape)

    def blocks(item: _Item, its_pieces: list[_Piece]) -> Iterator[Tensor]:
        if len(its_pieces) == 1 and its_pieces[0][2] == item[2]:
            yield read(its_pieces[0])
            return
        for block in _row_blocks(item[0][0], item[2], its_pieces):
            yield torch.cat([read(piece) for piece in block], dim=1) if len(block) > 1 else read(block[0])

    for item, its_pieces in zip(items, pieces):
        yield blocks(item, its_pieces)
    for value in buffers.values():
        yield iter([value])


#: Output formats: the suffix and the checkpoint pick one unless ``fmt`` names it.
FORMATS = ("safetensors", "torch", "lightning", "fabric")


def consolidate(checkpoint: Path | str, output: Path | str, *, strip_prefix: str = "",
                weights_only: Optional[bool] = None, fmt: Optional[str] = None) -> Path:
    """Write the full state dict of a sharded checkpoint to ``output``, one tensor at a time: peak
    memory is about the largest tensor (twice it), not the model.

    Args:
        checkpoint: A directory written by the ``zero_infinity`` strategy (any world size).
        output: Target file, of any name (``model.pth``, ``last.ckpt``...).
        strip_prefix: Removed from names that start with it (``"model."`` turns a LightningModule's
            ``model.wte.weight`` into the plain model's ``wte.weight``); not with ``"lightning"``.
        weights_only: ``None``/``True``: read ``meta.pt`` without running code from it; ``False``:
            unpickle it fully (a file you trust). As ``torch.load``'s argument of that name.
        fmt: ``"safetensors"``; ``"torch"`` (a ``torch.save`` state dict, what ``.pt``/``.pth``/``.bin``
            files hold); ``"lightning"``: a checkpoint DDP or one device resumes with
            ``trainer.fit(ckpt_path=...)``: Lightning's state from ``meta.pt`` (loops, callbacks,
            schedulers, hyper-parameters), the ``state_dict``, and each optimizer's plain state dict
            (per-element states at each parameter's shape, numbered as the optimizer numbers its
            parameters); or ``"fabric"`` (a checkpoint ``fabric.save`` wrote): what ``fabric.save``
            writes under DDP for the same state, which ``fabric.load`` restores under any strategy:
            each model's full state dict and each optimizer's plain state dict under their keys,
            and the other entries as saved (as Lightning's consolidation of an FSDP ``fabric.save``
            checkpoint gives). Default: ``"safetensors"`` for a ``.safetensors`` name, else
            ``"fabric"`` for a ``fabric.save`` checkpoint (``"torch"`` with ``strip_prefix``) and
            ``"torch"`` for a Trainer's.

    Returns:
        ``output`` as a ``Path``.

    Raises:
        CheckpointNotFoundError: nothing at ``checkpoint``, a folder that is not a checkpoint, or a
            part of one (the message names the checkpoint folder to pass instead).
        CheckpointError: a file, a missing or corrupt shard file, a ``meta.pt`` naming code the safe
            load refuses, a checkpoint of several models in a format other than ``"fabric"``, or
            (``"lightning"``, ``"fabric"``) a checkpoint that records no optimizer layout (written
            before this version; resave it) (nothing is written then).
        ValueError: an unknown ``fmt``, ``strip_prefix`` with ``"lightning"`` or ``"fabric"``, or
            ``"fabric"`` for a Trainer's checkpoint.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    top = _sharded_meta(checkpoint, weights_only)
    by_fabric = any(key in top for key in (MODELS_KEY, OPTIMIZER_KEYS, USER_STATE_KEY))
    # A prefix to strip asks for the plain state dict.
    fmt = fmt or ("safetensors" if output.suffix == ".safetensors" else
                  "fabric" if by_fabric and not strip_prefix else "torch")
    if fmt not in FORMATS:
        raise ValueError(f"Unknown output format {fmt!r}: use one of {', '.join(FORMATS)}.")
    if fmt in ("lightning", "fabric") and strip_prefix:
        raise ValueError(f"A {fmt} checkpoint keeps the saved names: drop strip_prefix.")
    if fmt == "fabric" and not by_fabric:
        raise ValueError(f"{checkpoint} was saved by the Trainer, not fabric.save: use --format lightning (or torch, "
                         "safetensors).")
    partial = output.with_name(output.name + ".partial")
    try:
        if fmt == "lightning":
            _write_lightning(partial, checkpoint, weights_only)
        elif fmt == "fabric":
            _write_fabric(partial, checkpoint, top, weights_only)
        else:
            items, pieces, zinf, buffers = _items(checkpoint, strip_prefix, weights_only=weights_only)
            tensors = _tensors(checkpoint, zinf, items, pieces, buffers)
            (_write_pt if fmt == "torch" else _write_safetensors)(partial, items, tensors)
    except BaseException:
        partial.unlink(missing_ok=True)  # a corrupt or missing shard found midway: no half-written file
        raise
    partial.rename(output)
    return output


def _optimizer_items(path: Path, zinf: dict[str, Any]) -> tuple[list[_Item], Iterator[Iterator[Tensor]],
                                                                 list[dict[int, dict[str, Any]]]]:
    """The per-element optimizer states of a sharded checkpoint: one item per (optimizer, plain
    parameter index, key) at the parameter's shape, named ``"o.index.key"``, with their values read
    one at a time as they are consumed; and per optimizer the plain ``state`` with its scalars
    (Adam's ``step``) and ``None`` where an item's tensor goes."""
    layouts = zinf.get("optimizers")
    if layouts is None:
        raise CheckpointError(f"{path} does not record which parameter each optimizer state belongs to (saved by an "
                              "older lightning_zinf): resume it with the strategy and save it again to consolidate "
                              "it as a Lightning checkpoint.")
    reader = ShardReader(path, zinf)
    keys = reader.keys()
    items: list[_Item] = []
    spans: list[tuple[str, int, int, int, list[int]]] = []  # key, flat range, group, shape
    states: list[dict[int, dict[str, Any]]] = []
    for o, layout in enumerate(layouts):
        state: dict[int, dict[str, Any]] = {}
        entries = [entry for param_group in layout for entry in param_group]
        for index, entry in enumerate(entries):
            if entry is None:
                continue  # a frozen parameter: in the numbering, never stepped
            i, j = entry
            group = zinf["groups"][i]
            offset, shape = group["offsets"][j], group["shapes"][j]
            prefix = f"{i}.opt{o}."
            for key in (k for k in keys if k.startswith(prefix)):
                name = key[len(prefix):]
                if name.endswith(".scalar"):
                    value = reader.read(key, j, j + 1, len(group["names"]))[0]
                    if not torch.isnan(value):
                        state.setdefault(index, {})[name.removesuffix(".scalar")] = value.to(torch.float32)
                    continue
                state.setdefault(index, {})[name] = None
                dtype = reader.read(key, 0, 0, reader.shard_numel(i)).dtype  # from the file header
                items.append(([f"{o}.{index}.{name}"], dtype, list(shape)))
                spans.append((key, offset, offset + torch.Size(shape).numel(), i, list(shape)))
        states.append(state)

    def values() -> Iterator[Iterator[Tensor]]:
        for key, lo, hi, i, shape in spans:
            yield iter([reader.read(key, lo, hi, reader.shard_numel(i)).reshape(shape)])

    return items, values(), states


class _Model(NamedTuple):
    """One model's part of a nested output file: its weights (items and values, as :func:`_items`
    and :func:`_tensors` give them) and its optimizers' states (:func:`_optimizer_items`), each
    item named under ``tag`` in the scratch file."""

    tag: str
    meta: dict[str, Any]
    zinf: dict[str, Any]
    items: list[_Item]
    values: Iterator[Iterator[Tensor]]
    opt_items: list[_Item]
    opt_values: Iterator[Iterator[Tensor]]
    states: list[dict[int, dict[str, Any]]]


def _model(folder: Path, tag: str, weights_only: Optional[bool]) -> _Model:
    """The weights and optimizer states of the one-model checkpoint ``folder``, to be written under ``tag``."""
    items, pieces, zinf, buffers = _items(folder, "", weights_only=weights_only)
    opt_items, opt_values, states = _optimizer_items(folder, zinf)
    return _Model(tag, read_meta(folder, weights_only), zinf, items, _tensors(folder, zinf, items, pieces, buffers),
                  opt_items, opt_values, states)


def _tagged(tag: str, items: list[_Item]) -> list[_Item]:
    return [([tag + name for name in names], dtype, shape) for names, dtype, shape in items]


def _nested(path: Path, models: list[_Model], build: Any) -> None:
    """A nested ``torch.save`` file, streamed: every model's weights and optimizer states go into a
    scratch ``torch.save`` file one tensor at a time (:func:`_write_pt`), which is then memory-mapped
    and saved again inside the nested dict ``build(flat)`` returns (``flat``: the scratch file's
    tensors by tagged name), so memory holds the pages of about one tensor."""
    scratch = path.with_name(path.name + ".tensors")
    items = [item for m in models for item in _tagged(m.tag, m.items) + _tagged(m.tag + "opt/", m.opt_items)]
    values = itertools.chain.from_iterable(itertools.chain(m.values, m.opt_values) for m in models)
    try:
        _write_pt(scratch, items, values)
        torch.save(build(torch.load(scratch, mmap=True, weights_only=True)), path)
    finally:
        scratch.unlink(missing_ok=True)


def _model_state_dict(model: _Model, flat: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: flat[model.tag + name] for names, _, _ in model.items for name in names}


def _plain_optimizer_states(model: _Model, flat: dict[str, Tensor]) -> list[dict[str, Any]]:
    """Each saved optimizer's plain state dict (per-element states at each parameter's shape,
    numbered as the optimizer numbers its parameters), with its saved hyper-parameters."""
    optimizer_states = []
    for o, (state, hyper) in enumerate(zip(model.states, model.meta.get("optimizer_states", []))):
        for index, entry in state.items():
            entry.update({name: flat[f"{model.tag}opt/{o}.{index}.{name}"] for name, value in entry.items()
                          if value is None})
        groups, start = [], 0
        for saved, layout in zip(hyper["param_groups"], model.zinf["optimizers"][o]):
            groups.append({**saved, "params": list(range(start, start + len(layout)))})
            start += len(layout)
        optimizer_states.append({"state": dict(sorted(state.items())), "param_groups": groups})
    return optimizer_states


def _write_lightning(path: Path, checkpoint: Path, weights_only: Optional[bool]) -> None:
    """A Lightning checkpoint file: Lightning's state from ``meta.pt``, the ``state_dict`` and each
    optimizer's plain state dict (:func:`_nested`)."""
    model = _model(checkpoint, "", weights_only)
    rest = {k: v for k, v in model.meta.items() if k not in ("state_dict", "optimizer_states") + RESERVED_KEYS}
    _nested(path, [model], lambda flat: {**rest, "state_dict": _model_state_dict(model, flat),
                                          "optimizer_states": _plain_optimizer_states(model, flat)})


def _write_fabric(path: Path, checkpoint: Path, top: dict[str, Any], weights_only: Optional[bool]) -> None:
    """What ``fabric.save`` writes under DDP for the state a sharded ``fabric.save`` checkpoint was
    saved from: each model's full state dict and each optimizer's plain state dict under their
    keys, and the other entries as they were saved (:func:`_nested`)."""
    if MODELS_KEY in top:
        folders, optimizer_keys = model_folders(checkpoint, top), top[MODELS_KEY]
    else:  # one model; fabric.save recorded its key from this version on (Lightning's "model" before)
        key = top.get(MODEL_KEY, "model")
        folders, optimizer_keys = {key: checkpoint}, {key: top.get(OPTIMIZER_KEYS, [])}
    models = {key: _model(folder, f"{i}/", weights_only) for i, (key, folder) in enumerate(folders.items())}

    def build(flat: dict[str, Tensor]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, model in models.items():
            out[key] = _model_state_dict(model, flat)
            out.update(zip(optimizer_keys[key], _plain_optimizer_states(model, flat)))
        return {**out, **user_entries(top)}

    _nested(path, list(models.values()), build)


def _write_safetensors(path: Path, items: list[_Item], tensors: Iterator[Iterator[Tensor]]) -> None:
    """The safetensors format written as a stream: 8-byte little-endian header size, a JSON header
    with each tensor's dtype, shape and byte range, then the tensors' bytes in that order (a tied
    tensor once per name: safetensors has no shared entries)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for names, dtype, shape in items:
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        for name in names:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (names, dtype, _), blocks in zip(items, tensors):
            # A tied tensor (several names) is one block; a tiled weight comes in row blocks.
            blocks = list(blocks) if len(names) > 1 else blocks
            for _ in names:
                for block in blocks:
                    out.write(block.to(dtype).contiguous().view(torch.uint8).numpy().data)  # no copy


def _write_pt(path: Path, items: list[_Item], tensors: Iterator[Iterator[Tensor]]) -> None:
    """A ``torch.save`` file written in two passes: ``torch.serialization.skip_data`` writes the
    archive with every storage's space reserved but not filled (from empty, never-touched
    tensors), then each tensor's bytes go into its record, found with ``zipfile``. Tied names
    share one storage, as in ``torch.save`` of the model's ``state_dict()``."""
    skeleton: dict[str, Tensor] = {}
    for names, dtype, shape in items:
        empty = torch.empty(shape, dtype=dtype)  # untouched pages: no resident memory
        skeleton.update((name, empty) for name in names)
    with torch.serialization.skip_data():
        torch.save(skeleton, path)
    del skeleton
    records = {info.filename.split("/data/")[-1]: info for info in zipfile.ZipFile(path).infolist() if "/data/" in info.filename}
    fd = os.open(path, os.O_RDWR)
    try:
        # torch.save numbers storages in the order it first meets them: the items' order.
        for key, blocks in enumerate(tensors):
            info = records[str(key)]
            name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            at = info.header_offset + 30 + name_len + extra_len
            written = 0
            for block in blocks:
                data = block.to(items[key][1]).contiguous().view(torch.uint8).numpy()
                os.pwrite(fd, data.data, at + written)
                written += data.nbytes
            if written != info.file_size:
                raise RuntimeError(f"torch.save laid out storage {key} as {info.file_size} bytes, wrote {written}.")
    finally:
        os.close(fd)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: ``python -m lightning_zinf.consolidate CKPT_DIR OUT [--format F] [--strip-prefix P]
    [--no-weights-only]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory")
    parser.add_argument("output", type=Path, help="output file, any name (model.safetensors, model.pth, last.ckpt)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="safetensors; torch (a torch.save state dict: .pt, .pth, .bin); lightning (a checkpoint "
                             "DDP or one device resumes: loops, optimizer states, state_dict); fabric (a fabric.save "
                             "checkpoint as fabric.save writes it under DDP: each model's and optimizer's state under "
                             "its key, and the other entries). Default: safetensors for a .safetensors name, else "
                             "fabric for a fabric.save checkpoint (torch with --strip-prefix) and torch for a "
                             "Trainer's")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from names (e.g. 'model.')")
    parser.add_argument("--weights-only", action=argparse.BooleanOptionalAction, default=True,
                        help="read meta.pt with torch's weights-only unpickler (default); --no-weights-only "
                             "unpickles it fully, which runs any code it names: only for a file you trust")
    args = parser.parse_args(argv)
    print(consolidate(args.checkpoint, args.output, strip_prefix=args.strip_prefix, weights_only=args.weights_only,
                      fmt=args.format))


if __name__ == "__main__":
    main()
