"""Partitioned construction that keeps every value ``__init__`` gives: record, then replay unit by unit.

ZeRO-Infinity §7 ("ease of use") partitions a model as it is built, with no change to its code.
Inside :func:`~lightning_zinf.engine.partition.meta_parameters` every parameter a module registers
is moved to the meta device, so no rank ever holds the model whole. Whatever ``__init__`` then does
to the parameters (``reset_parameters()``, a parent's ``self.apply(init)``, ``nn.init.*``, in-place
``fill_``/``normal_``/``copy_``, ``.data`` assignments along a class hierarchy, a library's own
init) would be lost on meta tensors; DeepSpeed's ``zero.Init`` keeps it by allocating each module
for real and partitioning it when its ``__init__`` returns. Here it is recorded instead, as
deferred initialisation records operations on fake tensors (the approach of torchdistx's
``deferred_init``): a :class:`~torch.overrides.TorchFunctionMode` notes, for every storage created
or written during construction (a *root*), the call that created it and every call that wrote it
after, with the tensors they read as references to other roots at that point of their history.
The engine then rebuilds each parameter from its root, one unit at a time (:class:`Replayer`):
peak memory is a unit, and the values are those eager construction gives.

Random draws are what makes this exact. Each call that draws is recorded with the state of the
generators it drew from, before and after; a call on meta tensors draws nothing, so it is run once
more on real stand-ins of the same shape, on the device eager construction would have used, to
advance the generators as eager construction does (later draws in ``__init__``, a buffer's
``torch.randn``, then see the stream they would see). Replay restores each recorded state before
its call and checks that the call left the generators as recorded: anything that consumed the
stream differently is refused by name rather than giving other values. Ranks replay rank 0's
recorded states (:meth:`ConstructionRecorder.adopt_rank0_draws`), so every rank builds rank 0's
values, as DDP's broadcast gives them, without moving the values themselves.

What cannot be replayed is refused at replay, naming the parameter (:class:`NotReproducible`): a
tensor from outside construction that was changed after a parameter was built from it, a
parameter built from a meta tensor the model made itself, a call whose random draws did not show
on the stand-ins.
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["ConstructionRecorder", "Replayer", "NotReproducible", "recorder_of"]

#: Calls that read metadata only: passed through without a look (they neither draw, create nor write).
_METADATA = frozenset({
    "dim", "size", "numel", "stride", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "nelement", "ndimension", "storage_offset", "__len__", "__get__", "__set__", "_set_grad_enabled",
    "__format__", "__repr__", "__hash__", "is_leaf", "get_device", "is_meta",
    "untyped_storage", "data_ptr", "requires_grad_", "retain_grad", "register_hook", "__reduce_ex__",
})

#: Calls that turn a tensor into a Python value: on a recorded meta tensor, computed from its eager values.
_CONCRETE = frozenset({"item", "__bool__", "tolist", "__int__", "__float__", "__index__", "__complex__"})

#: Writes that draw no random numbers: no stand-in run for them (replay still checks the generators).
_NO_DRAW = frozenset({
    "fill_", "zero_", "copy_", "__setitem__", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_",
    "clamp_max_", "masked_fill_", "index_fill_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "t_",
    "transpose_", "squeeze_", "unsqueeze_", "__iadd__", "__isub__", "__imul__", "__itruediv__", "neg_", "abs_",
    "sqrt_", "exp_", "log_", "pow_", "addcmul_", "addcdiv_", "lerp_", "fmod_", "remainder_", "floor_", "ceil_",
    "round_", "sign_", "tril_", "triu_", "scatter_", "index_copy_", "masked_scatter_", "detach_",
})


class NotReproducible(ValueError):
    """A parameter's value under partitioned construction cannot be what eager construction gives;
    the message names the parameter, the call and the way out (build the module eagerly, or give
    it a ``reset_parameters()``)."""


def _key(t: Tensor) -> Optional[int]:
    """The identity of ``t``'s storage (views share it), or ``None`` for a tensor without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", type(func).__name__)


