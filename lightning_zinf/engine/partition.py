"""Which parameters form a unit, and how a model is built without ever holding it whole.

ZeRO-Infinity §7 ("ease of use"): partitioning happens at model construction, with no change to
the model's code. Inside :func:`meta_parameters` every parameter a module registers is moved to the
meta device (no memory), while buffers stay real. :func:`materialize` later initialises the
parameters one unit at a time on the CPU, each module by its library's route (PEFT's LoRA init, a
``transformers`` model's own ``_init_weights``, torch's ``reset_parameters()``), so the engine can
shard a unit before the next one exists. Parameters that were real when the model was built keep
their values.
"""

from __future__ import annotations

import collections
import itertools
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from lightning_zinf.tiling import LinearTile

__all__ = ["UnitSpec", "plan_units", "meta_parameters", "materialize", "init_rng_state", "creation_order", "Replay",
           "parameter_slots", "parent_modules", "resolve_block_classes", "matches_classes", "LibraryInits"]


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
        ValueError: the model has no parameters, or a ``block_classes`` entry is not a class or name
            or matches no module of ``root``.
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

    matched: set[Union[str, type]] = set()
    for mod_name, module in root.named_modules():
        entry = matches_classes(module, classes, names) if module is not root else None
        if entry is not None:
            matched.add(entry)
        if id(module) in inside_block:
            continue
        block = entry is not None
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
    created: list[nn.Module] = []  # every module that made parameters here, in order (see Replay)

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and "_zinf_created" not in self.__dict__:
            # When the module made its first parameter: eager construction draws in this order.
            self.__dict__["_zinf_created"] = next(_CREATED)
            created.append(self)
        if param is not None and not param.is_meta:
            if not first_state:
                first_state.append(torch.get_rng_state())
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            param._zinf_init_rng_state = first_state[0]  # type: ignore[attr-defined]
            param._zinf_created_modules = created  # type: ignore[attr-defined]
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


#: Numbers modules in the order they register their first parameter inside :func:`meta_parameters`.
_CREATED = itertools.count()


def creation_order(modules: Sequence[nn.Module]) -> list[int]:
    """Positions of ``modules`` in the order eager construction would have initialised them: by
    when each registered its first parameter inside :func:`meta_parameters` (a LoRA layer that
    builds its wrapped ``nn.Linear`` before its own ``lora_A`` draws the Linear's values first,
    although ``modules()`` lists the LoRA layer first). A module with no record (built outside the
    context, or a tile made later by the tiling transform) keeps its place after the one before it.
    """
    keys = []
    previous = -1
    for position, module in enumerate(modules):
        previous = module.__dict__.get("_zinf_created", previous)
        keys.append((previous, position))
    return sorted(range(len(modules)), key=keys.__getitem__)


class Replay:
    """The initialisations of modules that construction made and then dropped (a LoRA model that
    builds a plain ``nn.Linear`` and replaces it with its own layer; LitGPT's LoRA blocks do): eager
    construction drew their initial values too, so the random stream only matches eager's if their
    draws are replayed, on scratch tensors, at their place in the creation order.

    Args:
        specs: The units of the model being materialised (their meta parameters name the modules
            that :func:`meta_parameters` saw made).
        alive: The model's modules now; one that took a dropped module's place and its creation
            number (a ``TiledLinear`` for the ``nn.Linear`` it tiles) draws its values itself.
    """

    def __init__(self, specs: list[UnitSpec], alive: list[nn.Module]) -> None:
        created: list[nn.Module] = next((p._zinf_created_modules for spec in specs for _, p in spec.params
                                         if hasattr(p, "_zinf_created_modules")), [])
        taken = {m.__dict__.get("_zinf_created") for m in alive}
        self._pending = collections.deque(m for m in created if m.__dict__["_zinf_created"] not in taken)

    def until(self, created: float) -> None:
        """Replay the dropped modules made before the module numbered ``created`` (``inf``: all)."""
        while self._pending and self._pending[0].__dict__["_zinf_created"] < created:
            module = self._pending.popleft()
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                continue
            kept = {n: p for n, p in module._parameters.items() if p is not None}
            for n, p in kept.items():
                module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
            try:
                with torch.no_grad():
                    reset()
            finally:
                module._parameters.update(kept)


