"""Hugging Face folders from a sharded checkpoint, streamed one tensor at a time.

:func:`export_pretrained` writes what ``save_pretrained`` writes, so that
``AutoModel*.from_pretrained(folder)`` loads it: ``config.json`` (and ``generation_config.json``
when given), the weights as safetensors shards of at most ``max_shard_size`` bytes with
``model.safetensors.index.json``. :func:`export_peft_adapters` writes what
``PeftModel.save_pretrained`` writes for a LoRA model: ``adapter_config.json`` and
``adapter_model.safetensors`` with the adapters only. Both read the checkpoint's rank files by
byte range (:func:`~lightning_zinf.consolidate.consolidate`'s reader): peak memory is about the
largest tensor, never the model.

    python -m lightning_zinf.hf_export CKPT_DIR OUT_DIR --config PRETRAINED_FOLDER [--strip-prefix model.]
        [--max-shard-size 5GB] [--dtype bfloat16]
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lightning_zinf.checkpoint import CheckpointError
from lightning_zinf.consolidate import _Item, _items, _tensors, _write_safetensors

__all__ = ["export_pretrained", "export_peft_adapters", "main"]


def _select(checkpoint: Path, strip_prefix: str, rename: Callable[[str], Optional[str]], skip_excluded: bool = False
            ) -> tuple[list[_Item], Iterator[Iterator[Tensor]]]:
    """The checkpoint's tensors under ``strip_prefix``, each name passed through ``rename`` (``None``
    leaves it out; a tensor with no name left is skipped unread), and their values in order."""
    items, pieces, zinf, buffers = _items(checkpoint, "", skip_excluded)
    values = _tensors(checkpoint, zinf, items, pieces, buffers)
    kept: list[tuple[int, _Item]] = []
    for index, (names, dtype, shape) in enumerate(items):
        out = [rename(n[len(strip_prefix):]) for n in names if n.startswith(strip_prefix)]
        out = [n for n in out if n is not None]
        if out:
            kept.append((index, (out, dtype, shape)))
    wanted = {index for index, _ in kept}

    def chosen() -> Iterator[Iterator[Tensor]]:
        for index, blocks in enumerate(values):  # sequential: skipped items are never read
            if index in wanted:
                yield blocks

    return [item for _, item in kept], chosen()


def _nbytes(item: _Item) -> int:
    names, dtype, shape = item
    return len(names) * torch.Size(shape).numel() * dtype.itemsize


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", size, re.IGNORECASE)
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or a string such as '5GB' or '200MB'.")
    unit = match.group(2).upper()
    scale = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def _write_shards(folder: Path, items: list[_Item], values: Iterator[Iterator[Tensor]], max_shard_size: int,
                  dtype: Optional[torch.dtype], stem: str) -> dict[str, Any]:
    """Items into ``{stem}-0000k-of-0000n.safetensors`` files of at most ``max_shard_size`` bytes
    (a larger tensor gets a file of its own), or one ``{stem}.safetensors``; returns the index."""
    if dtype is not None:
        items = [(names, dtype, shape) for names, _, shape in items]
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        n = _nbytes(item)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    total = len(shards)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        name = f"{stem}.safetensors" if total == 1 else f"{stem}-{k + 1:05d}-of-{total:05d}.safetensors"
        partial = folder / (name + ".partial")
        _write_safetensors(partial, shard, itertools.islice(values, len(shard)))
        partial.rename(folder / name)
        weight_map.update((n, name) for names, _, _ in shard for n in names)
    return {"metadata": {"total_size": sum(_nbytes(item) for item in items)}, "weight_map": weight_map}


def export_pretrained(
    checkpoint: Path | str,
    folder: Path | str,
    *,
    config: Any,
    strip_prefix: str = "",
    max_shard_size: int | str = "5GB",
    dtype: Optional[torch.dtype] = None,
    generation_config: Any = None,
) -> Path:
    """Write a folder that ``from_pretrained`` loads, from a sharded ``zero_infinity`` checkpoint.

    Args:
        checkpoint: The checkpoint directory (any world size).
        folder: The output folder (created; files in it are replaced).
        config: The model's ``transformers`` config (anything with ``save_pretrained``, e.g.
            ``model.config``), written as ``config.json``.
        strip_prefix: Where the model sits in the checkpoint's names (``"model."`` for a
            LightningModule holding it as ``self.model``); names outside it are left out.
        max_shard_size: Largest safetensors file, in bytes or as ``"5GB"``/``"200MB"`` (decimal,
            as ``transformers``); one file and no index when everything fits.
        dtype: Write the weights in this dtype (``torch.bfloat16``); default: as stored.
        generation_config: Written as ``generation_config.json`` when given.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        CheckpointError: not a checkpoint, a missing or corrupt shard file, or nothing under
            ``strip_prefix``.
        ValueError: a malformed ``max_shard_size``.
    """
    checkpoint, folder = Path(checkpoint), Path(folder)
    limit = _parse_size(max_shard_size)
    items, values = _select(checkpoint, strip_prefix, lambda name: name)
    if not items:
        raise CheckpointError(f"{checkpoint} holds no tensor under strip_prefix={strip_prefix!r}.")
    folder.mkdir(parents=True, exist_ok=True)
    for old in itertools.chain(folder.glob("model*.safetensors"), folder.glob("model.safetensors.index.json")):
        old.unlink()
    index = _write_shards(folder, items, values, limit, dtype, "model")
    if len(set(index["weight_map"].values())) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    return folder


def export_peft_adapters(
    checkpoint: Path | str,
    folder: Path | str,
    *,
    peft_config: Any,
    strip_prefix: str = "",
    adapter_name: str = "default",
) -> Path:
    """Write the LoRA adapters of a PEFT model in a sharded checkpoint as ``PeftModel.save_pretrained``
    does: ``adapter_config.json`` and ``adapter_model.safetensors`` (the adapter's ``lora_*``
    tensors, named without the adapter's name), which ``PeftModel.from_pretrained(base, folder)`` loads.

    Args:
        checkpoint: The checkpoint directory.
        folder: The output folder.
        peft_config: The adapter's config (``model.peft_config[adapter_name]``).
        strip_prefix: Where the ``PeftModel`` sits in the checkpoint's names (``"model."``).
        adapter_name: Which adapter.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        CheckpointError: the checkpoint holds no ``lora_`` tensor of that adapter under the prefix.
    """
    checkpoint, folder = Path(checkpoint), Path(folder)
    marker = f".{adapter_name}."

    def rename(name: str) -> Optional[str]:
        if ".lora_" not in name or marker not in name:
            return None
        return name.replace(marker, ".")

    items, values = _select(checkpoint, strip_prefix, rename, skip_excluded=True)  # adapters are trainable
    if not items:
        raise CheckpointError(
            f"{checkpoint} holds no LoRA tensor of adapter {adapter_name!r} under strip_prefix={strip_prefix!r}."
        )
    folder.mkdir(parents=True, exist_ok=True)
    _write_shards(folder, items, values, 2**62, None, "adapter_model")
    peft_config.save_pretrained(folder)
    return folder


def main(argv: Optional[list[str]] = None) -> None:
    """Command line: ``python -m lightning_zinf.hf_export CKPT_DIR OUT_DIR --config CONFIG``."""
    import argparse

    from transformers import AutoConfig, GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory")
    parser.add_argument("output", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--config", required=True,
                        help="the model's config: a config.json, or a folder holding one (the pretrained model's)")
    parser.add_argument("--strip-prefix", default="", help="where the model sits in the checkpoint (e.g. 'model.')")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="write the weights in this dtype")
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(args.config)
    folder = Path(args.config) if Path(args.config).is_dir() else Path(args.config).parent
    generation = GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file() else None
    print(export_pretrained(args.checkpoint, args.output, config=config, strip_prefix=args.strip_prefix,
                            max_shard_size=args.max_shard_size, dtype=getattr(torch, args.dtype) if args.dtype else None,
                            generation_config=generation))


if __name__ == "__main__":
    main()
