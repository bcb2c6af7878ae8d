"""Which parameters form a unit, and how a model is built without ever holding it whole.

ZeRO-Infinity §7 ("ease of use"): partitioning happens at model construction, with no change to
the model's code. Inside :func:`meta_parameters` every parameter a module registers is moved to the
meta device (no memory), while buffers stay real, and what construction does to the parameters is
recorded (:mod:`~lightning_zinf.engine.construction`). :func:`materialize` later gives the
parameters of one unit at a time the values eager construction gives them, so the engine can shard
a unit before the next one exists. Parameters that were real when the model was built keep their
values.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from lightning_zinf.engine.construction import ConstructionRecorder, Replayer
from lightning_zinf.heap import setup_phase
from lightning_zinf.tiling import LinearTile

__all__ = ["UnitSpec", "plan_units", "persistent_units", "meta_parameters", "materialize", "parameter_slots",
           "parent_modules", "resolve_block_classes", "matches_classes"]


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
        run: The unit is a run of sibling modules (:func:`~lightning_zinf.engine.grouping.auto_blocks`),
            each of which gathers it.
    """

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    is_root: bool = False
    run: bool = False


def resolve_block_classes(block_classes: Sequence[Union[str, type]]) -> tuple[set[type], set[str]]:
    """Split block class specs into classes and names (a name matches a class's ``__name__`` or its
    ``module.qualname`` path), so YAML can say ``Block`` or ``mypkg.model.Block``.

    Raises:
        ValueError: an entry is neither a class nor a name (a module instance names its class to pass).
    """
    if isinstance(block_classes, (str, type)):
        block_classes = [block_classes]
    for spec in block_classes:
        if isinstance(spec, nn.Module):
            raise ValueError(f"block_classes takes module classes, got a module instance ({type(spec).__name__}); "
                             f"pass its class, block_classes=[{type(spec).__name__}], or the name '{type(spec).__name__}'.")
        if not isinstance(spec, (str, type)):
            raise ValueError(f"block_classes entries must be module classes or class names, got {spec!r} "
                             f"({type(spec).__name__}).")
    classes = {c for c in block_classes if isinstance(c, type)}
    names = {c for c in block_classes if isinstance(c, str)}
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


def persistent_units(specs: Sequence[UnitSpec], threshold: int, limit: int) -> list[bool]:
    """Which units stay gathered for the whole run (ZeRO-3's persistent parameters, Rajbhandari et
    al., SC'20, §7.2, with DeepSpeed's two bounds): the root's own unit always; of the others, those
    of at most ``threshold`` elements, smallest first (plan order among equals) while their elements
    together stay within ``limit``. Reads only the specs' shapes: every rank decides alike.

    Args:
        specs: The units, in plan order (:func:`plan_units`).
        threshold: ``PrefetchConfig.persistence_threshold``: most elements of one persistent unit.
        limit: ``PrefetchConfig.persistence_limit``: most elements of all of them, the root's aside.

    Returns:
        One flag per spec, in order.
    """
    flags = [spec.is_root for spec in specs]
    sizes = [sum(p.numel() for _, p in spec.params) for spec in specs]
    room = limit
    for size, index in sorted((n, i) for i, n in enumerate(sizes) if not specs[i].is_root and n <= threshold):
        if size > room:
            break  # the rest are no smaller
        flags[index] = True
        room -= size
    return flags


