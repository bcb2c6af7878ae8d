"""Consolidate a sharded checkpoint into one full state dict, streaming one tensor at a time.

    python -m lightning_zinf.consolidate CKPT_DIR OUT.safetensors [--strip-prefix model.]
    zinf-consolidate CKPT_DIR OUT.pt

The output loads with ``load_state_dict`` on the plain (unpartitioned) model. A tied parameter is
written under every name the model's ``state_dict()`` has. For ``.safetensors`` the header is
computed from the checkpoint's layout and each tensor is then assembled from the rank files and
written before the next is read, so peak memory is about the largest tensor, not the model.
``.pt`` output goes through ``torch.save``, which needs the whole state dict in memory.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zinf.checkpoint import META_FILE, SAFETENSORS_DTYPES, CheckpointError, ShardReader, is_sharded_checkpoint

__all__ = ["consolidate", "main"]

def _entries(path: Path, strip_prefix: str) -> tuple[list[tuple[str, torch.dtype, list[int]]], Any, dict[str, Any]]:
    """Every output tensor as (name, dtype, shape), in file order, plus a function producing them."""
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a lightning_zinf checkpoint (no {META_FILE}).")
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    zinf = meta["zinf"]

    def rename(name: str) -> str:
        return name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix) else name

    entries = []
    for group in zinf["groups"]:
        dtype = getattr(torch, group["dtype"])
        for aliases, shape in zip(group["aliases"], group["shapes"]):
            entries.extend((rename(alias), dtype, shape) for alias in aliases)
    buffers = meta.get("state_dict", {})
    entries.extend((rename(name), value.dtype, list(value.shape)) for name, value in buffers.items())
    return entries, zinf, buffers


def _tensors(path: Path, zinf: dict[str, Any], buffers: dict[str, Tensor]) -> Iterator[Tensor]:
    """The output tensors in the order of :func:`_entries`, one at a time."""
    reader = ShardReader(path, zinf)
    for i, group in enumerate(zinf["groups"]):
        old_shard = -(-group["numel"] // zinf["world_size"])
        offset = 0
        for aliases, shape in zip(group["aliases"], group["shapes"]):
            numel = 1
            for size in shape:
                numel *= size
            tensor = reader.read(f"{i}.param", offset, offset + numel, old_shard).reshape(shape)
            offset += numel
            for _ in aliases:
                yield tensor
    yield from buffers.values()


def consolidate(checkpoint: Path | str, output: Path | str, *, strip_prefix: str = "") -> Path:
    """Write the full state dict of a sharded checkpoint to ``output`` (``.safetensors`` or ``.pt``).

    Args:
        checkpoint: A directory written by the ``zero_infinity`` strategy (any world size).
        output: Target file; its suffix picks the format.
        strip_prefix: Removed from names that start with it (``"model."`` turns a LightningModule's
            ``model.wte.weight`` into the plain model's ``wte.weight``).

    Returns:
        ``output`` as a ``Path``.

    Raises:
        CheckpointError: not a checkpoint, or a missing or corrupt shard file.
        ValueError: ``output`` has another suffix.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    if output.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"Output {output} must end in .safetensors or .pt.")
    entries, zinf, buffers = _entries(checkpoint, strip_prefix)
    tensors = _tensors(checkpoint, zinf, buffers)
    partial = output.with_name(output.name + ".partial")
    if output.suffix == ".pt":
        torch.save({name: tensor for (name, _, _), tensor in zip(entries, tensors)}, partial)
    else:
        _write_safetensors(partial, entries, tensors)
    partial.rename(output)
    return output


def _write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, list[int]]], tensors: Iterator[Tensor]) -> None:
    """The safetensors format written as a stream: 8-byte little-endian header size, a JSON header
    with each tensor's dtype, shape and byte range, then the tensors' bytes in that order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for (name, dtype, _), tensor in zip(entries, tensors):
            out.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().data)  # no copy


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: ``python -m lightning_zinf.consolidate CKPT_DIR OUT [--strip-prefix P]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory")
    parser.add_argument("output", type=Path, help="output file, .safetensors or .pt")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from names (e.g. 'model.')")
    args = parser.parse_args(argv)
    print(consolidate(args.checkpoint, args.output, strip_prefix=args.strip_prefix))


if __name__ == "__main__":
    main()