@dataclass(eq=False)
class _Ref:
    """A tensor a call read or wrote: a view of a root as it was after ``position`` of its writes."""

    root: "_Root"
    position: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(eq=False)
class _Held:
    """A real tensor from outside construction that a call read: read again at replay, so it must
    not have changed since (its version then and now)."""

    tensor: Tensor
    version: Optional[int]  # None: an inference tensor, which keeps no version


@dataclass(eq=False)
class _Draws:
    """The generators a call drew from: each one's state before and after it."""

    generators: list[torch.Generator]
    before: list[Tensor]
    after: list[Tensor]


@dataclass(eq=False)
class _Call:
    """One recorded torch call: the function, its arguments (tensors as :class:`_Ref`/:class:`_Held`,
    flattened with their pytree spec), its draws, and the default dtype and device it ran under
    (a factory's result depends on them)."""

    func: Callable[..., Any]
    spec: Any
    leaves: list[Any]
    draws: Optional[_Draws]
    checked: bool  # the stand-in run showed whether it draws (meta inputs); real calls always are
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        return f"torch call '{_name(self.func)}'"


@dataclass(eq=False)
class _Root:
    """A storage made during construction: the call that made it (``initial``; or a copy of a real
    tensor from outside, for a parameter built from one) and, in order, every call that wrote it."""

    initial: Union[_Call, Tensor]
    out: int  # which tensor of the initial call's flattened outputs
    device: torch.device  # where eager construction had it (stand-ins and replay run there)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    numel: int  # of the storage, in elements of the creating tensor's dtype
    log: list[_Call] = field(default_factory=list)


def recorder_of(param: Tensor) -> Optional["ConstructionRecorder"]:
    """The recorder that built ``param`` on the meta device, if any."""
    return getattr(param, "_zinf_recorder", None)


