"""Units sized automatically: which modules are fetched as one unit when the user names no
``block_classes``.

A unit costs the same host work and collective latency whatever its size: its hooks, two gathers
(forward and backward) and a reduce-scatter a step. Many small units — a unit per module of a model
with thousands of small tensors (LayerNorms, biases, per-head projections, experts) — make ZeRO-3
slower than DDP (DeepSpeed #1069, #3349; Lightning #11901), where its bandwidth alone would not.
DeepSpeed's answer is a hand-set ``stage3_module_granularity_threshold``; FSDP2's is the user's
choice of the modules to wrap. Here the engine groups by size:

- the largest subtrees of at most ``unit_size`` elements become units (blocks), walking down from
  the model's children: a module whose subtree is larger is split into its children, and its own
  parameters form a unit of their own, as without grouping;
- only a module with a ``forward`` of its own can be a block (its forward pre-hook gathers the
  unit): a container (``nn.ModuleList``, ``nn.ModuleDict``) is always split;
- consecutive sibling blocks (the experts of a mixture, the blocks of a narrow stack) are packed
  into runs of at most ``unit_size`` elements, each run one unit that every member's forward
  gathers: while the trace says the next request is the same unit, it stays gathered from one
  member's forward to the next (:class:`~lightning_zinf.engine.schedule.Schedule`);
- the grouping reads only the module tree and the parameters' shapes, so every rank makes the
  same one from the same model and the same ``unit_size``.

``unit_size``, unless the user sets it, is the prefetch bucket (``PrefetchConfig.bucket_size``:
the elements the user lets be gathered ahead of use). A unit's fixed cost is mostly the host's
(its hooks, the bookkeeping of its gathers, releases and reduce-scatter: 1.8-3.4 ms a unit a step
on the CPU testbed), and prefetch hides a gather's transfer but not that work, so fewer, larger
units are faster until a unit is as large as what may be gathered ahead anyway. A size from the
measured collective instead (a unit whose latency is a tenth of its gather, ``9 α β`` bytes) gave
2**21 elements on the testbed and 0.72-0.88x DDP on ``small_tensors.py``'s models, against
0.88-0.97x at 2**23 (examples/benchmarks/RESULTS.md, 2026-11-29). The size is never one that
grows with the model's: the working set stays a few units, flat in depth (Rajbhandari et al.,
SC'20, §5), and it reads no measurement, so every rank groups alike.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import nn

from lightning_zinf.tiling import LinearTile

__all__ = ["auto_blocks", "unit_size_for"]


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (containers inherit nn.Module's, which raises)."""
    return type(module).forward is not nn.Module.forward


def _subtree_numel(root: nn.Module) -> dict[int, int]:
    """Elements of every module's subtree (by module id), each parameter once per subtree."""
    return {id(m): sum(p.numel() for p in m.parameters()) for m in root.modules()}


def auto_blocks(root: nn.Module, unit_size: int) -> list[list[nn.Module]]:
    """The modules of ``root`` to fetch together (module docstring), in ``named_modules()``
    order: the largest subtrees of at most ``unit_size`` parameter elements whose module has a
    forward of its own, consecutive siblings among them packed into runs of at most
    ``unit_size`` elements in all (a run is one unit; the experts of a mixture, the blocks of a
    narrow stack). ``root`` itself is never one (its parameters stay gathered); a module holding
    a tile of a :class:`~lightning_zinf.TiledLinear` is never packed with its siblings.

    Args:
        root: The model (real or on the meta device: only shapes are read).
        unit_size: Most elements per run (> 0).

    Returns:
        The runs of sibling modules, for :func:`~lightning_zinf.engine.partition.plan_units`' ``blocks``.

    Raises:
        ValueError: ``unit_size`` is not positive.
    """
    if unit_size <= 0:
        raise ValueError(f"auto_blocks: unit_size must be > 0 elements, got {unit_size}")
    sizes = _subtree_numel(root)
    runs: list[list[nn.Module]] = []
    visited: set[int] = set()

    def visit(module: nn.Module) -> None:
        run: list[nn.Module] = []
        total = 0
        for child in module.children():
            if id(child) in visited:  # a module registered twice is planned at its first place
                continue
            visited.add(id(child))
            numel = sizes[id(child)]
            if numel == 0:  # an activation between two layers does not part them
                continue
            if numel > unit_size or not _has_forward(child):
                run, total = [], 0
                visit(child)
                continue
            tiled = any(isinstance(m, LinearTile) for m in child.modules())
            if run and (tiled or total + numel > unit_size):
                run, total = [], 0
            if not run:
                runs.append(run)
            run.append(child)
            total += numel
            if tiled:  # nothing joins it either
                run, total = [], 0

    visit(root)
    return runs


def unit_size_for(block_classes: Sequence[Union[str, type]], unit_size: Optional[int], bucket_size: int) -> int:
    """The engine's unit size, in parameter elements: 0 (no grouping: the user's blocks) with
    ``block_classes``; else ``unit_size`` (:class:`~lightning_zinf.PrefetchConfig`'s) where it is
    given; else (``None``) the prefetch bucket, ``bucket_size`` (module docstring; 0: a unit per
    module, the least gathered at once). Reads no rank's measurement: every rank gets the same."""
    if block_classes:
        return 0
    return bucket_size if unit_size is None else unit_size