def init_rng_state(specs: list[UnitSpec]) -> Optional[torch.Tensor]:
    """The CPU random state recorded when the first meta parameter was created, if any."""
    for spec in specs:
        for _, p in spec.params:
            state = getattr(p, "_zinf_init_rng_state", None)
            if state is not None:
                return state
    return None


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


class LibraryInits:
    """The modules without parameters of their own inside a ``transformers`` model, whose init
    (``_init_weights``, e.g. GPT-2's rescaling of each block's ``c_proj``) :func:`materialize` runs
    once every parameter below them is materialised, with how many of those are still waiting.

    Counted once, updated as units are materialised: each unit then costs its own parameters times
    the model's depth, where listing every ancestor's parameters for every unit (the root's are the
    whole model's) made setup quadratic in the number of units.

    Args:
        modules: The model's modules (``root.modules()``).
        parents: :func:`parent_modules` of the model.
        done: Ids of the parameters materialised already (they do not wait).

    Attributes:
        pending: module -> parameters below it (each counted once) not materialised yet.
        holders: id of a waiting parameter -> the modules counting it.
    """

    def __init__(self, modules: Sequence[nn.Module], parents: dict[nn.Module, nn.Module],
                 done: Collection[int] = frozenset()) -> None:
        self.pending: dict[nn.Module, int] = {}
        self.holders: dict[int, list[nn.Module]] = {}
        for module in modules:
            if any(p is not None for p in module._parameters.values()) or _library_model(module, parents) is None:
                continue
            below = [p for p in module.parameters() if id(p) not in done]
            self.pending[module] = len(below)
            for p in below:
                self.holders.setdefault(id(p), []).append(module)

    def materialized(self, replaced: dict[int, nn.Parameter],
                     to_load: Collection[int] = ()) -> tuple[set[nn.Module], set[nn.Module]]:
        """Count the parameters of ``replaced`` (id when counted -> the new parameter) as done.

        Returns:
            The modules that counted any of them, and those that counted one of ``to_load`` (ids
            of new parameters whose values are loaded next).
        """
        touched: set[nn.Module] = set()
        loading: set[nn.Module] = set()
        for old, new in replaced.items():
            for module in self.holders.pop(old, ()):
                self.pending[module] -= 1
                touched.add(module)
                if id(new) in to_load:
                    loading.add(module)
        return touched, loading