class ConstructionRecorder:
    """Records how every storage made during construction got its values (module docstring).

    It sees torch calls two ways: while :func:`~lightning_zinf.engine.partition.meta_parameters`
    is active, every call, through :meth:`mode` (a :class:`~torch.overrides.TorchFunctionMode`),
    so factories and real temporaries get recipes; and at any time until the engine materialises
    the model, every call on a parameter it moved to the meta device or a meta tensor derived from
    one, which are tensor subclasses whose ``__torch_function__`` reports here. So an
    initialisation applied after construction, before setup (LitGPT's pretraining script sets
    and runs each module's ``reset_parameters`` then, as FSDP's meta-device recipe expects), is
    recorded too.

    Attributes:
        draws: Every recorded call's :class:`_Draws`, in recording order (replaced by rank 0's).
        empty_init: ``torch.nn.init`` calls draw from a copy of the generators, which they advance
            instead (Lightning's ``empty_init=True``: see :func:`~lightning_zinf.meta_parameters`).
    """

    def __init__(self) -> None:
        self._roots: dict[int, tuple[StorageWeakRef, _Root]] = {}
        self._busy = False
        self._made = 0
        self.draws: list[_Draws] = []
        self.empty_init = False
        self._shadow: dict[int, Tensor] = {}  # generator id -> its copy's state (empty_init)
        # A digest of construction's path: every recorded call with its arguments (tensors by shape
        # and dtype) and draws, every value that steered it. Ranks replay rank 0's draws only where
        # it is the same, since their calls then are too.
        self._path = 0

    # --- recording ----------------------------------------------------------------------------------
    def mode(self) -> TorchFunctionMode:
        """A mode that reports every torch call made inside it here (construction's context)."""
        return _RecordingMode(self)

    def handle(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a torch call and record it (the mode's and the recorded tensors' ``__torch_function__``)."""
        if self._busy:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _name(func) in _CONCRETE and args and isinstance(args[0], Tensor):
            root = self._root_of(args[0])
            if root is not None and self._truly_meta(args[0]):
                return self._concrete(func, args, kwargs)
        if _name(func) in _METADATA:
            # torch.nn.init returns at once on meta tensors (`if tensor.is_meta: return`): to it, a
            # recorded tensor is not one, so the init runs its calls and they are recorded.
            if _is_meta_property(func) and args and self._root_of(args[0]) is not None and _asked_by_torch_init():
                return False
            if _is_data_setter(func) and len(args) == 2 and self._sets_real_data_on_meta(args[0], args[1]):
                # `p.data = tensor` on a recorded parameter: it stays on the meta device and stands
                # for that tensor's storage from now on (recorded, or copied if made elsewhere).
                args = (args[0], self.to_meta(args[1]))
            self._busy = True
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                return self._wrapped(out)  # `.data`, `.T` of a recorded tensor are recorded too
            finally:
                self._busy = False
        self._busy = True
        try:
            return self._record(func, args, kwargs)
        finally:
            self._busy = False

    def _sets_real_data_on_meta(self, target: Any, value: Any) -> bool:
        if not (isinstance(target, Tensor) and isinstance(value, Tensor)):
            return False
        with self.paused():
            return target.is_meta and not value.is_meta and self._root_of(target) is not None

    def _truly_meta(self, t: Tensor) -> bool:
        with self.paused():
            return t.is_meta

    def _concrete(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A Python value of a recorded meta tensor (``bool()``, ``.item()``: the data-dependent
        control flow of an init, such as ``trunc_normal_``'s rejection loop): computed from the
        values the tensor has in eager construction, rebuilt now (with the recorded random states,
        the generators put back after), so construction takes eager's branch."""
        self._busy = True
        replayer = Replayer()
        try:
            value = replayer.current(self._reference(args[0]))  # type: ignore[arg-type]
            with torch._C.DisableTorchFunctionSubclass():
                result = func(value, *args[1:], **kwargs)
            self._note(f"value {_name(func)} {result!r}")  # a branch construction took
            return result
        finally:
            replayer.close()
            self._busy = False

    def _wrapped(self, out: Any) -> Any:
        """``out`` with each plain meta tensor whose storage is recorded made a recorded tensor, so
        that calls on it after construction's context reach the recorder too."""
        leaves, spec = tree_flatten(out)
        changed = False
        for i, o in enumerate(leaves):
            if type(o) is Tensor and o.is_meta and self._root_of(o) is not None:
                leaves[i] = o.as_subclass(_RecordedTensor)
                leaves[i]._zinf_recorder = self
                changed = True
        return tree_unflatten(leaves, spec) if changed else out

    def _note(self, step: str) -> None:
        self._path = zlib.crc32(step.encode(), self._path)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Torch calls made inside are not recorded (the engine's own work during construction)."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def _record(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        versions = [_version(t) for _, t in tensors]
        recorded = list(leaves)
        for i, t in tensors:
            recorded[i] = self._reference(t)
        generators = self._generators(tensors, kwargs)
        shadowed = self.empty_init and getattr(func, "__module__", None) == "torch.nn.init"
        real = [g.get_state() for g in generators] if shadowed else []
        if shadowed:  # eager's draws, on copies: the generators stay where Lightning's empty_init leaves them
            for g, state in zip(generators, real):
                g.set_state(self._shadow.get(id(g), state))
        before = [g.get_state() for g in generators]
        checked = True
        run_args, run_kwargs, meta_run = self._operands(func, leaves, spec, tensors, kwargs)
        if meta_run and _name(func) not in _NO_DRAW:
            checked = self._advance_as_eager(func, leaves, spec, tensors, list(zip(generators, before)))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*run_args, **run_kwargs)
        after = [g.get_state() for g in generators]
        if shadowed:
            for g, state, moved in zip(generators, real, after):
                self._shadow[id(g)] = moved
                g.set_state(state)
        drew = [k for k, (b, a) in enumerate(zip(before, after)) if not torch.equal(b, a)]
        draws = None
        if drew:
            draws = _Draws([generators[k] for k in drew], [before[k] for k in drew], [after[k] for k in drew])
            self.draws.append(draws)
        self._note(f"{_name(func)}({', '.join(map(_describe, leaves))}) draws "
                   + (" ".join(str(b.numel()) for b in draws.before) if draws is not None else "none"))
        call = _Call(func, spec, recorded, draws, checked, torch.get_default_dtype(), _default_device())
        written: set[int] = set()
        for (i, t), version in zip(tensors, versions):
            root = self._root_of(t)
            wrote = _writes(func, i, leaves, kwargs) if version is None else _version(t) != version
            if wrote and root is not None and id(root) not in written:
                written.add(id(root))
                root.log.append(call)
        inputs = {_key(t) for _, t in tensors}
        outputs, _ = tree_flatten(out)
        for j, o in enumerate(outputs):
            key = _key(o) if isinstance(o, Tensor) else None
            if key is not None and key not in inputs and self._root_of(o) is None:
                device = o.device if not o.is_meta else self._device_of(tensors)
                if device.type == "meta":
                    continue  # made on the meta device by the model itself: no values to record
                self._bind(o, _Root(call, j, device, tuple(o.size()), tuple(o.stride()), o.storage_offset(),
                                    o.untyped_storage().nbytes() // o.element_size()))
        return self._wrapped(out)

    def _operands(self, func: Callable[..., Any], leaves: list[Any], spec: Any, tensors: list[tuple[int, Tensor]],
                  kwargs: dict) -> tuple[tuple, dict, bool]:
        """The arguments to run a call with, and whether it runs on meta tensors. A call mixing
        recorded meta tensors with real ones runs on the meta device (the real ones as meta
        tensors of their shape: the result is recorded), unless it writes into a real tensor: then
        on the meta tensors' values as eager construction has them, rebuilt now, so the real
        tensor gets eager's values."""
        metas = [i for i, t in tensors if t.is_meta and self._root_of(t) is not None]
        reals = [i for i, t in tensors if not t.is_meta]
        args, kwargs_ = tree_unflatten(leaves, spec)
        if not metas or not reals:
            return args, kwargs_, bool(metas) or any(t.is_meta for _, t in tensors)
        replaced = list(leaves)
        if any(_writes(func, i, leaves, kwargs) for i in reals):
            replayer = Replayer()
            try:
                for i in metas:
                    replaced[i] = replayer.current(self._reference(leaves[i]))  # type: ignore[arg-type]
            finally:
                replayer.close()
            self._note(f"values read into a real tensor by {_name(func)}")
            meta_run = False
        else:
            for i in reals:
                t = leaves[i]
                replaced[i] = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            meta_run = True
        args, kwargs_ = tree_unflatten(replaced, spec)
        return args, kwargs_, meta_run

    def _reference(self, t: Tensor) -> Union[_Ref, _Held, Tensor]:
        root = self._root_of(t)
        if root is not None:
            return _Ref(root, len(root.log), tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)
        if t.is_meta:
            return t  # a meta tensor of the model's own making: nothing to replay it from
        return _Held(t, _version(t))

    def _root_of(self, t: Tensor) -> Optional[_Root]:
        entry = self._roots.get(_key(t))  # type: ignore[arg-type]
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def _bind(self, t: Tensor, root: _Root) -> None:
        key = _key(t)
        if key is None:
            return
        self._roots[key] = (StorageWeakRef(t.untyped_storage()), root)
        self._made += 1
        if self._made % 4096 == 0:  # storages freed since: their keys may be reused by new ones
            self._roots = {k: v for k, v in self._roots.items() if not v[0].expired()}

    def _device_of(self, tensors: list[tuple[int, Tensor]]) -> torch.device:
        """Where eager construction would have had the result of a call on meta tensors: with the
        roots it read."""
        for _, t in tensors:
            root = self._root_of(t)
            if root is not None:
                return root.device
        return torch.device("meta")

    def _generators(self, tensors: list[tuple[int, Tensor]], kwargs: dict) -> list[torch.Generator]:
        """The generators a call may draw from: an explicit ``generator=``, the CPU's, and the
        default generator of each accelerator device among its tensors (meta ones at their root's
        device) and the default device."""
        generators: list[torch.Generator] = []
        explicit = kwargs.get("generator")
        if isinstance(explicit, torch.Generator):
            generators.append(explicit)
        devices = {t.device if not t.is_meta else self._device_of([(0, t)]) for _, t in tensors}
        return _with_device_generators(generators, devices | {_default_device()})

    def _advance_as_eager(self, func: Callable[..., Any], leaves: list[Any], spec: Any,
                          tensors: list[tuple[int, Tensor]], states: list[tuple[torch.Generator, Tensor]]) -> bool:
        """Run ``func`` once on real stand-ins of its meta tensors (views of one stand-in per storage,
        on the root's device; zeros, or halves if it refuses zeros), so that its random draws advance
        the generators as in eager construction. Returns whether it ran (if not, whether it draws is
        unknown: replay then checks that it does not). A call whose number of draws depends on the
        values (rejection sampling) draws otherwise at replay, which replay's check refuses."""
        for fill in (None, 0.5):  # zeros; a call that refuses them (a distribution of zeros) gets halves
            stand_ins: dict[int, Tensor] = {}
            replaced = list(leaves)
            for i, t in tensors:
                if not t.is_meta:
                    continue
                key = _key(t)
                if key not in stand_ins:
                    device = self._device_of([(0, t)])
                    device = torch.device("cpu") if device.type == "meta" else device
                    numel = t.untyped_storage().nbytes() // t.element_size()
                    stand_in = torch.zeros(numel, dtype=t.dtype, device=device)
                    stand_ins[key] = stand_in if fill is None else stand_in.fill_(fill)  # type: ignore[index]
                replaced[i] = stand_ins[key].as_strided(t.size(), t.stride(), t.storage_offset())  # type: ignore[index]
            args, kwargs = tree_unflatten(replaced, spec)
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    func(*args, **kwargs)
            except Exception:
                for generator, state in states:  # whatever it drew before it failed is not eager's
                    generator.set_state(state)
                continue
            return True
        return False

    def to_meta(self, param: Tensor) -> Tensor:
        """A meta tensor with ``param``'s geometry that stands for it from now on: calls on it are
        recorded against ``param``'s storage's root (made now from a copy of ``param``'s values if
        construction did not make that storage). The meta storage is as large as the real one, so
        views keep their offsets."""
        with self.paused():
            root = self._root_of(param)
            if root is None:
                base = torch.empty(0, dtype=param.dtype, device=param.device).set_(param.untyped_storage())
                root = _Root(base.clone(), 0, param.device, tuple(base.size()), tuple(base.stride()), 0, base.numel())
            numel = param.untyped_storage().nbytes() // param.element_size()
            meta = torch.empty(numel, dtype=param.dtype, device="meta")
            meta = meta.as_strided(param.size(), param.stride(), param.storage_offset())
            self._bind(meta, root)
        return meta

    def parameter(self, data: Tensor, requires_grad: bool) -> nn.Parameter:
        """A parameter on the meta tensor ``data`` (:meth:`to_meta`'s, or a view of a recorded
        parameter) whose calls are recorded until the engine materialises it."""
        with self.paused():
            param = _RecordedParameter(data, requires_grad)
        param._zinf_recorder = self
        return param

    def records(self, param: Tensor) -> bool:
        """Whether ``param`` (a meta tensor) stands for a storage this recorder can rebuild."""
        return param.is_meta and self._root_of(param) is not None

    # --- ranks ---------------------------------------------------------------------------------------
    def adopt_rank0_draws(self, broadcast: Callable[[Tensor], Tensor], all_equal: Callable[[int], bool]) -> bool:
        """Replace this rank's recorded generator states by rank 0's, so that replay draws rank 0's
        values on every rank. Collective.

        Args:
            broadcast: Broadcasts a CPU tensor from rank 0 in place (returns it).
            all_equal: Whether an int is the same on every rank.

        Returns:
            Whether the ranks recorded the same path: the same calls drew from the same generators
            in the same order, and every value that steered construction (``bool()`` of a tensor in
            an init's loop) was the same; if not, nothing is changed, and the caller must take rank
            0's values instead (replaying rank 0's draws along another rank's path would give
            that rank other values).
        """
        states = [s for d in self.draws for s in (*d.before, *d.after)]
        if not all_equal(self._path):
            return False
        if not states:
            return True
        flat = broadcast(torch.cat([s.reshape(-1).to(torch.uint8) for s in states]))
        start = 0
        for draws in self.draws:
            for kind in (draws.before, draws.after):
                for k, s in enumerate(kind):
                    kind[k] = flat[start:start + s.numel()].clone()
                    start += s.numel()
        return True


class Replayer:
    """Rebuilds the values of parameters a :class:`ConstructionRecorder` recorded, one at a time.

    Generator states are set before each recorded call that drew and checked after it; on
    :meth:`close` every generator it set is put back as it was, so training starts from the
    stream eager construction leaves. The last root rebuilt whole is kept, so the tiles of one
    layer (views of one recorded weight) rebuild it once.

    Attributes:
        read_outside: Whether the last :meth:`value_of` read tensors from outside construction
            (a pretrained tensor copied in, a parameter made from one): those may differ between
            ranks, where the recorded draws (rank 0's, :meth:`ConstructionRecorder.adopt_rank0_draws`)
            do not.
    """

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Generator, Tensor]] = {}
        self._last: Optional[tuple[_Root, Tensor, bool]] = None
        self._outside = False
        self.read_outside = False

    @staticmethod
    def can_rebuild(param: Tensor) -> bool:
        """Whether ``param`` is a meta tensor whose values a recorder can rebuild."""
        recorder = recorder_of(param)
        return recorder is not None and recorder.records(param)

    def value_of(self, param: Tensor, name: str) -> Tensor:
        """The value eager construction gives ``param`` (a meta tensor a recorder stands for):
        a new contiguous tensor of its shape and dtype, on the device eager construction used.

        Raises:
            NotReproducible: see the module docstring; names ``name``.
        """
        recorder = recorder_of(param)
        assert recorder is not None
        root = recorder._root_of(param)
        assert root is not None
        try:
            if self._last is None or self._last[0] is not root:
                self._last, self._outside = None, False
                value = self._build(root, len(root.log), {})
                self._last = (root, value, self._outside)
            _, base, self.read_outside = self._last
        except NotReproducible as error:
            raise NotReproducible(f"Parameter '{name}': {error}") from None
        if base.is_meta:
            raise NotReproducible(
                f"Parameter '{name}' was built from a meta tensor the model made itself (device='meta'), which holds "
                "no values to rebuild it from. Build that tensor on a real device, or give its module a "
                "`reset_parameters()`."
            )
        return base.as_strided(param.size(), param.stride(), param.storage_offset()).clone()

    def current(self, ref: _Ref) -> Tensor:
        """The values the tensor ``ref`` points at had at that point of construction (a view of its
        root rebuilt up to there)."""
        return self._resolve(ref, None, None, {})

    def close(self) -> None:
        """Put every generator a replay set back as it was before; forget the kept root."""
        for generator, state in self._saved.values():
            generator.set_state(state)
        self._saved = {}
        self._last = None

    def _build(self, root: _Root, position: int, memo: dict[tuple[int, int], Tensor]) -> Tensor:
        """A tensor on a new storage holding ``root`` after its first ``position`` writes, shaped
        as the tensor that created it."""
        key = (id(root), position)
        if key in memo:
            return memo[key]
        if isinstance(root.initial, Tensor):
            self._outside = True
            value = root.initial.clone()
        else:
            outputs, _ = tree_flatten(self._run(root.initial, root, None, memo))
            value = outputs[root.out]
            if not isinstance(value, Tensor):
                raise NotReproducible(f"the {root.initial.describe()} that made it gave no tensor when run again.")
            if (tuple(value.size()), tuple(value.stride()), value.storage_offset()) != (root.size, root.stride, root.offset):
                # Laid out otherwise than the meta kernel said: the same values in the recorded layout,
                # which the references' offsets and strides are relative to.
                laid = torch.empty(root.numel, dtype=value.dtype, device=value.device)
                value = laid.as_strided(root.size, root.stride, root.offset).copy_(value)
        for call in root.log[:position]:
            self._run(call, root, value, memo)
        memo[key] = value
        return value

    def _resolve(self, leaf: Any, live_root: Optional[_Root], live: Optional[Tensor],
                 memo: dict[tuple[int, int], Tensor]) -> Any:
        if isinstance(leaf, _Ref):
            base = live if leaf.root is live_root and live is not None else self._build(leaf.root, leaf.position, memo)
            if leaf.dtype != base.dtype:
                raise NotReproducible("construction reinterpreted a tensor as another dtype (`.view(dtype)`), which "
                                      "cannot be replayed.")
            if (leaf.size, leaf.stride, leaf.offset) == (tuple(base.size()), tuple(base.stride()), base.storage_offset()):
                return base
            return base.as_strided(leaf.size, leaf.stride, leaf.offset)
        if isinstance(leaf, _Held):
            if leaf.version is not None and _version(leaf.tensor) != leaf.version:
                raise NotReproducible(
                    f"it was built from a tensor made outside construction (shape {tuple(leaf.tensor.shape)}) that was "
                    "changed in place afterwards, so its values then are gone. Leave that tensor unchanged until the "
                    "strategy has set the model up, or copy it (`.clone()`) before building from it."
                )
            self._outside = True
            return leaf.tensor
        if isinstance(leaf, Tensor) and leaf.is_meta:
            return leaf
        return leaf

    def _run(self, call: _Call, live_root: Optional[_Root], live: Optional[Tensor],
             memo: dict[tuple[int, int], Tensor]) -> Any:
        leaves = [self._resolve(leaf, live_root, live, memo) for leaf in call.leaves]
        args, kwargs = tree_unflatten(leaves, call.spec)
        watched = list(call.draws.generators) if call.draws is not None else []
        watched += [g for g in _replay_generators(leaves, call) if all(g is not w for w in watched)]
        for generator in watched:
            self._saved.setdefault(id(generator), (generator, generator.get_state()))
        if call.draws is not None:
            for generator, state in zip(call.draws.generators, call.draws.before):
                generator.set_state(state)
        before = [g.get_state() for g in watched]
        previous = torch.get_default_dtype()
        torch.set_default_dtype(call.dtype)
        try:
            with torch.no_grad(), torch.device(call.device):
                out = call.func(*args, **kwargs)
        finally:
            torch.set_default_dtype(previous)
        expected = dict(zip(map(id, call.draws.generators), call.draws.after)) if call.draws is not None else {}
        for generator, state in zip(watched, before):
            want = expected.get(id(generator), state)
            if not torch.equal(generator.get_state(), want):
                raise NotReproducible(
                    f"the {call.describe()} drew random numbers differently when run again than during construction"
                    + ("" if call.checked else " (it failed on stand-in tensors there, so its draws could not be seen)")
                    + ". Build this module eagerly (outside `init_module`/`configure_model`), or give it a "
                    "`reset_parameters()` and build it on the meta device yourself."
                )
        return out


class _RecordingMode(TorchFunctionMode):
    """Reports every torch call to a recorder (construction's context)."""

    def __init__(self, recorder: ConstructionRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        return self.recorder.handle(func, args, kwargs or {})


def _report(func: Callable[..., Any], args: tuple, kwargs: Optional[dict]) -> Any:
    """A recorded tensor's ``__torch_function__``: the call goes to the recorder of its first
    recorded tensor argument."""
    kwargs = kwargs or {}
    leaves, _ = tree_flatten((args, kwargs))
    recorder = next((getattr(t, "_zinf_recorder", None) for t in leaves if isinstance(t, (_RecordedTensor, _RecordedParameter))), None)
    if recorder is None:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return recorder.handle(func, args, kwargs)


class _RecordedParameter(nn.Parameter):
    """A parameter moved to the meta device by construction's context: calls on it are recorded
    until the engine materialises it (it is then replaced by a plain ``nn.Parameter``)."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        return _report(func, args, kwargs)


class _RecordedTensor(Tensor):
    """A meta tensor derived from a recorded parameter (a view, a temporary of an init): calls on
    it are recorded too."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        return _report(func, args, kwargs)


def _asked_by_torch_init() -> bool:
    """Whether the code asking (the first frame outside this module and torch's dispatch) is torch.nn.init."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if module not in (__name__, "torch.overrides"):
            return module == "torch.nn.init"
        frame = frame.f_back
    return False


def _version(t: Tensor) -> Optional[int]:
    """``t``'s version counter (bumped by every in-place write), or ``None`` for an inference tensor
    (built under ``torch.inference_mode()``), which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                                 "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _writes(func: Callable[..., Any], index: int, leaves: list[Any], kwargs: dict) -> bool:
    """Whether the call writes the tensor at flat position ``index`` of its arguments, by torch's
    naming (for tensors without a version counter): an in-place method or ``torch.nn.init``
    function (``name_``) or operator writes its first argument, and ``out=`` its output."""
    name = _name(func)
    first = next((i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)), None)
    if index == first and (name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))):
        return True
    out = kwargs.get("out")
    return out is not None and any(leaves[index] is t for t in tree_flatten(out)[0])


