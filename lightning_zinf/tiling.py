"""Memory-centric tiling of huge linear layers (ZeRO-Infinity, Rajbhandari et al., SC'21,
arXiv 2104.07857, §5.1.3).

A layer can be too large to gather whole even when its shards fit: gathering a unit needs its full
flat buffer on one rank. Tiling splits the weight of a linear layer into tiles, each its own unit,
that are gathered, used and released one after another in forward and again in backward, so the
working memory holds one tile (two while the next is prefetched), and no model parallelism is needed.

:class:`TiledLinear` is a drop-in for ``nn.Linear``: same math, the same ``weight``/``bias`` entries
in its state dict (a checkpoint moves between a tiled and an untiled model unchanged) and, on the
CPU, the same initial values given the same seed. :func:`tile_linear_layers` replaces large
``nn.Linear`` layers of a model with tiled ones; the engine applies it at partition time (option
``tiling``), on meta layers, so the full layer never exists on one rank.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_zinf.config import TilingConfig
from lightning_zinf.engine.construction import recorder_of

__all__ = ["TiledLinear", "LinearTile", "TileBias", "TileView", "tile_linear_layers", "tile_splits", "tile_views",
           "MAX_TILES_PER_LAYER", "MAX_TILES"]

# The most tiles :func:`tile_linear_layers` cuts one layer into, and a model into. Every tile is a
# unit: a module with its own hooks, flat buffer and shard, two all-gathers (forward, backward) and
# one reduce-scatter per step, a trace entry, a checkpoint entry. Tiling exists so that a layer too
# large to gather on one rank is gathered a piece at a time; the paper's tiling factors are tens
# (§5.1.3: a 64K-hidden layer in 16 tiles), and DeepSpeed's TiledLinear takes explicit split counts
# of that order. A tile below 1/1024 of its layer saves no memory worth having (the layer's shards
# and the prefetched units already dwarf it) while multiplying those per-unit costs: that is a
# tile_numel typed in the wrong unit, not a plan (tile_numel=1 made 12,288 tiles of a small model,
# and setup ran for minutes without a word). The minimum tile size is therefore relative, 1/1024 of
# its layer, not an absolute count of elements: a test model's layer of 64 elements may be cut in
# 8 tiles of 8. In total, 65,536 tiles are several times what a trillion-parameter model cut into
# tiles of tens of millions of elements needs (tens of thousands), and already some minutes of setup
# and three collectives each per step.
MAX_TILES_PER_LAYER = 1024
MAX_TILES = 65_536


def _ranges(size: int, splits: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``splits`` nearly equal pieces of ``size`` (the first ``size % splits``
    are one longer), as ``torch.tensor_split`` cuts."""
    base, extra = divmod(size, splits)
    bounds = [0]
    for k in range(splits):
        bounds.append(bounds[-1] + base + (k < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def _weight_bound(in_features: int) -> float:
    # The arithmetic of nn.Linear's kaiming_uniform_(a=sqrt(5)), step for step, so the bound (and with
    # it every drawn value) is bit-identical to the untiled layer's.
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    return math.sqrt(3.0) * (gain / math.sqrt(in_features))


class _BlockRng:
    """The CPU random state at the start of one row block, shared by the block's tiles when the
    input features are split (each tile replays the block's draws and keeps its own columns)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Optional[Tensor] = None


class LinearTile(nn.Module):
    """One tile of a :class:`TiledLinear`: rows ``rows`` and columns ``cols`` of the full
    ``(out_features, in_features)`` weight, as a module of its own (so it is its own unit).

    ``forward(x)``: ``x @ weight.T`` for ``x`` of shape ``(..., cols[1] - cols[0])``; the result has
    shape ``(..., rows[1] - rows[0])`` and ``x``'s dtype. No bias (:class:`TileBias` adds it).

    Attributes:
        weight: ``(rows[1] - rows[0], cols[1] - cols[0])``.
        rows, cols: ``[start, end)`` of the tile in the full weight.
        in_features: The full layer's input features (the initialisation bound depends on it).
    """

    def __init__(
        self,
        rows: tuple[int, int],
        cols: tuple[int, int],
        in_features: int,
        block_rng: _BlockRng,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.rows, self.cols, self.in_features = rows, cols, in_features
        self._block_rng = block_rng
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], cols[1] - cols[0], device=device, dtype=dtype))
        self.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw this tile's part of ``nn.Linear``'s initial weight: U(-b, b), b = 1/sqrt(in_features).

        On the CPU the values equal the untiled layer's exactly when the tiles of a layer are reset
        in order (as construction and the engine's unit-by-unit initialisation do): the CPU
        generator draws elements one after another in row-major order, so a tile spanning whole
        rows draws its own rows, and a tile holding some columns replays its row block's draws from
        the state the block's first tile recorded. On other devices the values follow the same
        distribution but not the same sequence.
        """
        bound = _weight_bound(self.in_features)
        whole_rows = self.cols == (0, self.in_features)
        if whole_rows or self.weight.is_meta or self.weight.device.type != "cpu":
            self.weight.uniform_(-bound, bound)
            return
        if self.cols[0] == 0:
            self._block_rng.state = torch.get_rng_state()
        elif self._block_rng.state is None:
            raise RuntimeError(
                f"LinearTile(rows={self.rows}, cols={self.cols}) was reset before the first tile of its row block; "
                "reset a TiledLinear's tiles in order (TiledLinear.reset_parameters does)."
            )
        else:
            torch.set_rng_state(self._block_rng.state)
        row = torch.empty(self.in_features, dtype=self.weight.dtype)
        for r in range(self.weight.shape[0]):
            row.uniform_(-bound, bound)
            self.weight[r].copy_(row[self.cols[0] : self.cols[1]])

    def extra_repr(self) -> str:
        return f"rows={self.rows}, cols={self.cols}"


class TileBias(nn.Module):
    """The bias of a :class:`TiledLinear`, a module after its tiles so that it is initialised after
    the whole weight, as ``nn.Linear`` draws it. ``forward(y)``: ``y + bias`` for ``y`` of shape
    ``(..., out_features)``.

    Attributes:
        bias: ``(out_features,)``.
        in_features: The layer's input features (the initialisation bound depends on it).
    """

    def __init__(
        self,
        out_features: int,
        in_features: int,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        self.reset_parameters()

    def forward(self, y: Tensor) -> Tensor:
        return y + self.bias

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """U(-b, b), b = 1/sqrt(in_features), as ``nn.Linear`` initialises its bias."""
        bound = 1 / math.sqrt(self.in_features)
        self.bias.uniform_(-bound, bound)


class TiledLinear(nn.Module):
    """A drop-in for ``nn.Linear`` whose weight is split into ``out_splits`` x ``in_splits`` tiles,
    each a module of its own, so the ZeRO engine gathers and releases one tile at a time
    (ZeRO-Infinity §5.1.3, memory-centric tiling).

    ``forward(x)`` computes ``x @ W.T + b`` for ``x`` of shape ``(..., in_features)`` (any number of
    leading dimensions), returning ``(..., out_features)`` in ``x``'s dtype: for each output split,
    the products of its tiles with the matching slices of ``x`` are summed, and the output splits
    are concatenated. Pieces are as ``torch.tensor_split`` cuts them, so splits need not divide the
    sizes.

    Its state dict holds ``weight`` ``(out_features, in_features)`` and ``bias`` ``(out_features,)``,
    as ``nn.Linear``'s does: ``load_state_dict`` of an untiled layer's entries works and vice versa.
    Given the same seed, a ``TiledLinear`` built on the CPU has exactly ``nn.Linear``'s initial
    values (see :meth:`LinearTile.reset_parameters`). The weight has no single tensor: code that
    reads ``layer.weight`` directly (``F.linear(x, layer.weight)``, weight tying) needs the untiled
    layer; :meth:`full_weight` assembles a copy.

    Args:
        in_features: The layer's input size.
        out_features: The layer's output size.
        bias: Add a learnable bias.
        in_splits: Pieces the input features are cut into (each tile then sums a partial product).
        out_splits: Pieces the output features are cut into.
        device: Of the parameters, as for ``nn.Linear``.
        dtype: Of the parameters, as for ``nn.Linear``.

    Attributes:
        tiles: ``out_splits * in_splits`` :class:`LinearTile`, row-major (output split first).
        tile_bias: A :class:`TileBias`, or ``None`` without bias.

    Raises:
        ValueError: a size or split count below 1, or more splits than features.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        for name, splits, size in (("in_splits", in_splits, in_features), ("out_splits", out_splits, out_features)):
            if not (isinstance(size, int) and size >= 1):
                raise ValueError(f"TiledLinear needs in_features and out_features >= 1, got {in_features} and {out_features}.")
            if not (isinstance(splits, int) and 1 <= splits <= size):
                raise ValueError(
                    f"TiledLinear {name}={splits!r} is invalid: it must be an integer from 1 to the number of "
                    f"{'input' if name == 'in_splits' else 'output'} features ({size})."
                )
        self.in_features, self.out_features = in_features, out_features
        self.in_splits, self.out_splits = in_splits, out_splits
        self._col_sizes = [hi - lo for lo, hi in _ranges(in_features, in_splits)]
        tiles = []
        for rows in _ranges(out_features, out_splits):
            block = _BlockRng()
            tiles.extend(LinearTile(rows, cols, in_features, block, device, dtype) for cols in _ranges(in_features, in_splits))
        self.tiles = nn.ModuleList(tiles)
        self.tile_bias = TileBias(out_features, in_features, device, dtype) if bias else None
        self.register_state_dict_post_hook(_merge_tiles)
        self.register_load_state_dict_pre_hook(_split_into_tiles)

    @property
    def bias(self) -> Optional[nn.Parameter]:
        """The bias parameter ``(out_features,)``, or ``None``."""
        return self.tile_bias.bias if self.tile_bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        pieces = x.split(self._col_sizes, dim=-1) if self.in_splits > 1 else (x,)
        outs = []
        for i in range(self.out_splits):
            row = self.tiles[i * self.in_splits : (i + 1) * self.in_splits]
            total = row[0](pieces[0])
            for tile, piece in zip(row[1:], pieces[1:]):
                total = total + tile(piece)
            outs.append(total)
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return self.tile_bias(y) if self.tile_bias is not None else y

    def reset_parameters(self) -> None:
        """Re-draw the tiles, then the bias: the random draws of ``nn.Linear.reset_parameters``."""
        for tile in self.tiles:
            tile.reset_parameters()
        if self.tile_bias is not None:
            self.tile_bias.reset_parameters()

    def full_weight(self) -> Tensor:
        """A new ``(out_features, in_features)`` tensor assembled from the tiles (under the ZeRO
        engine, call it inside ``gathered()``: outside, the tiles are released)."""
        return _assemble([t.weight.detach() for t in self.tiles], self.out_splits, self.in_splits)

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int = 1, out_splits: int = 1) -> "TiledLinear":
        """A ``TiledLinear`` holding ``linear``'s weight and bias (copied; on the meta device, a meta
        layer), with the same dtype, device and ``requires_grad``. Draws no random numbers.

        A layer built under :func:`~lightning_zinf.meta_parameters` gets tiles that are meta views
        of its recorded weight and bias (:mod:`~lightning_zinf.engine.construction`): the engine
        rebuilds each tile as its slice of the values construction gave the layer.

        Raises:
            ValueError: as the constructor, for the splits.
        """
        weight = linear.weight
        # Build on meta (the constructor's draws do nothing there), then give the tiles real memory.
        tiled = cls(linear.in_features, linear.out_features, linear.bias is not None, in_splits, out_splits,
                    device="meta", dtype=weight.dtype)
        if not weight.is_meta:
            tiled = tiled.to_empty(device=weight.device)
            with torch.no_grad():
                for tile in tiled.tiles:
                    tile.weight.copy_(weight[tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]])
                if linear.bias is not None:
                    tiled.tile_bias.bias.copy_(linear.bias)
        elif recorder_of(weight) is not None:
            for tile in tiled.tiles:
                tile.weight = _recorded_view(weight, weight.detach()[tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]])
            if linear.bias is not None:
                tiled.tile_bias.bias = _recorded_view(linear.bias, linear.bias.detach())
        for tile in tiled.tiles:
            tile.weight.requires_grad_(weight.requires_grad)
        if linear.bias is not None:
            tiled.tile_bias.bias.requires_grad_(linear.bias.requires_grad)
        tiled.train(linear.training)
        return tiled

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.tile_bias is not None}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")


def _recorded_view(source: nn.Parameter, view: Tensor) -> nn.Parameter:
    """A parameter that is ``view`` (a meta view of ``source``'s storage), recorded as ``source`` is."""
    recorder = recorder_of(source)
    assert recorder is not None
    with recorder.paused():
        view = view.as_subclass(Tensor)
    return recorder.parameter(view, source.requires_grad)


def _assemble(tiles: list[Tensor], out_splits: int, in_splits: int) -> Tensor:
    rows = [torch.cat(tiles[i * in_splits : (i + 1) * in_splits], dim=1) for i in range(out_splits)]
    return torch.cat(rows, dim=0)


def _merge_tiles(module: TiledLinear, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: ``tiles.K.weight`` entries become one ``weight`` (and ``tile_bias.bias``
    becomes ``bias``), in place of the first of them, as ``nn.Linear`` writes them."""
    tile_keys = [f"{prefix}tiles.{k}.weight" for k in range(len(module.tiles))]
    if tile_keys[0] not in state_dict:
        return
    values = [state_dict[k] for k in tile_keys]
    # Each tile's shape from its place, not from its parameter, which the ZeRO engine has released
    # again (to an empty tensor) by the time this hook runs; the entries are full copies.
    shapes_ok = all(tuple(v.shape) == (t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]) for v, t in zip(values, module.tiles))
    if not shapes_ok:
        return  # not this layer's tiles (a state dict edited by other hooks): left in tile form
    merged = {f"{prefix}weight": _assemble(values, module.out_splits, module.in_splits)}
    bias_key = f"{prefix}tile_bias.bias"
    if bias_key in state_dict:
        merged[f"{prefix}bias"] = state_dict[bias_key]
    replaced = set(tile_keys) | {bias_key}
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key == tile_keys[0]:
            state_dict.update(merged)
        elif key not in replaced:
            state_dict[key] = value


def _split_into_tiles(module: TiledLinear, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state-dict pre-hook: an ``nn.Linear``-style ``weight`` is cut into the tiles' entries
    (and ``bias`` renamed), so the tiles load it. Entries already in tile form pass unchanged."""
    weight = state_dict.pop(f"{prefix}weight", None)
    if weight is not None:
        if tuple(weight.shape) != (module.out_features, module.in_features):
            # Let the tiles report the mismatch in load_state_dict's usual message.
            state_dict[f"{prefix}tiles.0.weight"] = weight
        else:
            for k, tile in enumerate(module.tiles):
                state_dict[f"{prefix}tiles.{k}.weight"] = weight[tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]]
    bias = state_dict.pop(f"{prefix}bias", None)
    if bias is not None:
        state_dict[f"{prefix}tile_bias.bias"] = bias


def tile_splits(in_features: int, out_features: int, tile_numel: int) -> tuple[int, int]:
    """``(in_splits, out_splits)`` whose tiles hold at most ``tile_numel`` weight elements: whole
    rows where one row fits (the fewest, nearly equal row blocks), else single rows cut into
    column pieces."""
    if in_features <= tile_numel:
        rows = tile_numel // in_features
        return 1, -(-out_features // rows)
    return -(-in_features // tile_numel), out_features


def tile_linear_layers(root: nn.Module, config: TilingConfig) -> list[str]:
    """Replace, in place, every ``nn.Linear`` of ``root`` (that class exactly: subclasses such as
    ``nn.MultiheadAttention``'s projection read their weight directly) whose weight has more than
    ``config.threshold`` elements by a :class:`TiledLinear` with tiles of at most
    ``config.tile_numel`` elements (:func:`tile_splits`).

    On meta layers (a model built under :func:`~lightning_zinf.meta_parameters`) nothing is
    allocated: the engine later initialises the tiles one at a time, with the values the untiled
    layer would have had. Real layers have their values copied into the tiles.

    A layer whose weight or bias is also registered in another module (a tied output embedding)
    cannot be tiled: it is left alone with a warning naming it.

    A tiling that would cut one layer into more than :data:`MAX_TILES_PER_LAYER` (1024) tiles, i.e.
    tiles smaller than 1/1024 of their layer, or the model into more than :data:`MAX_TILES`
    (65,536), is refused before any layer is replaced (see the comment at those constants for why
    these bounds).

    Args:
        root: The model.
        config: The size threshold and the tile budget.

    Returns:
        The qualified names of the layers replaced.

    Raises:
        ValueError: ``root`` itself is an ``nn.Linear`` above the threshold (wrap it in a module so
            it can be replaced); the tiling would exceed :data:`MAX_TILES_PER_LAYER` tiles in a layer
            or :data:`MAX_TILES` in all (the message names the layer, its shape, the tiles it would
            get and their size, the bound, and the smallest ``tile_numel`` within it).
    """
    if type(root) is nn.Linear and root.weight.numel() > config.threshold:
        raise ValueError(
            "tile_linear_layers: the model itself is an nn.Linear, which cannot be replaced in place; wrap it "
            "in a module (nn.Sequential(layer)) or build a TiledLinear directly."
        )
    registrations: dict[int, int] = {}
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None:
                registrations[id(p)] = registrations.get(id(p), 0) + 1
    # First the plan, checked against the bounds; then the replacements (a refused tiling changes nothing).
    plan: list[tuple[nn.Module, str, nn.Linear, str]] = []  # (parent, child name, layer, qualified name)
    planned: dict[int, str] = {}  # id(layer) -> its name, for a layer registered twice
    for parent_name, parent in list(root.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if type(child) is not nn.Linear:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in planned:  # the same layer registered twice
                plan.append((parent, child_name, child, name))
                continue
            if child.weight.numel() <= config.threshold:
                continue
            if any(registrations[id(p)] > 1 for p in child.parameters()):
                warnings.warn(
                    f"tile_linear_layers: '{name}' shares a parameter with another module (tied weights) and "
                    "is not tiled; untie it to tile it.",
                    stacklevel=2,
                )
                continue
            planned[id(child)] = name
            plan.append((parent, child_name, child, name))
    _check_tile_counts({name: (layer.in_features, layer.out_features) for _, _, layer, name in plan
                        if planned[id(layer)] == name}, config)
    done: dict[int, TiledLinear] = {}
    replaced: list[str] = []
    for parent, child_name, child, name in plan:
        if id(child) in done:
            parent._modules[child_name] = done[id(child)]
            continue
        in_splits, out_splits = tile_splits(child.in_features, child.out_features, config.tile_numel)
        tiled = TiledLinear.from_linear(child, in_splits=in_splits, out_splits=out_splits)
        done[id(child)] = tiled
        parent._modules[child_name] = tiled
        replaced.append(name)
    return replaced


def _tile_count(in_features: int, out_features: int, tile_numel: int) -> int:
    in_splits, out_splits = tile_splits(in_features, out_features, tile_numel)
    return in_splits * out_splits


def _smallest_tile_numel(fits: Any, upper: int) -> int:
    """The smallest ``tile_numel`` in ``[1, upper]`` for which ``fits(tile_numel)`` (monotone: a
    larger tile never makes more tiles)."""
    low, high = 1, max(upper, 1)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle + 1, high)
    return low


def _check_tile_counts(layers: dict[str, tuple[int, int]], config: TilingConfig) -> None:
    """Refuse a plan with more than :data:`MAX_TILES_PER_LAYER` tiles in a layer, or
    :data:`MAX_TILES` in all. ``layers``: name -> ``(in_features, out_features)``.

    Raises:
        ValueError: naming the layer, its shape, its tiles and their size, the bound, and the fix.
    """
    counts = {name: _tile_count(i, o, config.tile_numel) for name, (i, o) in layers.items()}
    setting = f"TilingConfig(tile_numel={config.tile_numel:_}, min_numel={config.min_numel})"
    over = [name for name, count in counts.items() if count > MAX_TILES_PER_LAYER]
    if over:
        name = max(over, key=counts.__getitem__)
        i, o = layers[name]
        need = _smallest_tile_numel(lambda t: _tile_count(i, o, t) <= MAX_TILES_PER_LAYER, i * o)
        others = f" ({len(over) - 1} more layer{'s' * (len(over) > 2)} also exceed{'s' * (len(over) == 2)} it)" \
            if len(over) > 1 else ""
        size = min(config.tile_numel, i * o)
        raise ValueError(
            f"{setting} would cut layer '{name}' (nn.Linear({i}, {o}): weight ({o}, {i}), {i * o:,} elements) into "
            f"{counts[name]:,} tiles of at most {size:,} element{'s' * (size != 1)}; a layer may have at most "
            f"{MAX_TILES_PER_LAYER} tiles{others}. Each tile is a unit with its own gathers, reduce-scatter and hooks "
            f"every step, so tiles under 1/{MAX_TILES_PER_LAYER} of their layer are pure overhead. Set tile_numel to "
            f"at least {need:_} (tile_numel counts weight elements per tile: typically tens of millions, what one "
            f"rank can gather at once), or min_numel to at least {i * o:_} to leave this layer whole."
        )
    total = sum(counts.values())
    if total > MAX_TILES:

        def within(t: int) -> bool:
            threshold = t if config.min_numel is None else config.min_numel
            return sum(_tile_count(i, o, t) for i, o in layers.values() if i * o > threshold) <= MAX_TILES

        need = _smallest_tile_numel(within, max(i * o for i, o in layers.values()))
        name = max(counts, key=counts.__getitem__)
        i, o = layers[name]
        raise ValueError(
            f"{setting} would cut {len(layers)} layers into {total:,} tiles in all (the most, {counts[name]:,}, of "
            f"'{name}': nn.Linear({i}, {o}), weight ({o}, {i})); a model may have at most {MAX_TILES:,} tiles, each "
            f"a unit with its own gathers, reduce-scatter and hooks every step. Set tile_numel to at least {need:_}, "
            "or raise min_numel to leave the smaller layers whole."
        )


class TileView(NamedTuple):
    """Where a tile's parameter sits in the tensor the untiled layer would have.

    Attributes:
        name: That tensor's qualified name (``"mlp.fc.weight"``).
        shape: Its full shape.
        start: The index of the tile's first element in it (one entry per dimension); the tile's
            own shape gives the extent.
    """

    name: str
    shape: tuple[int, ...]
    start: tuple[int, ...]


def tile_views(root: nn.Module) -> dict[int, TileView]:
    """For every parameter of a :class:`TiledLinear` in ``root``: ``id(parameter)`` -> its
    :class:`TileView` (the bias maps onto the whole ``bias``). Parameters of other modules are absent."""
    views: dict[int, TileView] = {}
    for name, module in root.named_modules():
        if not isinstance(module, TiledLinear):
            continue
        prefix = f"{name}." if name else ""
        shape = (module.out_features, module.in_features)
        for tile in module.tiles:
            views[id(tile.weight)] = TileView(f"{prefix}weight", shape, (tile.rows[0], tile.cols[0]))
        if module.tile_bias is not None:
            views[id(module.tile_bias.bias)] = TileView(f"{prefix}bias", (module.out_features,), (0,))
    return views