def plan_units(
    root: nn.Module, block_classes: Sequence[Union[str, type]] = (), blocks: Sequence[Sequence[nn.Module]] = ()
) -> tuple[list[UnitSpec], dict[nn.Module, list[int]]]:
    """Assign every parameter of ``root`` to exactly one unit.

    By default each module's own parameters (``recurse=False``, with those of its
    ``ParameterList``/``ParameterDict`` children, directly or in a ``ModuleList``/``ModuleDict``:
    never called, they are read by its forward; the root's stay gathered as its own do) form a unit. A module whose class is
    named in ``block_classes`` takes all parameters of its subtree as one coarser unit, except the
    tiles of a :class:`~lightning_zinf.TiledLinear` inside it, which stay units of their own (memory-
    centric tiling, ZeRO-Infinity §5.1.3): the block's other parameters then form several units, cut
    at the tiles so that units keep module order, and the block gathers all of them. A parameter
    registered in several modules (tied embeddings) belongs to the first unit that reaches it in
    ``named_modules()`` order; the other modules list that unit as an *external* unit and gather it
    with their own. ``root`` itself may be a block: the whole model is then one unit, which stays
    gathered (as the root's own parameters do: code may call its submodules without its forward).

    Args:
        root: The model.
        block_classes: Classes, or class names, whose instances are fetched as one unit.
        blocks: Runs of consecutive sibling modules of ``root``, each fetched as one unit
            (:func:`~lightning_zinf.engine.grouping.auto_blocks`' choice): a run of one module is
            a block as if its class were named; a longer run is one unit of all its members'
            subtrees, which each member's forward gathers (named ``first..last``).

    Returns:
        ``(units, uses)``: the units, and for every module with hooks the indices of the units its
        forward needs (its own first, then externals).

    Raises:
        ValueError: the model has no parameters, or a ``block_classes`` entry is not a class or name
            or matches no module of ``root``.
    """
    classes, names = resolve_block_classes(block_classes)
    chosen = {id(run[0]) for run in blocks if len(run) == 1}
    runs = {id(run[0]): run for run in blocks if len(run) > 1}
    module_names = {id(m): n for n, m in root.named_modules()} if runs else {}
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
                    # Tied to an earlier unit's parameter (not to one of this unit: a run of siblings
                    # may hold both ends of a tie, T5's encoder and decoder embeddings).
                    if owner[id(p)] != len(units) and owner[id(p)] not in needed:
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

    matched: set[Union[str, type]] = set()
    for mod_name, module in root.named_modules():
        # The model itself may be a block (DeepSpeed's leaf modules allow it): one unit of every
        # parameter, gathered for the whole run as the root's own parameters are (is_root).
        entry = matches_classes(module, classes, names)
        if entry is not None:
            matched.add(entry)
        if id(module) in inside_block:
            continue
        run = runs.get(id(module))
        if run is not None:
            members = [pair for m in run for pair in m.named_modules(prefix=module_names[id(m)])]
            inside_block.update(id(m) for _, m in members[1:])
            needed = []
            add_unit(f"{mod_name}..{module_names[id(run[-1])]}", module, members, needed)
            if units and units[-1].module is module:
                units[-1].run = True
            for member in run:
                uses[member] = list(needed)
            continue
        block = entry is not None or id(module) in chosen
        if not block:
            needed: list[int] = []
            # Parameter containers are never called: the module that holds one uses its
            # parameters in its own forward, so they are part of its unit.
            holders = list(_parameter_holders(module, mod_name))
            inside_block.update(id(c) for _, c in holders)
            add_unit(mod_name, module, [(mod_name, module), *holders], needed)
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

    unmatched = [c if isinstance(c, str) else c.__name__ for c in [*classes, *names] if c not in matched]
    if unmatched:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"block_classes entries {unmatched} match no module of {type(root).__name__} (a typo, or another "
            f"model's class?). Its module classes are: {', '.join(present)}."
        )
    if units:
        units[-1].modules.extend(reset_only)
    else:
        raise ValueError(
            f"{type(root).__name__} has no parameters to partition. Build the model's layers in "
            "`__init__` or `configure_model` before the strategy sets up (a LightningModule whose "
            "`configure_model` creates nothing leaves nothing to train)."
        )
    return units, uses


