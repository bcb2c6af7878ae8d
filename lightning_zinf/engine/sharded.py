"""The user's optimizer, re-pointed at fp32 master shards (ZeRO stage 3 optimizer-state partitioning).

The optimizer object the user built (and any LR scheduler bound to it) is kept: its param groups
are re-pointed, parameter by parameter, at the fragment of the fp32 master shard this rank owns.
Hyper-parameters per group (weight decay off for norms, say) carry over unchanged. This is exact
for *elementwise* optimizers (SGD, Adam, AdamW, RMSprop...), whose update of one element depends
only on that element's gradient and state.

A parameter that is frozen when the optimizer is sharded (its flat group has no master) is held by
a placeholder until it is unfrozen; parameter groups added later with ``add_param_group`` are
re-pointed the same way (:class:`ShardedOptimizers`).
"""

from __future__ import annotations

import weakref
import zlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_zinf.engine.flat import FlatGroup

if TYPE_CHECKING:  # the offload parts import the engine's modules
    from lightning_zinf.offload.optimizer import OptimizerOffload
    from lightning_zinf.offload.params import ParamOffload

__all__ = ["ShardedOptimizers", "Layout"]

#: Per sharded optimizer, per param group, per parameter: (flat group index, position in the group),
#: or ``None`` for a frozen tensor that is not the partitioned model's (dropped from the group).
Layout = list[list[Optional[tuple[int, int]]]]

# Optimizers whose update mixes elements of one tensor (factored or matrix-wise statistics, line
# search over the whole model): stepping them on shards would change the mathematics.
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon", "Shampoo", "SOAP", "Lamb", "LARS")


