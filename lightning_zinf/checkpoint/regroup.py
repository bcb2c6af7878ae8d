"""Which saved flat ranges hold the elements of each of the model's flat groups, so that a sharded
checkpoint loads into other units than it was saved from.

The units depend on settings that may change between a save and a load: ``block_classes``,
``PrefetchConfig.unit_size`` and ``bucket_size`` (:mod:`lightning_zinf.engine.grouping`), and the
module the engine wraps (a LightningModule groups its model otherwise than the bare model does).
FSDP2's distributed checkpoints load whatever the wrapping, since they are saved per parameter.
Here a checkpoint is saved per flat group, and each group is a concatenation of whole parameters
(``offsets``), so every parameter of the model is one contiguous range of one saved group. A
current group is then a list of :class:`Segment`, one per parameter, each a range of a saved
group. Weights, fp32 masters and elementwise optimizer state read the same ranges. Per-parameter
scalar state (Adam's ``step``) reads the parameter's position in its saved group
(:class:`Origin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_zinf.checkpoint.format import CheckpointError, ShardReader, _check_layout, check_prefix

__all__ = ["Origin", "SavedRanges", "Segment", "match_layout"]


@dataclass(frozen=True)
class Segment:
    """Elements ``[lo, hi)`` of a current flat group are elements ``[start, start + hi - lo)`` of
    saved flat group ``group``."""

    lo: int
    hi: int
    group: int
    start: int


@dataclass(frozen=True)
class Origin:
    """Where a current group's parameter was saved: flat group ``group``, position ``index`` in it."""

    group: int
    index: int


@dataclass(frozen=True)
class Sources:
    """Per current flat group, its :class:`Segment` list and its parameters' :class:`Origin` list."""

    segments: list[list[Segment]]
    origins: list[list[Origin]]


def match_layout(saved: list[dict[str, Any]], current: list[dict[str, Any]], path: Path) -> Sources:
    """The :class:`Sources` of ``current`` (the model's layout) in ``saved`` (the checkpoint's).

    The same groups: one segment per group, after the layout checks of a plain load. Other
    groups over the same parameters (other units): a segment per parameter, found by its names
    (a tied parameter's aliases included).

    Raises:
        CheckpointError: the checkpoint holds other parameters than the model (another model, or
            the same one with another prefix or tiling), or one in another shape or dtype.
    """
    if len(saved) == len(current) and all(a["names"] == b["names"] for a, b in zip(saved, current)):
        _check_layout(saved, current, path)
        return Sources([[Segment(0, g["numel"], i, 0)] for i, g in enumerate(current)],
                       [[Origin(i, k) for k in range(len(g["names"]))] for i, g in enumerate(current)])
    where: dict[str, tuple[int, int]] = {}
    for j, group in enumerate(saved):
        for k, (name, aliases) in enumerate(zip(group["names"], group.get("aliases") or [[n] for n in group["names"]])):
            for alias in {name, *aliases}:
                where.setdefault(alias, (j, k))
    saved_names = sorted(n for g in saved for n in g["names"])
    current_names = sorted(n for g in current for n in g["names"])
    if len(saved_names) != len(current_names) or any(n not in where for n in current_names):
        # The units may differ too (a LightningModule's grouped otherwise than its bare model): the
        # prefix first, then the plain load's messages (tiling, other model).
        check_prefix([n for g in saved for n in g["names"]], [n for g in current for n in g["names"]], path)
        _check_layout(saved, current, path)
        missing = [n for n in current_names if n not in where]
        raise CheckpointError(f"{path} was saved from a different model: it holds {len(saved_names)} parameters, the "
                              f"model {len(current_names)}" + (f" (the checkpoint lacks {missing[:3]})" if missing else "")
                              + ". Consolidate the checkpoint and load it with load_full_state_dict.")
    segments, origins = [], []
    for group in current:
        segs, origs = [], []
        for name, shape, offset in zip(group["names"], group["shapes"], group["offsets"]):
            j, k = where[name]
            old = saved[j]
            if old["shapes"][k] != shape or old["dtype"] != group["dtype"]:
                raise CheckpointError(
                    f"{path} holds '{name}' as {old['dtype']} of shape {old['shapes'][k]}, but the model has it as "
                    f"{group['dtype']} of shape {shape} (another MixedPrecisionConfig.frozen_dtype, or another model?): "
                    "use the settings it was saved with, or consolidate the checkpoint and load it with "
                    "load_full_state_dict, which converts.")
            numel = 1
            for size in shape:
                numel *= size
            last = segs[-1] if segs else None
            if last is not None and last.group == j and last.hi == offset and \
                    last.start + last.hi - last.lo == old["offsets"][k]:
                # The next parameter of the same saved group, in the same order: one read for both.
                segs[-1] = Segment(last.lo, offset + numel, j, last.start)
            else:
                segs.append(Segment(offset, offset + numel, j, old["offsets"][k]))
            origs.append(Origin(j, k))
        segments.append(segs)
        origins.append(origs)
    return Sources(segments, origins)