def _describe(leaf: Any) -> str:
    """An argument of a recorded call as every rank would write it (tensors by shape and dtype,
    devices by type, objects whose ``repr`` holds an address by their type)."""
    if isinstance(leaf, Tensor):
        return f"tensor{tuple(leaf.shape)}:{leaf.dtype}"
    if isinstance(leaf, torch.device):
        return leaf.type  # each rank has its own device index
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, torch.dtype, torch.device, slice, type(...))):
        return repr(leaf)
    return type(leaf).__name__


def _is_data_setter(func: Callable[..., Any]) -> bool:
    return _name(func) == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data"


def _is_meta_property(func: Callable[..., Any]) -> bool:
    return _name(func) == "__get__" and getattr(getattr(func, "__self__", None), "__name__", None) == "is_meta"


def _default_device() -> torch.device:
    return torch.get_default_device()


def _device_generator(device: torch.device) -> Optional[torch.Generator]:
    """The default generator of an accelerator device (CUDA and alike), if its module has one."""
    try:
        module = torch.get_device_module(device)
        generators = getattr(module, "default_generators", None)
        if not generators:
            return None
        index = device.index if device.index is not None else module.current_device()
        return generators[index]
    except (AttributeError, RuntimeError, IndexError):
        return None


def _with_device_generators(generators: list[torch.Generator], devices: set[torch.device]) -> list[torch.Generator]:
    """``generators``, then the CPU's and the default generator of each accelerator in ``devices``
    (those not listed yet)."""
    generators = generators + [torch.default_generator]
    for device in devices:
        if device.type not in ("cpu", "meta"):
            generator = _device_generator(device)
            if generator is not None and all(generator is not g for g in generators):
                generators.append(generator)
    return generators


def _replay_generators(leaves: list[Any], call: _Call) -> list[torch.Generator]:
    """The generators a replayed call may draw from (checked unchanged unless it drew when recorded)."""
    return _with_device_generators([], {leaf.device for leaf in leaves if isinstance(leaf, Tensor)} | {call.device})