def _check_elementwise_and_fresh(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if name in _NOT_ELEMENTWISE:
        raise ValueError(
            f"{name} is not an elementwise optimizer: its update of one element depends on other "
            "elements of the tensor, so it cannot step ZeRO shards. Use SGD, Adam, AdamW, RMSprop or "
            "another elementwise torch optimizer."
        )
    if len(optimizer.state) > 0:
        raise ValueError(
            f"The {name} optimizer already has state; build it in `configure_optimizers` (before any "
            "step) so the strategy can move it onto the fp32 master shards."
        )


class ShardedOptimizers:
    """The optimizers sharded over one engine's flat groups, and what stands for each of the
    model's parameters in them.

    In a sharded optimizer a parameter is this rank's fragment of its flat group's fp32 master. A
    parameter whose group has no master (frozen since the model was partitioned: frozen groups get
    none, so a LoRA base model costs no fp32 copy) is held by a *placeholder*, an empty fp32 tensor
    that never gets a gradient, so the optimizer neither steps it nor keeps state for it (as plain
    torch skips a parameter without gradient). When the group is unfrozen it gets its master
    (:meth:`give_masters`) and the fragments take the placeholders' places in every optimizer, so
    an optimizer built over frozen parameters steps them once they train, as in plain torch.

    ``add_param_group`` of a sharded optimizer is re-pointed the same way: it takes the model's
    parameters (Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` passes them) and adds
    their fragments or placeholders. Code that reads the param groups expecting the model's
    parameters runs inside :meth:`presenting`.

    Args:
        groups: The engine's flat groups, in order (a group's index names it in the layouts).
        offload: The optimizer offload, which places masters on its tier, or ``None``.
        param_offload: The NVMe parameter offload (a shard is swapped in to make its master), or ``None``.
        separate_masters: Parameter shards live off the compute device: fp32 groups get a master
            of their own (:meth:`FlatGroup.make_master`'s ``separate``).
        adding_refused: Why ``add_param_group`` is refused (a combination of options that does not
            support it), or ``None``.

    Attributes:
        optimizers: The sharded optimizers, in the order they were sharded.
        plain_layouts: For each of ``optimizers``, per param group, per parameter it holds: ``(flat
            group index, position in the group)`` (``None`` for a frozen tensor of another model,
            dropped). The optimizer's plain, unsharded state dict numbers its parameters in this order.
    """

    def __init__(self, groups: list[FlatGroup], *, offload: Optional[OptimizerOffload] = None,
                 param_offload: Optional[ParamOffload] = None,
                 separate_masters: bool = False, adding_refused: Optional[str] = None) -> None:
        self.groups = groups
        self.offload = offload
        self.param_offload = param_offload
        self.separate_masters = separate_masters
        self.adding_refused = adding_refused
        self.optimizers: list[torch.optim.Optimizer] = []
        self.plain_layouts: list[Layout] = []
        self._slots = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g.params)}
        self._stand_in_slots: dict[int, tuple[int, int]] = {}  # id of a fragment or placeholder -> slot
        self._placeholders: dict[tuple[int, int], Tensor] = {}
        self._presenting = False
        self._version = 0  # bumped whenever what an optimizer holds may have changed
        # Per optimizer: (signature, groups, per group which of its fragments the optimizer holds).
        self._stepped: list[tuple[Any, list[FlatGroup], list[list[bool]]]] = []
        self._seen: list[tuple[tuple[int, int], ...]] = []  # per optimizer: its param groups when last re-pointed
        self._digest: Optional[tuple[int, int]] = None  # (version, digest of the layouts)

    # --- adopting an optimizer --------------------------------------------------------------------
    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the trainable groups their masters, re-point ``optimizer`` (in place) at fragments
        and placeholders, record its layout and intercept its ``add_param_group``.

        Raises:
            ValueError: the optimizer is not elementwise, already has state, or holds a tensor that
                is not a parameter of the partitioned model (or a frozen ``nn.Parameter``, dropped).
        """
        _check_elementwise_and_fresh(optimizer)
        self._place_masters([i for i, g in enumerate(self.groups) if g.trainable and g.master is None])
        layout = [self._re_point(param_group, type(optimizer).__name__) for param_group in optimizer.param_groups]
        self.optimizers.append(optimizer)
        self.plain_layouts.append(layout)
        self._stepped.append(((), [], []))
        self._seen.append(_signature(optimizer))
        self._version += 1
        self._intercept_add_param_group(optimizer)

    def give_masters(self, groups: Optional[list[FlatGroup]] = None) -> None:
        """Give every trainable group that has none its fp32 master (or ``groups``, trainable or
        not: a load that holds optimizer state for them), where the policy puts it (the offload's
        tier, or beside the shard), and put the new fragments in the placeholders' places in every
        optimizer. Without ``groups``, nothing before the first optimizer is sharded: masters are
        made then.

        Raises:
            RuntimeError: ``groups`` lack masters under NVMe optimizer offload (their swap files
                were not planned; the zero_grad of the optimizers does not know them).
        """
        if groups is None:
            if self.optimizers:
                self._place_masters([i for i, g in enumerate(self.groups) if g.trainable and g.master is None])
            return
        chosen = {id(g) for g in groups if g.master is None}
        missing = [i for i, g in enumerate(self.groups) if id(g) in chosen]
        if missing and self.offload is not None and self.offload.nvme:
            raise RuntimeError(
                f"'{self.groups[missing[0]].names[0]}' has optimizer state to restore but was frozen when the model "
                "was partitioned, and OffloadConfig(optimizer='nvme') planned swap files for the parameters trainable then "
                "only. Make the same parameters trainable before the strategy sets up as when the checkpoint was "
                "saved, or offload the optimizer to 'cpu'."
            )
        self._place_masters(missing)

    def _place_masters(self, missing: list[int]) -> None:
        if not missing:
            return
        if self.offload is not None:
            self.offload.place_masters(self._shard_resident, missing)
        else:
            for i in missing:
                with self._shard_resident(self.groups[i]):
                    self.groups[i].make_master(separate=self.separate_masters)
        self._fill_placeholders(missing)

    def _shard_resident(self, group: FlatGroup) -> ContextManager[None]:
        # A master is made from the shard, which may be on NVMe: one group's shard in memory at a time.
        if self.param_offload is None:
            return _nothing()
        return self.param_offload.resident([group], write_back=False)

    def _fill_placeholders(self, indices: list[int]) -> None:
        chosen = set(indices)
        moved = {slot: t for slot, t in self._placeholders.items() if slot[0] in chosen}
        if not moved:
            return
        swaps = {id(t): self.groups[i].fragments[j] for (i, j), t in moved.items()}
        for optimizer in self.optimizers:
            for param_group in optimizer.param_groups:
                param_group["params"][:] = [swaps.get(id(t), t) for t in param_group["params"]]
        for (i, j), placeholder in moved.items():
            del self._placeholders[(i, j)], self._stand_in_slots[id(placeholder)]
            self._stand_in_slots[id(self.groups[i].fragments[j])] = (i, j)
        self._version += 1

    def _stand_in(self, slot: tuple[int, int]) -> Tensor:
        """What the sharded optimizers hold for the parameter at ``slot``: its fragment, or its placeholder."""
        i, j = slot
        group = self.groups[i]
        if group.fragments:
            tensor = group.fragments[j]
        else:
            tensor = self._placeholders.get(slot)
            if tensor is None:
                tensor = self._placeholders[slot] = torch.empty(0, dtype=torch.float32, device=group.device)
        self._stand_in_slots[id(tensor)] = slot
        return tensor

    def _param_at(self, slot: tuple[int, int]) -> nn.Parameter:
        return self.groups[slot[0]].params[slot[1]]

    def _slot_of(self, tensor: Tensor) -> Optional[tuple[int, int]]:
        """The slot of a parameter of the partitioned model, or of a fragment or placeholder."""
        return self._slots.get(id(tensor), self._stand_in_slots.get(id(tensor)))

    def _re_point(self, param_group: dict[str, Any], name: str) -> list[Optional[tuple[int, int]]]:
        """Replace the tensors of ``param_group`` (a dict torch has normalised) by what stands for
        them; returns their slots."""
        kept, slots = [], []
        for p in param_group["params"]:
            slot = self._slot_of(p)
            if slot is not None:
                kept.append(self._stand_in(slot))
            else:
                self._refuse_foreign(p, name)  # a frozen parameter of another model is dropped: never stepped
            slots.append(slot)
        param_group["params"] = kept
        return slots

    @staticmethod
    def _refuse_foreign(p: Tensor, name: str) -> None:
        """Raise for a tensor that is neither a parameter of the partitioned model (nor what stands
        for one) nor a frozen ``nn.Parameter`` (which plain torch would never step either)."""
        if not (isinstance(p, nn.Parameter) and not p.requires_grad):
            raise ValueError(
                f"The {name} optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                "parameter of the partitioned model. Build the optimizer from `self.parameters()` "
                "(or a subset) inside `configure_optimizers`, and pass the model's own parameters "
                "to `add_param_group`."
            )

    # --- add_param_group --------------------------------------------------------------------------
    def _intercept_add_param_group(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.add_param_group`` take the model's parameters: torch's own method runs
        on the group with the fragments or placeholders in their places, and the layout grows. An
        instance attribute, which Lightning's and Fabric's optimizer wrappers copy."""
        original = optimizer.add_param_group
        owner, target = weakref.ref(self), weakref.ref(optimizer)

        def add_param_group(param_group: dict[str, Any]) -> None:
            sharded, opt = owner(), target()
            if sharded is None or opt is None or not isinstance(param_group, dict) \
                    or isinstance(param_group.get("params"), set):
                return original(param_group)  # torch's own errors for malformed groups
            sharded._add_param_group(opt, original, param_group)

        add_param_group.__doc__ = _ADD_PARAM_GROUP_DOC
        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]

    def _add_param_group(self, optimizer: torch.optim.Optimizer, original: Callable[[dict[str, Any]], None],
                         param_group: dict[str, Any]) -> None:
        name = type(optimizer).__name__
        if self.adding_refused is not None:
            raise RuntimeError(f"{name}.add_param_group on a sharded optimizer: {self.adding_refused}")
        params = param_group["params"]
        entries = [params] if isinstance(params, Tensor) else list(params)
        named = [isinstance(e, tuple) for e in entries]  # torch's (name, tensor) form
        if any(named) and not all(named):
            return original(param_group)  # torch's own error for a mix of the two forms
        tensors = [e[1] if isinstance(e, tuple) else e for e in entries]
        if self._presenting:  # the groups hold the model's parameters until presenting() ends
            for p in tensors:
                if self._slot_of(p) is None:
                    self._refuse_foreign(p, name)
            return original({**param_group, "params": entries})
        holder = {"params": tensors}
        slots = self._re_point(holder, name)
        names = iter([e[0] for e, slot in zip(entries, slots) if slot is not None and isinstance(e, tuple)])
        out = [(next(names), t) for t in holder["params"]] if any(named) else holder["params"]
        original({**param_group, "params": out})
        k = self._position(optimizer)
        self.plain_layouts[k].append(slots)
        self._seen[k] = _signature(optimizer)
        self._version += 1

    def re_point_added(self) -> None:
        """Re-point the param groups of the sharded optimizers that changed without the intercepted
        ``add_param_group`` (Fabric's optimizer wrapper runs torch's own method on the wrapped
        optimizer's param groups; code may append or assign param groups directly); called at each
        pass boundary that may run backward, before any step they take part in.

        Raises:
            ValueError: a param group holds a tensor that is not a parameter of the partitioned
                model, or one parameter is in two param groups.
            RuntimeError: param groups changed under NVMe optimizer offload.
        """
        for k, optimizer in enumerate(self.optimizers):
            if _signature(optimizer) != self._seen[k]:
                self._re_point_all(k)

    def _re_point_all(self, k: int) -> None:
        """Re-point every param group of optimizer ``k`` and rebuild its layout."""
        optimizer = self.optimizers[k]
        name = type(optimizer).__name__
        layout = [self._re_point(param_group, name) for param_group in optimizer.param_groups]
        if self.adding_refused is not None and layout != self.plain_layouts[k]:
            raise RuntimeError(f"The param groups of a sharded {name} changed: {self.adding_refused}")
        held = [id(t) for param_group in optimizer.param_groups for t in param_group["params"]]
        if len(set(held)) != len(held):
            raise ValueError(f"The sharded {name} optimizer holds some parameters in more than one param group: "
                             "add each parameter to one param group only.")
        self.plain_layouts[k] = layout
        self._seen[k] = _signature(optimizer)
        self._version += 1

    def _position(self, optimizer: torch.optim.Optimizer) -> int:
        return next(k for k, o in enumerate(self.optimizers) if o is optimizer)

    # --- what the optimizers step -----------------------------------------------------------------
    def stepped(self, optimizer: torch.optim.Optimizer) -> list[FlatGroup]:
        """The flat groups ``optimizer`` steps: those holding one of its fragments (cached until
        what it holds changes: an unfreeze, ``add_param_group``)."""
        return self._held(optimizer)[0]

    def held_flags(self, optimizer: torch.optim.Optimizer) -> list[list[bool]]:
        """Per group of :meth:`stepped`, per parameter, whether ``optimizer`` holds its fragment
        (a group may hold another optimizer's parameters too: FlatGroup.after_step's ``held``)."""
        return self._held(optimizer)[1]

    def _held(self, optimizer: torch.optim.Optimizer) -> tuple[list[FlatGroup], list[list[bool]]]:
        k = self._position(optimizer)
        signature = (self._version, _signature(optimizer))
        if self._stepped[k][0] != signature:
            held = {id(t) for g in optimizer.param_groups for t in g["params"]}
            groups = [g for g in self.groups if any(id(f) in held for f in g.fragments)]
            self._stepped[k] = (signature, groups, [[id(f) in held for f in g.fragments] for g in groups])
        return self._stepped[k][1], self._stepped[k][2]

    def layout_digest(self) -> int:
        """A 32-bit digest of :attr:`plain_layouts` (the ranks' must agree: every rank adds the same
        param groups)."""
        if self._digest is None or self._digest[0] != self._version:
            self._digest = (self._version, zlib.crc32(repr(self.plain_layouts).encode()))
        return self._digest[1]

    # --- code that expects the model's parameters in the param groups -----------------------------
    @contextmanager
    def presenting(self, optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
        """Within the block, the param groups of ``optimizers`` (those of them sharded here; a
        Lightning or Fabric wrapper stands for its optimizer) hold the model's own parameters, as
        they would without sharding; on exit every param group, old or new (``add_param_group``,
        or param groups assigned as a whole), is re-pointed at fragments and placeholders again and
        the layouts are rebuilt. For callbacks that map the param groups' tensors to the model's
        parameter names, or compare them with the model's (Lightning's ``BaseFinetuning``).

        Released parameters are empty tensors, which ``torch.equal`` finds equal to each other:
        inside the block each is given an empty tensor of a shape of its own (``(0, k)``), so a
        comparison of two released parameters tells them apart by identity, and a parameter
        equals only itself. Their values are not gathered: read values inside ``gathered()``.

        Raises:
            ValueError: on exit, a param group holds a tensor that is not a parameter of the
                partitioned model.
            RuntimeError: a step inside the block (its parameters are not the fragments).
        """
        unwrapped = (getattr(opt, "_optimizer", opt) for opt in optimizers)
        mine = [o for o in unwrapped if any(o is m for m in self.optimizers)]
        for optimizer in mine:
            for param_group in optimizer.param_groups:
                param_group["params"] = [self._param_at(self._stand_in_slots[id(t)]) for t in param_group["params"]]
        released = [g for g in self.groups if g.gathered_nbytes == 0]
        shape = 0
        for group in released:
            for p in group.params:
                shape += 1
                p.data = torch.empty((0, shape), dtype=p.dtype, device=p.device)
        self._presenting = True
        try:
            yield
        finally:
            self._presenting = False
            for group in released:
                group.repoint()
            for optimizer in mine:
                self._re_point_all(self._position(optimizer))


_ADD_PARAM_GROUP_DOC = """Add a param group of the partitioned model's parameters to this sharded optimizer
(torch's ``Optimizer.add_param_group``, re-pointed by lightning_zinf at this rank's fp32 master
fragments; a frozen parameter is held by a placeholder until it is unfrozen)."""


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _signature(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, int], ...]:
    """What changes when a param group is added, assigned or resized: each one's list and length."""
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