def materialize(
    spec: UnitSpec,
    names: dict[nn.Module, str],
    slots: dict[int, list[tuple[nn.Module, str]]],
    shapes: dict[int, torch.Size],
    parents: Optional[dict[nn.Module, nn.Module]] = None,
    built_real: frozenset[int] = frozenset(),
    preloaded: frozenset[int] = frozenset(),
    done: Optional[set[int]] = None,
    replay: Optional[Replay] = None,
    library_inits: Optional[LibraryInits] = None,
) -> None:
    """Give a unit's meta parameters real CPU memory and initialise them by their library's
    route (:func:`_initialize`); real parameters keep their values. Modules are initialised in
    creation order (:func:`creation_order`), with the draws of dropped modules made before each
    replayed first (``replay``).

    Each meta parameter is replaced by a new ``nn.Parameter`` in every module that registers it
    (``slots``: parameter id -> ``(module, name)`` pairs) and in ``spec.params``; ``shapes`` holds
    every parameter's shape from before partitioning (a shared parameter of an earlier unit is
    already released to an empty tensor when a later module is reset); no optimizer can
    hold the old object yet, since the model has not been set up. Modules are reset in
    ``modules()`` order, which for ordinary models is construction order, so the random stream is
    consumed as eager construction would consume it. A module whose parameters were all real when
    the model was built (ids in ``built_real``: built in ``__init__`` with their values) is not
    initialised at all. Any other is, with its parameters other than this unit's fresh ones (real
    ones, and those shared with a unit materialised earlier) swapped for scratch tensors, so the
    route draws the same random numbers without overwriting them. Meta parameters in ``preloaded``
    (ids) get zeroed memory but no initialisation: the caller loads their values next (a module
    whose fresh parameters are all preloaded is not initialised at all). ``done`` collects the ids
    of the parameters materialised over the calls of one partition (units are materialised in
    order), so a library's init of a module without parameters of its own runs once the last unit
    below it has been materialised; ``library_inits`` (:class:`LibraryInits`, one for all the
    calls of a partition) counts what those modules still wait for, so each call costs its own
    unit, not the model (``None``: counted afresh from ``done``, over the whole model).

    Raises:
        ValueError: a module with meta parameters has no initialisation route (:func:`_initialize`).
    """
    parents = parents if parents is not None else {}
    own = {id(p) for _, p in spec.params}
    replaced: dict[int, nn.Parameter] = {}
    materialized: set[int] = set()
    to_load: set[int] = set()
    for module in (spec.modules[i] for i in creation_order(spec.modules)):
        params = {n: p for n, p in module._parameters.items() if p is not None}
        fresh: set[int] = set()
        for p in params.values():
            if p.is_meta and id(p) in own:
                # NaN shows which parameters an init route left unset; those about to be loaded are
                # zeros (frozen ones may be quantized before the load comes).
                unset = p.is_floating_point() and id(p) not in preloaded
                real = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype) if unset
                                    else torch.zeros(p.shape, dtype=p.dtype), p.requires_grad)
                for owner, name in slots[id(p)]:
                    owner._parameters[name] = real
                replaced[id(p)] = real
                own.add(id(real))
                fresh.add(id(real))
                shapes[id(real)] = p.shape
                if id(p) in preloaded:
                    to_load.add(id(real))
        materialized |= fresh
        if not params or all(id(p) in built_real for p in params.values()):
            continue  # built with real values: they stay
        if fresh and fresh <= to_load:
            continue  # loaded next
        if replay is not None:
            replay.until(module.__dict__.get("_zinf_created", -1))
        kept = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in fresh}
        for n, p in kept.items():
            module._parameters[n] = nn.Parameter(torch.zeros(shapes.get(id(p), p.shape), dtype=p.dtype), p.requires_grad)
        try:
            with torch.no_grad():
                _initialize(module, names[module], parents)
        finally:
            module._parameters.update(kept)
    # A transformers model's init also acts on modules without parameters of their own (GPT-2
    # rescales the c_proj weights of each attention and MLP by 1/sqrt(2 n_layer)): after their
    # children, as its post_init applies it, once the last of the parameters below has been
    # materialised, which may be in this unit or (with a unit per module) in earlier ones, whose
    # parameters are then partitioned already and stand in as scratch tensors.
    if library_inits is None:  # counted now, over the whole model, with this unit's parameters in place
        top = spec.module
        while top in parents:
            top = parents[top]
        library_inits = LibraryInits(list(top.modules()), parents, done or set())
        touched, loading = library_inits.materialized({id(p): p for p in replaced.values()}, to_load)
    else:
        touched, loading = library_inits.materialized(replaced, to_load)
    done = done if done is not None else set()
    done |= materialized
    candidates: dict[nn.Module, None] = {}
    for module in spec.modules:
        node: Optional[nn.Module] = module
        while node is not None:
            candidates.setdefault(node, None)
            node = parents.get(node)
    for module in sorted(candidates, key=lambda m: -names.get(m, "").count(".") - bool(names.get(m))):
        # Once, when this unit materialised the last of the parameters below it, none to be loaded.
        if module not in touched or module in loading or library_inits.pending[module] != 0:
            continue
        library = _library_model(module, parents)
        assert library is not None  # LibraryInits counts only modules inside a library model
        scratch = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items()
                   if p is not None and id(p) not in materialized]
        for owner, name, p in scratch:
            owner._parameters[name] = nn.Parameter(torch.zeros(shapes.get(id(p), p.shape), dtype=p.dtype), False)
        try:
            with torch.no_grad():
                library._init_weights(module)
        finally:
            for owner, name, p in scratch:
                owner._parameters[name] = p
    spec.params = [(n, replaced.get(id(p), p)) for n, p in spec.params]


def parameter_slots(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every place a parameter is registered: parameter id -> ``(module, attribute name)`` pairs."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return slots