def _parameter_holders(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """The ``ParameterList``/``ParameterDict`` modules under ``module`` that only containers lead
    to (directly, or through ``ModuleList``/``ModuleDict``), with their qualified names: never
    called, their parameters are read by ``module``'s forward."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and prefix:
        return  # a container is processed as the holder of no unit: its parent took these
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            yield qualified, child
        elif isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for inner_name, inner in child.named_children():
                if isinstance(inner, (nn.ParameterList, nn.ParameterDict)):
                    yield f"{qualified}.{inner_name}", inner


@contextmanager
def meta_parameters(empty_init: bool = False) -> Iterator[None]:
    """Within this context, parameters modules register are moved to the meta device, and what
    construction does to them is recorded (:class:`~lightning_zinf.engine.construction.ConstructionRecorder`).

    Buffers stay real (a causal mask built in ``__init__`` keeps its values). Each parameter is
    allocated for an instant before it moves, one at a time, so peak memory is one parameter (and
    one stand-in of a parameter's size while a random initialisation advances the generators).
    The engine later rebuilds each parameter with the values eager construction gives it
    (:func:`materialize`), whatever ``__init__`` does: ``reset_parameters()``, a parent's
    ``self.apply(init)``, ``nn.init.*``, in-place writes, ``.data`` assignments, library inits.
    A parameter created on the meta device already (``device="meta"``) is not recorded: its module's
    ``reset_parameters()`` initialises it (the FSDP2 convention). Nested contexts share one record.

    Args:
        empty_init: Lightning's ``init_module(empty_init=True)``: the ``torch.nn.init`` calls made
            inside draw from a copy of the random generators, so the generators end where its other
            strategies leave them (they skip those calls: DDP keeps uninitialised memory), while
            the parameters still get eager construction's values (as FSDP's meta-device init gives
            every parameter its module's init). Calls made after the context draw as usual.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        yield
        return
    recorder = ConstructionRecorder()
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        with recorder.paused():  # the recorder answers `is_meta` for user code only
            if param is not None and not param.is_meta and not isinstance(param, nn.UninitializedParameter):
                param = recorder.parameter(recorder.to_meta(param), param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    _ACTIVE = recorder
    recorder.empty_init = empty_init
    try:
        with recorder.mode(), setup_phase():  # its stand-ins' memory goes back (lightning_zinf.heap)
            yield
    finally:
        recorder.empty_init = False
        _ACTIVE = None
        nn.Module.register_parameter = original  # type: ignore[method-assign]


#: The recorder of the outermost :func:`meta_parameters` context in progress, if any.
_ACTIVE: Optional[ConstructionRecorder] = None


def _peft_route(module: nn.Module, parents: dict[nn.Module, nn.Module]) -> Optional[Callable[[], None]]:
    """PEFT's own init of a LoRA adapter (``lora_A``/``lora_B``...): ``reset_lora_parameters`` of
    the LoRA layer that holds ``module`` in one of its adapter dicts, with the adapter's
    ``init_lora_weights`` from the nearest ``peft_config`` (zeros for ``lora_B`` by default)."""
    holder = parents.get(module)
    layer = parents.get(holder) if holder is not None else None
    if layer is None or not hasattr(layer, "reset_lora_parameters") or not isinstance(holder, nn.ModuleDict):
        return None
    adapter = next((key for key, child in holder.items() if child is module), None)
    if adapter is None:
        return None
    init_lora_weights = True
    ancestor = layer
    while ancestor is not None:
        config = getattr(ancestor, "peft_config", None)
        if isinstance(config, dict) and adapter in config:
            init_lora_weights = getattr(config[adapter], "init_lora_weights", True)
            break
        ancestor = parents.get(ancestor)
    return lambda: layer.reset_lora_parameters(adapter, init_lora_weights)


def _library_model(module: nn.Module, parents: dict[nn.Module, nn.Module]) -> Optional[nn.Module]:
    """The nearest ``transformers`` model (an instance of its ``PreTrainedModel``) at or above
    ``module``, whose per-module init routine ``_init_weights`` its ``post_init`` applies.

    Recognised by type, not by attribute names: other libraries' models have a ``config`` and an
    ``_init_weights`` too (LitGPT's ``GPT``), with another meaning; they get torch's route.
    ``transformers`` is not imported here (its lazy ``PreTrainedModel`` costs 0.7 s to load): a
    model of its classes exists only once ``transformers.modeling_utils`` is.
    """
    library = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(library, "PreTrainedModel", None) if library is not None else None
    if pretrained is None:
        return None
    node: Optional[nn.Module] = module
    while node is not None:
        if isinstance(node, pretrained):
            return node
        node = parents.get(node)
    return None


def _initialize(module: nn.Module, module_name: str, parents: dict[nn.Module, nn.Module]) -> None:
    """Initialise ``module``'s own parameters (freshly materialised, filled with NaN) by the first
    route that leaves none of them NaN: PEFT's LoRA init, the enclosing ``transformers`` model's
    ``_init_weights(module)`` (what its ``post_init`` applies to every module, e.g. normal(0,
    ``initializer_range``) for a Linear, ones for an RMSNorm), then ``reset_parameters()``.

    Raises:
        ValueError: no route initialises every parameter; names the module and the fix.
    """
    own = [p for p in module._parameters.values() if p is not None]

    def done() -> bool:
        return not any(p.isnan().any() for p in own if p.is_floating_point())

    library = _library_model(module, parents)
    routes = [
        _peft_route(module, parents),
        (lambda: library._init_weights(module)) if library is not None else None,
        getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None),
    ]
    for route in routes:
        if route is not None:
            route()
            if done():
                return
    raise ValueError(
        f"Module '{module_name or '<root>'}' ({type(module).__name__}) was built on the meta device "
        "(inside `configure_model`) but no initialisation route sets its parameters "
        f"({', '.join(n for n, p in module._parameters.items() if p is not None)}): it has no "
        "`reset_parameters()`, and no enclosing `transformers` model's `_init_weights` or PEFT "
        "LoRA layer initialises it. Add a `reset_parameters()` method, or build this module in `__init__`."
    )


def parent_modules(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Every submodule of ``root`` -> the module that holds it (the first, if shared)."""
    parents: dict[nn.Module, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parents.setdefault(child, module)
    return parents


def materialize(
    spec: UnitSpec,
    names: dict[nn.Module, str],
    slots: dict[int, list[tuple[nn.Module, str]]],
    shapes: dict[int, torch.Size],
    parents: dict[nn.Module, nn.Module],
    replayer: Replayer,
    preloaded: frozenset[int] = frozenset(),
) -> bool:
    """Give a unit's meta parameters real memory and their values; real parameters keep theirs.

    A parameter :func:`meta_parameters` recorded gets the values eager construction gives it
    (``replayer``: every recorded call that made or wrote its storage, run again with the recorded
    random states, on the device eager construction used). One created on the meta device already
    gets its module's initialisation route (:func:`_initialize`: PEFT's LoRA init, the enclosing
    ``transformers`` model's ``_init_weights``, ``reset_parameters()``), modules in ``modules()``
    order with their other parameters swapped for scratch tensors so the route overwrites only
    these. Parameters in ``preloaded`` (ids) get zeros: the caller loads their values next.

    Each meta parameter is replaced by a new ``nn.Parameter`` in every module that registers it
    (``slots``: parameter id -> ``(module, name)`` pairs) and in ``spec.params``; ``shapes`` holds
    every parameter's shape from before partitioning (a parameter shared with an earlier unit is
    an empty tensor by now); no optimizer can hold the old object yet, since the model has not been
    set up.

    Returns:
        Whether a value was built from tensors outside construction (they may differ between
        ranks: the caller takes rank 0's values for this unit).

    Raises:
        NotReproducible: a recorded value cannot be rebuilt (names the parameter and why).
        ValueError: a module with unrecorded meta parameters has no initialisation route.
    """
    replaced: dict[int, nn.Parameter] = {}
    unset: set[int] = set()
    outside = False
    for name, p in spec.params:
        if not p.is_meta:
            continue
        if id(p) in preloaded:
            value = torch.zeros(p.shape, dtype=p.dtype)
        elif replayer.can_rebuild(p):
            value = replayer.value_of(p, name)
            outside = outside or replayer.read_outside
        else:
            # NaN shows which parameters the init route left unset.
            value = torch.full(p.shape, float("nan"), dtype=p.dtype) if p.is_floating_point() else torch.zeros(p.shape, dtype=p.dtype)
            unset.add(id(p))
        real = nn.Parameter(value, p.requires_grad)
        for owner, attr in slots[id(p)]:
            owner._parameters[attr] = real
        replaced[id(p)] = real
        shapes[id(real)] = p.shape
    fresh = {id(replaced[i]) for i in unset}
    for module in spec.modules:
        params = {n: p for n, p in module._parameters.items() if p is not None}
        if not any(id(p) in fresh for p in params.values()):
            continue
        kept = {n: p for n, p in params.items() if id(p) not in fresh}
        for n, p in kept.items():
            module._parameters[n] = nn.Parameter(torch.zeros(shapes.get(id(p), p.shape), dtype=p.dtype), p.requires_grad)
        try:
            with torch.no_grad():
                _initialize(module, names[module], parents)
        finally:
            module._parameters.update(kept)
    spec.params = [(n, replaced.get(id(p), p)) for n, p in spec.params]
    return outside


def parameter_slots(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every place a parameter is registered: parameter id -> ``(module, attribute name)`` pairs."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return slots
