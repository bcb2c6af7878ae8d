"""Consolidate a sharded checkpoint into one full state dict, streaming one tensor at a time.

    python -m lightning_zinf.consolidate CKPT_DIR OUT.safetensors [--strip-prefix model.]
    zinf-consolidate CKPT_DIR OUT.pt [--no-weights-only]

The output loads with ``load_state_dict`` on the plain (unpartitioned) model. A tied parameter is
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
import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zinf.checkpoint import (
    META_FILE,
    SAFETENSORS_DTYPES,
    CheckpointError,
    ShardReader,
    check_version,
    is_sharded_checkpoint,
    read_meta,
)

__all__ = ["consolidate", "main"]

_Item = tuple[list[str], torch.dtype, list[int]]  # every name of one tensor, its dtype and shape
# Where an item's values are: (group index, offset in the flat group, piece shape, piece start in the
# item), one piece for a plain parameter, one per tile for a TiledLinear's weight.
_Piece = tuple[int, int, list[int], list[int]]


def _items(path: Path, strip_prefix: str, skip_excluded: bool = False, weights_only: Optional[bool] = None
           ) -> tuple[list[_Item], list[list[_Piece]], dict[str, Any], dict[str, Tensor]]:
    """Every output tensor (with all its names: a tied parameter has several) and its pieces, in
    file order. A TiledLinear's tiles make one ``weight`` (and one ``bias``), as the untiled layer has.
    Groups saved without their values (``exclude_frozen``) are left out with ``skip_excluded``, else
    they are an error. ``weights_only`` as in :func:`~lightning_zinf.checkpoint.read_meta`."""
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a lightning_zinf checkpoint (no {META_FILE}).")
    meta = read_meta(path, weights_only)
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
            "Export the adapters only, or use a checkpoint saved with them."
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


def consolidate(checkpoint: Path | str, output: Path | str, *, strip_prefix: str = "",
                weights_only: Optional[bool] = None) -> Path:
    """Write the full state dict of a sharded checkpoint to ``output`` (``.safetensors`` or ``.pt``),
    one tensor at a time: peak memory is about the largest tensor (twice it), not the model.

    Args:
        checkpoint: A directory written by the ``zero_infinity`` strategy (any world size).
        output: Target file; its suffix picks the format.
        strip_prefix: Removed from names that start with it (``"model."`` turns a LightningModule's
            ``model.wte.weight`` into the plain model's ``wte.weight``).
        weights_only: ``None``/``True``: read ``meta.pt`` without running code from it; ``False``:
            unpickle it fully (a file you trust). As ``torch.load``'s argument of that name.

    Returns:
        ``output`` as a ``Path``.

    Raises:
        CheckpointError: not a checkpoint, a missing or corrupt shard file, or a ``meta.pt`` naming
            code the safe load refuses (nothing is written then).
        ValueError: ``output`` has another suffix.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    if output.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"Output {output} must end in .safetensors or .pt.")
    items, pieces, zinf, buffers = _items(checkpoint, strip_prefix, weights_only=weights_only)
    tensors = _tensors(checkpoint, zinf, items, pieces, buffers)
    partial = output.with_name(output.name + ".partial")
    try:
        (_write_pt if output.suffix == ".pt" else _write_safetensors)(partial, items, tensors)
    except BaseException:
        partial.unlink(missing_ok=True)  # a corrupt or missing shard found midway: no half-written file
        raise
    partial.rename(output)
    return output


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
    """Command line: ``python -m lightning_zinf.consolidate CKPT_DIR OUT [--strip-prefix P] [--no-weights-only]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory")
    parser.add_argument("output", type=Path, help="output file, .safetensors or .pt")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from names (e.g. 'model.')")
    parser.add_argument("--weights-only", action=argparse.BooleanOptionalAction, default=True,
                        help="read meta.pt with torch's weights-only unpickler (default); --no-weights-only "
                             "unpickles it fully, which runs any code it names: only for a file you trust")
    args = parser.parse_args(argv)
    print(consolidate(args.checkpoint, args.output, strip_prefix=args.strip_prefix, weights_only=args.weights_only))


if __name__ == "__main__":
    main()
