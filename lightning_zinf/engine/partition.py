"""Which parameters form a unit, and how a model is built without ever holding it whole.

ZeRO-Infinity §7 ("ease of use"): partitioning happens at model construction, with no change to
the model's code. Inside :func:`meta_parameters` every parameter a module registers is moved to the
meta device (no memory), while buffers stay real. :func:`materialize` later initialises the
parameters one unit at a time by calling each module's ``reset_parameters()`` on the CPU, so the
engine can shard a unit before the next one exists.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from lightning_zinf.tiling import LinearTile

__all__ = ["UnitSpec", "plan_units", "meta_parameters", "materialize", "init_rng_state", "parameter_slots",
           "resolve_block_classes", "matches_classes"]


@dataclass
class UnitSpec:
    """The parameters fetched and released together, and the module whose forward uses them.

    Attributes:
        name: The module's qualified name (``""`` for the root).
        module: The module whose forward pre-hook gathers the unit.
        params: ``(qualified name, parameter)`` pairs in a fixed order, each parameter exactly once.
        modules: The modules reset when the unit is materialised, in ``modules()`` order: ``module``
            (and, for a block, its descendants), preceded by modules whose parameters all belong
            to earlier units (a tied output layer), which own no unit of their own.
        is_root: The unit holds the root module's own parameters; their use is not tied to a
            forward call, so the unit stays gathered.
    """

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    is_root: bool = False


def resolve_block_classes(block_classes: Sequence[Union[str, type]]) -> tuple[set[type], set[str]]:
    """Split block class specs into classes and names (a name matches a class's ``__name__`` or its
    ``module.qualname`` path), so YAML can say ``Block`` or ``mypkg.model.Block``."""
    classes = {c for c in block_classes if isinstance(c, type)}
    names = {c for c in block_classes if isinstance(c, str)}
    for spec in block_classes:
        if not isinstance(spec, (str, type)):
            raise ValueError(f"block_classes entries must be class names or classes, got {spec!r}.")
    return classes, names


def matches_classes(module: nn.Module, classes: set[type], names: set[str]) -> Optional[Union[str, type]]:
    """The entry of :func:`resolve_block_classes`'s ``(classes, names)`` that ``module`` matches
    (an instance of a class, or its class's ``__name__`` or ``module.qualname``), or ``None``."""
    cls = type(module)
    for c in classes:
        if isinstance(module, c):
            return c
    for key in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
        if key in names:
            return key
    return None


def plan_units(
    root: nn.Module, block_classes: Sequence[Union[str, type]] = ()
) -> tuple[list[UnitSpec], dict[nn.Module, list[int]]]:
    """Assign every parameter of ``root`` to exactly one unit.

    By default each module's own parameters (``recurse=False``) form a unit. A module whose class is
    named in ``block_classes`` takes all parameters of its subtree as one coarser unit, except the
    tiles of a :class:`~lightning_zinf.TiledLinear` inside it, which stay units of their own (memory-
    centric tiling, ZeRO-Infinity §5.1.3): the block's other parameters then form several units, cut
    at the tiles so that units keep module order, and the block gathers all of them. A parameter
    registered in several modules (tied embeddings) belongs to the first unit that reaches it in
    ``named_modules()`` order; the other modules list that unit as an *external* unit and gather it
    with their own.

    Args:
        root: The model.
        block_classes: Classes, or class names, whose instances are fetched as one unit.

    Returns:
        ``(units, uses)``: the units, and for every module with hooks the indices of the units its
        forward needs (its own first, then externals).

    Raises:
        ValueError: the model has no parameters, or a ``block_classes`` entry is not a class or name.
    """
    classes, names = resolve_block_classes(block_classes)
    units: list[UnitSpec] = []
    uses: dict[nn.Module, list[int]] = {}
    owner: dict[int, int] = {}
    inside_block: set[int] = set()
    # Modules whose parameters all belong to earlier units (a tied head): they own no unit, but
    # materialisation must still reset them in module order to draw the same random numbers.
    reset_only: list[nn.Module] = []

    def add_unit(name: str, module: nn.Module, members: list[tuple[str, nn.Module]], needed: list[int]) -> None:
        nonlocal reset_only
        spec = UnitSpec(name=name, module=module, is_root=module is root)
        for member_name, member in members:
            for p_name, p in member._parameters.items():
                if p is None or p.numel() == 0:
                    continue
                if id(p) in owner:
                    if owner[id(p)] not in needed:
                        needed.append(owner[id(p)])
                    continue
                owner[id(p)] = len(units)
                spec.params.append((f"{member_name}.{p_name}" if member_name else p_name, p))
            spec.modules.append(member)
        if spec.params:
            needed.insert(sum(1 for i in needed if units[i].module is module), len(units))
            spec.modules[:0] = reset_only
            reset_only = []
            units.append(spec)
        elif any(p is not None for _, m in members for p in m._parameters.values()):
            reset_only.extend(m for _, m in members)

    for mod_name, module in root.named_modules():
        if id(module) in inside_block:
            continue
        block = module is not root and matches_classes(module, classes, names) is not None
        if not block:
            needed: list[int] = []
            add_unit(mod_name, module, [(mod_name, module)], needed)
            if needed:
                uses[module] = needed
            continue
        members = list(module.named_modules(prefix=mod_name))
        inside_block.update(id(m) for _, m in members[1:])
        # A tile of a TiledLinear stays its own unit inside a block (the block would otherwise gather
        # the whole layer): the block's other members form units between the tiles, in module order,
        # the order in which construction draws initial values. The block gathers all its own units.
        needed = []
        segment: list[tuple[str, nn.Module]] = []
        pieces = 0
        for member_name, member in members + [("", None)]:
            if member is not None and not isinstance(member, LinearTile):
                segment.append((member_name, member))
                continue
            if segment:
                add_unit(mod_name if pieces == 0 else f"{mod_name}#{pieces}", module, segment, needed)
                pieces, segment = pieces + 1, []
            if member is not None:
                tile_needed: list[int] = []
                add_unit(member_name, member, [(member_name, member)], tile_needed)
                if tile_needed:
                    uses[member] = tile_needed
        if needed:
            uses[module] = needed

    if units:
        units[-1].modules.extend(reset_only)
    else:
        raise ValueError(
            f"{type(root).__name__} has no parameters to partition. Build the model's layers in "
            "`__init__` or `configure_model` before the strategy sets up (a LightningModule whose "
            "`configure_model` creates nothing leaves nothing to train)."
        )
    return units, uses


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Within this context, parameters modules register are moved to the meta device.

    Buffers stay real (a causal mask built in ``__init__`` keeps its values). Each parameter is
    allocated for an instant before it moves, one at a time, so peak memory is one parameter.
    Initialisation done in ``__init__`` on meta parameters is lost; :func:`materialize` re-runs each
    module's ``reset_parameters()`` instead (the FSDP2 convention), starting from the CPU random
    state of the moment the first parameter was created (:func:`init_rng_state`), which is where
    eager construction would have started drawing.
    """
    original = nn.Module.register_parameter
    first_state: list[torch.Tensor] = []

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            if not first_state:
                first_state.append(torch.get_rng_state())
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            param._zinf_init_rng_state = first_state[0]  # type: ignore[attr-defined]
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def init_rng_state(specs: list[UnitSpec]) -> Optional[torch.Tensor]:
    """The CPU random state recorded when the first meta parameter was created, if any."""
    for spec in specs:
        for _, p in spec.params:
            state = getattr(p, "_zinf_init_rng_state", None)
            if state is not None:
                return state
    return None


def _reset(module: nn.Module, module_name: str) -> None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"Module '{module_name or '<root>'}' ({type(module).__name__}) was built on the meta device "
            "(inside `configure_model`) but has no `reset_parameters()` to initialise its parameters "
            f"({', '.join(n for n, p in module._parameters.items() if p is not None)}). Add a "
            "`reset_parameters()` method that initialises them, or build this module in `__init__`."
        )
    reset()


def materialize(
    spec: UnitSpec,
    names: dict[nn.Module, str],
    slots: dict[int, list[tuple[nn.Module, str]]],
    shapes: dict[int, torch.Size],
) -> None:
    """Give a unit's meta parameters real CPU memory and initialise them with ``reset_parameters()``.

    Each meta parameter is replaced by a new ``nn.Parameter`` in every module that registers it
    (``slots``: parameter id -> ``(module, name)`` pairs) and in ``spec.params``; ``shapes`` holds
    every parameter's shape from before partitioning (a shared parameter of an earlier unit is
    already released to an empty tensor when a later module is reset); no optimizer can
    hold the old object yet, since the model has not been set up. Modules are reset in
    ``modules()`` order, which for ordinary models is construction order, so the random stream is
    consumed as eager construction would consume it. A parameter shared with a unit materialised
    earlier is swapped for a scratch tensor during the reset (so the reset draws the same random
    numbers without overwriting it).

    Raises:
        ValueError: a module with meta parameters has no ``reset_parameters()``.
    """
    own = {id(p) for _, p in spec.params}
    replaced: dict[int, nn.Parameter] = {}
    for module in spec.modules:
        params = {n: p for n, p in module._parameters.items() if p is not None}
        if not params:
            continue
        for p in params.values():
            if p.is_meta and id(p) in own:
                real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), p.requires_grad)
                for owner, name in slots[id(p)]:
                    owner._parameters[name] = real
                replaced[id(p)] = real
                own.add(id(real))
                shapes[id(real)] = p.shape
        foreign = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in own}
        for n, p in foreign.items():
            module._parameters[n] = nn.Parameter(torch.empty(shapes[id(p)], dtype=p.dtype), p.requires_grad)
        try:
            with torch.no_grad():
                _reset(module, names[module])
        finally:
            module._parameters.update(foreign)
    spec.params = [(n, replaced.get(id(p), p)) for n, p in spec.params]


def parameter_slots(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every place a parameter is registered: parameter id -> ``(module, attribute name)`` pairs."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return slots