class SavedRanges:
    """Reads a current flat group's element ranges from a checkpoint through its :class:`Sources`.

    Args:
        reader: The checkpoint's shard reader.
        saved: The checkpoint's group layouts (``meta.pt``'s ``zinf["groups"]``).
        sources: :func:`match_layout`'s.
    """

    def __init__(self, reader: ShardReader, saved: list[dict[str, Any]], sources: Sources) -> None:
        self.reader = reader
        self.saved = saved
        self.sources = sources
        self._keys = set(reader.keys())
        self._names: dict[tuple[int, str], list[str]] = {}
        self._scalars: dict[str, Tensor] = {}

    def _held(self, group: int, suffix: str) -> Optional[str]:
        """The key of saved group ``group``'s tensor ``suffix``, if it holds it with its values."""
        key = f"{group}.{suffix}"
        return key if key in self._keys and not self.saved[group].get("excluded", False) else None

    def excluded(self, i: int) -> bool:
        """Every element of current group ``i`` was saved without its values (``exclude_frozen``)."""
        return all(self.saved[s.group].get("excluded", False) for s in self.sources.segments[i])

    def holds(self, i: int, position: int, suffix: str) -> bool:
        """Whether the saved group of current group ``i``'s parameter at ``position`` holds the
        tensor ``suffix`` with its values (a parameter never stepped before the save has no
        optimizer state there, whatever its new group's other parameters have)."""
        return self._held(self.sources.origins[i][position].group, suffix) is not None

    def state_names(self, i: int, prefix: str) -> list[str]:
        """The names after ``prefix`` (``"opt0."``) of the tensors the saved groups that feed
        current group ``i`` hold, in the checkpoint's order, each once."""
        if (i, prefix) not in self._names:
            feeding = {s.group for s in self.sources.segments[i]}
            names: dict[str, None] = {}
            for key in self.reader.keys():
                group, _, rest = key.partition(".")
                if group.isdigit() and int(group) in feeding and rest.startswith(prefix):
                    names.setdefault(rest[len(prefix):], None)
            self._names[i, prefix] = list(names)
        return self._names[i, prefix]

    def read(self, i: int, suffix: str, lo: int, hi: int, into: Tensor) -> None:
        """Write elements ``[lo, hi)`` of current group ``i``'s tensor ``suffix`` into
        ``into[: hi - lo]``, from each saved group that holds it. Elements of saved groups that do
        not (a master saved only as the weights, state of a parameter never stepped), or that
        were saved without their values, are left as ``into`` has them."""
        for seg in self.sources.segments[i]:
            key = self._held(seg.group, suffix)
            start, stop = max(seg.lo, lo), min(seg.hi, hi)
            if key is not None and start < stop:
                into[start - lo: stop - lo].copy_(self.reader.read(key, seg.start + start - seg.lo,
                                                                   seg.start + stop - seg.lo,
                                                                   self.reader.shard_numel(seg.group)))

    def dtype(self, i: int, suffix: str) -> Optional[torch.dtype]:
        """The stored dtype of ``suffix`` in the first saved group feeding ``i`` that holds it."""
        for seg in self.sources.segments[i]:
            key = f"{seg.group}.{suffix}"
            if key in self._keys:
                return self.reader.read(key, 0, 0, self.reader.shard_numel(seg.group)).dtype
        return None

    def scalar(self, i: int, position: int, suffix: str) -> Optional[Tensor]:
        """The per-parameter scalar ``suffix`` (``"opt0.step.scalar"``) of current group ``i``'s
        parameter at ``position``, from its saved group; ``None`` where that group holds none."""
        origin = self.sources.origins[i][position]
        key = f"{origin.group}.{suffix}"
        if key not in self._keys:
            return None
        if key not in self._scalars:  # one read per saved group, not per parameter
            n = len(self.saved[origin.group]["names"])
            self._scalars[key] = self.reader.read(key, 0, n, n)
        return self._scalars[key][origin.index]
