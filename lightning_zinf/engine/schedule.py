"""The schedule: the hooks that decide *when* each unit is gathered, prefetched and released.

Forward: a module's pre-hook asks for its units (:meth:`Schedule._acquire`: the trace says which
units come next, and the next released ones within the bucket budget are gathered ahead, NVMe
shards read further ahead); its post-hook releases them and hooks the gradients of its outputs.
Backward: that output hook re-gathers the units before the module's backward runs and holds them;
a unit is released in backward (:meth:`~lightning_zinf.engine.units.UnitStates.release_after_backward`)
once the gradients of every trainable group of it are complete (:meth:`Schedule._on_grad`, a
post-accumulate hook per parameter, which then has the group reduce-scattered) and, for frozen
parameters, once the identity node threaded through the module's inputs has run
(:class:`_PostBackward`, FSDP2's post-backward signal). A callback at the end of backward flushes
partial groups, agrees on which parameters got a gradient and releases what is still held.

The method is ZeRO-3's (Rajbhandari et al., SC'20, §5.3) with ZeRO-Infinity's trace-based prefetch
(Rajbhandari et al., SC'21, §6.2); the unit transitions themselves are
:class:`~lightning_zinf.engine.units.UnitStates`'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import weakref
from typing import Any, Callable, Hashable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_zinf.comm import Collectives
from lightning_zinf.config import MixedPrecisionConfig, PrefetchConfig
from lightning_zinf.engine.buffers import BufferPool
from lightning_zinf.engine.negotiation import BACKWARD_END
from lightning_zinf.engine.trace import Tracer, Upcoming
from lightning_zinf.engine.units import RELEASED, Unit, UnitStates, in_backward
from lightning_zinf.offload.params import ParamOffload

__all__ = ["Schedule"]

#: Decorates the hooks so that a compiled module runs them as ordinary Python calls: Dynamo would
#: otherwise trace them, break its graph at their collectives and storage pointers, and recompile
#: them as the engine's state changes from call to call (FSDP2 disables its hooks the same way).
#: Recursive: nothing they call is traced either.
_eager = torch.compiler.disable(
    recursive=True,
    **({"reason": "lightning_zinf's hooks gather, release and reduce eagerly"}
       if "reason" in inspect.signature(torch.compiler.disable).parameters else {}),
)


@_eager
def _call_weakly(method: weakref.WeakMethod, *args: Any) -> None:
    """Call ``method`` if its schedule is alive. Python's garbage collector does not look inside a
    parameter's gradient hooks: one that held the schedule, or a unit or group (which hold the
    parameter), would keep the units, the model and every shard (and, through the root pre-hook,
    the engine) alive for the rest of the process."""
    bound = method()
    if bound is not None:
        bound(*args)


class Schedule:
    """Installs the forward, backward and gradient hooks on ``module`` and drives ``states`` from them.

    Args:
        module: The partitioned model.
        units: The engine's units, by index.
        uses: For each module whose forward needs units gathered, those units (its own, a block's,
            registered external parameters').
        states: The unit state machine the hooks drive.
        tracer: The trace of unit gathers, which says what comes next.
        comm: The engine's collectives (the end of backward's agreement on received gradients).
        pool: Gradient buffers, prepared before a unit's backward and trimmed after backward.
        prefetch: Bucket budget of units gathered ahead.
        mixed_precision: Whether and how forward inputs are cast.
        param_offload: NVMe parameter offload, or None (its shards are read ahead of gathers).
        read_ahead: How many upcoming units' NVMe shards are read ahead.
        copy_ahead: Most bytes of host-tier shards copied to the device ahead of their gathers
            (``0``: none; :meth:`_copy_ahead`).
        hold_for_backward: ``sharding="grad_op"`` (ZeRO-2): a unit gathered by a forward that
            records a graph stays gathered until its backward is done with it, instead of being
            released after the forward and gathered again for backward.
        begin_pass: Called with ``(training, grad enabled)`` at every forward of ``module`` itself,
            or None (the driver calls it).
        meet: Meets the other ranks at a waypoint (the end of backward), sending a payload:
            :meth:`RankAgreement.waypoint_with <lightning_zinf.engine.agreement.RankAgreement.waypoint_with>`.

    Attributes:
        handles: The hook handles installed (removed by :meth:`remove`).
        outputs_views: Some module's forward returned a view of a parameter (which the post-hook
            hands out as a copy): passes of this model keep their hooks (:meth:`bypass`).
    """

    def __init__(self, module: nn.Module, units: list[Unit], uses: dict[nn.Module, list[Unit]], *,
                 states: UnitStates, tracer: Tracer, comm: Collectives, pool: BufferPool, prefetch: PrefetchConfig,
                 mixed_precision: MixedPrecisionConfig, param_offload: Optional[ParamOffload], read_ahead: int,
                 begin_pass: Optional[Callable[[Hashable], None]],
                 meet: Callable[[int, Sequence[int]], tuple[bool, Optional[list[tuple[int, ...]]]]],
                 copy_ahead: int = 0, hold_for_backward: bool = False) -> None:
        self.units = units
        self.groups = [g for u in units for g in u.groups]
        self.states = states
        self.tracer = tracer
        self.comm = comm
        self.pool = pool
        self.bucket_size = prefetch.bucket_size
        tracer.sizes = [0 if unit.persistent else unit.numel for unit in units]
        # A unit kept gathered between passes (keep_gathered) is gathered by no pass: it takes no
        # room in the prefetch bucket that reuse is weighed against.
        states.kept_changed = lambda unit: tracer.resize(unit.index, 0 if unit.kept or unit.persistent else unit.numel)
        self.mixed_precision = mixed_precision
        self.param_offload = param_offload
        self.read_ahead = read_ahead
        self.copy_ahead = copy_ahead
        self.hold_for_backward = hold_for_backward
        self._begin_pass = begin_pass
        self._meet = meet
        self._uses = uses
        # Per module, its forward calls in progress: each one's frozen use and the units it holds for backward.
        self._calls: dict[nn.Module, list[tuple[Optional[_Use], list[Unit]]]] = {}
        # Modules inside automatically grouped units (guard), and per module whether each of its
        # calls in progress gathered the unit itself.
        self._guards: dict[nn.Module, list[Unit]] = {}
        self._guarding: dict[nn.Module, list[bool]] = {}
        self._backward_end_queued = False
        # Called once when a backward starts (the engine reads the next optimizer step's first
        # state ahead: OptimizerSteps.prepare_step).
        self.on_backward_start: Optional[Callable[[], None]] = None
        self._outer: Optional[_OuterForwards] = None  # a generation phase's passes, one per outermost forward
        self._watched: set[int] = set()  # ids of the parameters that have a gradient hook
        # The forward hook pairs on modules (module, pre-hook id, post-hook id), and while they are
        # bypassed, what bypass() took out of the modules' hook dicts.
        self._pairs: list[tuple[nn.Module, int, int]] = []
        self._bypassed: list[tuple[dict, list, dict]] = []
        # A module's output was a view of a parameter (copied by _leave): its passes keep the hooks.
        self.outputs_views = False
        self.handles = self._install(module)
        for unit in units:
            self.watch_gradients(unit)

    def _install(self, module: nn.Module) -> list[Any]:
        handles: list[Any] = []
        if self._begin_pass is not None:
            handles.append(module.register_forward_pre_hook(self._root_pre_forward))
        for user in self._uses:
            handles.extend(self._hook_module(user))
        return handles

    def watch_gradients(self, unit: Unit) -> None:
        """Hook every parameter of ``unit`` that requires a gradient and has no hook yet, so that its
        group is reduce-scattered once its gradients are accumulated (at construction, and for
        parameters unfrozen later). A hook stays when its parameter is frozen again: autograd
        simply does not call it."""
        on_grad = weakref.WeakMethod(self._on_grad)
        for position, group in enumerate(unit.groups):
            for index, p in enumerate(group.params):
                if p.requires_grad and id(p) not in self._watched:
                    hook = functools.partial(_call_weakly, on_grad, unit.index, position, index)
                    self.handles.append(p.register_post_accumulate_grad_hook(hook))
                    self._watched.add(id(p))

    def _hook_module(self, module: nn.Module) -> list[Any]:
        # always_call: checkpointing stops a recomputation by raising inside a module's forward;
        # the post-hook must still end that use of the unit.
        return self._forward_pair(module, self._pre_forward, self._post_forward)

    def _forward_pair(self, module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, always_call=True)]
        self._pairs.append((module, handles[0].id, handles[1].id))
        return handles

    def guard(self, module: nn.Module, unit: Unit) -> None:
        """Gather ``unit`` for ``module`` (a module inside a unit grouped automatically, whose
        parameters are the unit's) when it runs while nothing else uses the unit: called without
        the forward of the module that gathers it (an encoder called by ``generate()`` without
        its model's forward, a layer shared with another part of the model). Inside that forward,
        the usual case, the hook only checks the unit's depth."""
        self._guards[module] = [unit]
        self.handles.extend(self._forward_pair(module, self._guard_pre_forward, self._guard_post_forward))

    def add_use(self, module: nn.Module, unit: Unit) -> None:
        """Gather ``unit`` whenever ``module`` runs (hooking ``module`` if it was not yet)."""
        uses = self._uses.setdefault(module, [])
        if not uses:
            self.handles.extend(self._hook_module(module))
        if unit not in uses:
            uses.append(unit)

    def pass_per_outer_forward(self, module: nn.Module, begin_pass: Callable[[str], None]) -> Callable[[], None]:
        """Until the returned function is called: every outermost forward of a submodule of
        ``module`` (``module`` included), i.e. one that runs while no other forward of it is in
        progress, first calls ``begin_pass`` with that submodule's qualified name (``""`` for
        ``module``); the pass at every forward of the root (``begin_pass`` of the constructor) is
        off meanwhile. The generalisation of that root pass for a generation phase: one decode step
        of ``generate()``, a reward model's forward and a reference forward each start a pass of
        their own, so each replays one stable trace (ZeRO-Infinity §6.2's trace, kept across the
        steps of RLHF generation, as DeepSpeed-Chat's hybrid engine keeps its inference mode).

        A submodule with no parameter below it gathers nothing: it starts no pass, and its
        outermost forward's gathers start the passes of the submodules that make them. The modules
        the schedule hooks already count through those hooks (one hook pair per module call). The
        hooks exist only until then: forwards outside the phase (a compiled training forward
        among them) run without them.

        Returns:
            The function that removes the hooks (and turns the root pass back on).
        """
        outer = _OuterForwards(begin_pass)
        handles = []
        for name, sub in module.named_modules():
            if sub in self._uses or sub in self._guards:
                # Counted by the schedule's own hooks (a decode step runs one hook pair per module,
                # not two), which call the pair first and last.
                outer.names[sub] = name
            elif next(sub.parameters(), None) is not None:
                # Prepended: the pass must start before this module's own pre-hook gathers its units.
                handles.append(sub.register_forward_pre_hook(functools.partial(outer.enter, name), prepend=True))
                handles.append(sub.register_forward_hook(outer.leave, always_call=True))
            # A module with no parameter below it gathers nothing by itself: the first module that
            # gathers starts the pass where it is called outermost.
        self._outer = outer

        def remove() -> None:
            for handle in handles:
                handle.remove()
            self._outer = None

        return remove

    def bypass(self) -> None:
        """Take the forward hooks of the modules out until :meth:`restore`, so that forward passes
        run as the unpartitioned model's (torch's call path without hooks): for a pass in which
        every unit stays gathered and nothing needs them (the driver's decision:
        :meth:`ZeroEngine.begin_pass <lightning_zinf.ZeroEngine.begin_pass>`). Call between
        forwards only: a module whose forward is in progress would miss its post-hook. The
        parameters' gradient hooks stay."""
        if self._bypassed:
            return
        for module, pre, post in self._pairs:
            for hooks, key in ((module._forward_pre_hooks, pre), (module._forward_hooks, post)):
                if key in hooks:
                    self._bypassed.append((hooks, list(hooks), {key: hooks.pop(key)}))

    def restore(self) -> None:
        """Put back the hooks :meth:`bypass` took out, each where it was among the module's hooks
        (hooks registered meanwhile come after them, or first where they were prepended)."""
        for hooks, order, taken in reversed(self._bypassed):
            rest = dict(hooks)
            known = set(order)
            # Hooks ahead of every older one were prepended (none can tell where there is no older one).
            first = next((i for i, key in enumerate(rest) if key in known), 0)
            prepended = {key: rest.pop(key) for key in list(rest)[:first]}
            hooks.clear()
            hooks.update(prepended)
            for key in order:
                if key in taken:
                    hooks[key] = taken[key]
                elif key in rest:
                    hooks[key] = rest.pop(key)
            hooks.update(rest)
        self._bypassed = []

    @property
    def starts_passes(self) -> bool:
        """Whether a pre-hook on the root module begins a pass at each of its forwards (the
        engine's ``auto_pass``)."""
        return self._begin_pass is not None

    def reset(self) -> None:
        """At a pass boundary: forget forward calls and a backward-end callback that died with a
        forward or backward that raised."""
        self._backward_end_queued = False
        self._calls.clear()
        self._guarding.clear()

    def remove(self) -> None:
        """Remove every hook this schedule installed."""
        self.restore()
        for handle in self.handles:
            handle.remove()
        self.handles, self._pairs = [], []
        self._watched.clear()

    # --- when to gather ---------------------------------------------------------------------------
    def _acquire(self, unit: Unit, forward: bool = False) -> None:
        """Have ``unit`` gathered for use now (``forward``, or its re-gather in backward): tell the
        trace, start its gather if it is released, prefetch the next units of the trace and read
        the NVMe shards of the next ones ahead, then wait for it.

        A forward use after which the trace uses the unit again soon marks it :attr:`Unit.reuse`:
        after this use it stays gathered, counted as gathered ahead, instead of being released and
        gathered again: when it is the next unit used (the last unit of a forward, first in its
        backward; a module called twice in a row), or when prefetch would gather it again before
        that next use anyway (:meth:`Tracer.reuse_cost
        <lightning_zinf.engine.trace.Tracer.reuse_cost>` within ``bucket_size``), so the memory
        bound stays the one prefetch keeps. DeepSpeed's ``stage3_max_reuse_distance``, bounded
        here by the prefetch bucket."""
        upcoming = self.tracer.request(unit.index)
        if unit.run:  # its next members' requests: it stays gathered for them (_post_forward)
            upcoming = upcoming.after_run(unit.index)
        if forward and not unit.persistent:
            cost = self.tracer.reuse_cost()
            unit.reuse = cost is not None and cost <= self.bucket_size
        self.states.claim(unit)
        if unit.state == RELEASED:
            self.states.start_gather(unit)
        if upcoming:
            self._gather_ahead(unit, upcoming)
            if self.copy_ahead:
                self._copy_ahead(unit, upcoming)
            if self.param_offload is not None:
                released = (self.units[i] for i in upcoming if self.units[i].state == RELEASED)
                ahead = list(itertools.islice(released, self.read_ahead))  # not a walk of the whole trace
                self.param_offload.read_ahead(g for u in ahead for g in u.groups
                                              if g.secondary is None and g.qwz_row is None and g.codes is None)
        self.states.wait_gather(unit)

    def _gather_ahead(self, current: Unit, upcoming: Upcoming) -> None:
        """Start gathering the next released units of the trace, within the bucket budget; the
        first one always (a unit larger than the budget would otherwise never be prefetched).

        With shards copied ahead, gathers follow the order of use: when ``current`` (the unit being
        acquired) is used again next, released in between (the last unit of forward, first in
        backward), the units after it are not gathered before it, since their gathers would
        queue in front of its gather on the copy stream (and the compute waiting for it)."""
        if not self.states.any_released():
            return  # not a walk over the rest of the trace at every module call of a model kept whole
        budget = self.bucket_size - self.states.ahead_numel()
        for index in upcoming:
            unit = self.units[index]
            if self.copy_ahead and unit is current and not (unit.persistent or unit.kept or unit.held or unit.reuse):
                break
            if unit.state != RELEASED or self.states.is_ahead(unit):
                continue
            if unit.numel > budget and self.states.any_ahead():
                break
            self.states.prefetch(unit)
            budget -= unit.numel

    def _copy_ahead(self, current: Unit, upcoming: Upcoming) -> None:
        """Copy the host-tier shards of the next released units of the trace to the device, as
        many units as fit ``copy_ahead`` bytes together with those copied ahead already, in trace
        order (a unit that does not fit stops it: the link's queue stays in the order of use).
        The gathers of these units, issued later by :meth:`_gather_ahead` or on demand, read the
        copies: the link then works up to ``copy_ahead`` bytes ahead of the compute stream,
        where the gather buffers (whole units) stay within the bucket budget.

        ``current``, the unit being acquired, counts as released at its next use in the trace
        (the last unit of forward, used again first in backward): it is released after this use
        unless it is persistent, kept or held for backward, so its copy for that use can start
        now instead of when backward asks for it."""
        copies = self.states.copies
        budget = self.copy_ahead - copies.ahead_bytes
        seen: set[int] = set()
        for index in upcoming:
            if index in seen:
                # A second use of a unit gathered (or copied) for its first: the copy for this one
                # can only be made later, and copying the units after it now would put them
                # ahead of it in the link's queue.
                break
            seen.add(index)
            unit = self.units[index]
            if self.states.step_pending(unit):
                break  # an offloaded step in the background has yet to rewrite its shards
            again = unit is current and not (unit.persistent or unit.kept or unit.held or unit.reuse)
            if (unit.state != RELEASED and not again) or copies.copied(unit.groups):
                continue
            nbytes = copies.nbytes_to_copy(unit.groups)
            if nbytes == 0 or nbytes > budget:
                # A released unit with nothing to copy reads device memory (hpZ): so do the next.
                break
            copies.copy_ahead(unit.groups)
            budget -= nbytes

    # --- forward ----------------------------------------------------------------------------------
    @_eager
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._outer is None:  # else the generation phase starts the passes
            self._begin_pass((module.training, torch.is_grad_enabled()))

    @_eager
    def _guard_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if self._outer is not None:
            self._outer.enter_hooked(module)
        units = self._guards[module]
        alone = units[0].forward_depth == 0
        self._guarding.setdefault(module, []).append(alone)
        return self._enter(module, units, args, kwargs) if alone else None

    @_eager
    def _guard_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        try:
            calls = self._guarding.get(module)
            if calls and calls.pop():
                return self._leave(module, self._guards[module], output)
            return None
        finally:
            if self._outer is not None:
                self._outer.leave_hooked(module)

    @_eager
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if self._outer is not None:
            self._outer.enter_hooked(module)
        return self._enter(module, self._uses[module], args, kwargs)

    def _enter(self, module: nn.Module, units: list[Unit], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward call of ``module`` that uses ``units`` starts: acquire them (and mark them for
        backward); the arguments, cast and threaded through the post-backward node as needed."""
        recompute = torch.is_grad_enabled() and in_backward()
        # ZeRO-2 (grad_op): a forward that records a graph keeps its units for their backward.
        hold = recompute or (self.hold_for_backward and torch.is_grad_enabled())
        # Held by this call alone (not by a recompute, an enclosing forward or an earlier use):
        # let go again after it if no graph goes through its outputs.
        fresh = [u for u in units if not u.held] if hold and not recompute else []
        for unit in units:
            unit.forward_depth += 1
            if hold:
                # Recomputed by activation checkpointing for the backward that follows, or gathered
                # under grad_op: held until that backward has run (set before acquiring it, so that
                # prefetch and copies ahead see that its next use in the trace needs no new gather).
                unit.held = True
            self._acquire(unit, forward=True)
        policy = self.mixed_precision
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            cast = functools.partial(_cast_floating, dtype=policy.param_dtype)
            args, kwargs = _map_tensors(args, cast), _map_tensors(kwargs, cast)
        # Frozen parameters get no gradient hook that says when autograd is done with them: thread
        # the inputs through an identity node whose backward runs right after this call's backward
        # (FSDP2's post-backward signal; a hook on the inputs' gradients would wait for every other
        # module that reads the same inputs, such as the sibling tiles of a layer). Not in a
        # recomputation: the original forward's node is the one its backward runs.
        use = None
        frozen = [u for u in units if u.has_frozen]
        if frozen and torch.is_grad_enabled() and not recompute:
            inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
            if inputs:
                use = _Use(frozen)
                signalled = iter(_PostBackward.apply(functools.partial(self._post_backward, use), *inputs))
                swap = lambda t: next(signalled) if t.requires_grad else t  # noqa: E731  (_tensors_in's order)
                args, kwargs = _map_tensors(args, swap), _map_tensors(kwargs, swap)
        self._calls.setdefault(module, []).append((use, fresh))
        return args, kwargs

    @_eager
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        try:
            if not self._calls.get(module):
                return None  # a call that began while the hooks were bypassed (restored during it)
            return self._leave(module, self._uses[module], output)
        finally:
            if self._outer is not None:
                self._outer.leave_hooked(module)

    def _leave(self, module: nn.Module, units: list[Unit], output: Any) -> Any:
        """The forward call of ``module`` that :meth:`_enter` began ends: hook its outputs'
        backward, release the units nothing else holds; the output (a copy where it is a view of a
        released parameter)."""
        use, fresh = self._calls[module].pop()
        for unit in units:
            unit.forward_depth -= 1
        tensors = list(_tensors_in(output))
        released = {g.active.untyped_storage().data_ptr() for u in units if not u.persistent for g in u.groups}
        if any(t.untyped_storage().data_ptr() in released for t in tensors):
            # An output that is a view of a parameter (learned queries) would point into storage
            # the release below frees: hand out a copy instead. (Not a pass without these hooks.)
            self.outputs_views = True
            output = _map_tensors(output, lambda t: t.clone() if t.untyped_storage().data_ptr() in released else t)
            tensors = list(_tensors_in(output))
        # Also in a recomputation: reentrant checkpointing runs backward over the recomputed graph.
        if torch.is_grad_enabled():
            outputs = [t for t in tensors if t.requires_grad]
            if outputs:
                hook = functools.partial(self._pre_backward, units, use)
                torch.autograd.graph.register_multi_grad_hook(outputs, hook, mode="any")
            else:
                # No backward comes for this call (a frozen teacher's forward with gradients on):
                # grad_op's hold would keep the units gathered until the next pass.
                for unit in fresh:
                    unit.held = False
        for unit in units:
            # A run of siblings grouped into one unit (grouping.py) whose next member runs next:
            # released after that one instead of gathered again for it.
            if unit.run and self.tracer.requested_next(unit.index):
                continue
            if unit.reuse and unit.forward_depth == 0:
                unit.reuse = False  # used again soon (_acquire): kept as if gathered ahead
                self.states.keep_ahead(unit)
                continue
            self.states.maybe_release(unit)
        return output

    # --- backward ---------------------------------------------------------------------------------
    @_eager
    def _pre_backward(self, units: list[Unit], use: Optional[_Use], grad: Any) -> None:
        self._queue_backward_end()
        if use is not None and not use.counted:
            # Counted only now: a forward whose graph is never run backward leaves no count behind.
            use.counted = True
            for unit in use.units:
                unit.pending_backward += 1
        for unit in units:
            unit.held = True
            self._acquire(unit)
            for group in unit.groups:
                if group.trainable:
                    group.prepare_grads(self.pool)

    @_eager
    def _post_backward(self, use: _Use) -> None:
        """Autograd has run the backward of one forward use (the identity node on the module's
        inputs has their gradients)."""
        if not use.counted:
            return
        use.counted = False
        for unit in use.units:
            unit.pending_backward -= 1
            self.states.release_after_backward(unit)

    # Not decorated with _eager: its only caller, _call_weakly, is, and the decorator's two frame
    # evaluation switches cost more than the rest of this hook (once per parameter per backward).
    def _on_grad(self, unit_index: int, position: int, index: int, param: Tensor) -> None:
        """A parameter's gradient has been accumulated (its post-accumulate hook): once its flat
        group's gradients are all there, release the unit if nothing else holds it and
        reduce-scatter the group."""
        unit = self.units[unit_index]
        group = unit.groups[position]
        self._queue_backward_end()
        if not group.mark_ready(index):
            return
        unit.reduced_groups += 1
        # Released before the reduce-scatter takes its buffers (FSDP2's order): the gradients are
        # in their own tensors, so the gathered weights are not needed for it.
        self.states.release_after_backward(unit)
        self.states.reduce(group)

    def _queue_backward_end(self) -> None:
        if not self._backward_end_queued:
            self._backward_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            if self.on_backward_start is not None:
                self.on_backward_start()

    @_eager
    def _backward_end(self) -> None:
        """Flush partially complete gradients, finish the reduce-scatters, release held units."""
        self._backward_end_queued = False
        for group in self.groups:
            if group.trainable and group.any_ready:
                self.states.reduce(group)
            elif group.grads_prepared:
                group.discard_grads(self.pool)
        self.states.drain_reduces()
        # Ranks that ran different modules meet here (serving each other's reduce-scatters), so the
        # gradients every rank exposes are complete. When every rank follows its script, the
        # meeting also tells whether every rank's parameters received the same gradients; then it
        # served nothing, so this rank's flags are final already (the choice below must be the
        # same on every rank: it decides whether the flags' all-reduce runs).
        received = self._received()
        _, rows = self._meet(BACKWARD_END, [_flags_digest(received)])
        self.states.drain_reduces()
        self.states.finish_host_grads()
        self.pool.release_free()
        self._expose_grads(received if rows is not None and len(set(rows)) == 1 else None)
        for unit in self.units:
            unit.pending_backward = 0  # uses whose inputs' gradients were never needed
            if unit.held:
                unit.held, unit.reduced_groups = False, 0
                self.states.maybe_release(unit)

    def _received(self) -> list[bool]:
        """Per trainable parameter, group by group: whether it received a gradient on this rank."""
        return [r for g in self.groups if g.trainable for r in g.received]

    def _expose_grads(self, agreed: Optional[list[bool]]) -> None:
        """Hand the optimizer gradients for the parameters that received one on some rank:
        ``agreed`` when the ranks already know that (the same flags on every rank), else agreed
        here (one host-side all-reduce of one flag per trainable parameter)."""
        trainable = [g for g in self.groups if g.trainable]
        flags = agreed if agreed is not None else self.comm.any_rank(self._received())
        start = 0
        for group in trainable:
            group.expose_grads(flags[start : start + len(group.params)])
            start += len(group.params)


def _flags_digest(flags: list[bool]) -> int:
    """A 64-bit digest of a list of flags (signed, as the control plane sends it): the ranks whose
    digests match have the same flags but for a chance of 2**-64."""
    return int.from_bytes(hashlib.blake2b(bytes(flags), digest_size=8).digest(), "little", signed=True)


class _OuterForwards:
    """The forward-hook pair of :meth:`Schedule.pass_per_outer_forward`: counts the forwards of
    the model's modules in progress and starts a pass when one begins with none in progress."""

    def __init__(self, begin_pass: Callable[[str], None]) -> None:
        self.begin_pass = begin_pass
        self.depth = 0
        # The modules the schedule hooks itself, by qualified name: their hooks call the pair below.
        self.names: dict[nn.Module, str] = {}
        # Per hooked module, its calls in progress that entered (kept per module: a user's pre-hook
        # that raises before the schedule's skips the entry, not the always-called post-hook).
        self._entered: dict[nn.Module, int] = {}

    def enter_hooked(self, module: nn.Module) -> None:
        """:meth:`enter` from the schedule's pre-hook of ``module`` (nothing for a module outside the phase's)."""
        name = self.names.get(module)
        if name is not None:
            self._entered[module] = self._entered.get(module, 0) + 1
            self.enter(name, module, ())

    def leave_hooked(self, module: nn.Module) -> None:
        """:meth:`leave` from the schedule's post-hook, for a call :meth:`enter_hooked` entered."""
        if self._entered.get(module):
            self._entered[module] -= 1
            self.leave(module, (), None)

    @_eager
    def enter(self, name: str, module: nn.Module, args: Any) -> None:
        self.depth += 1  # first: leave() runs even when a pre-hook raises (always_call)
        if self.depth == 1:
            self.begin_pass(name)

    @_eager
    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1


class _Use:
    """One forward call of a module whose units hold frozen parameters: counted in their
    ``pending_backward`` when its backward starts, uncounted when its identity node runs."""

    __slots__ = ("units", "counted")

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.counted = False


class _PostBackward(torch.autograd.Function):
    """Identity on the input tensors of a module whose unit holds frozen parameters; its backward
    runs ``callback`` once autograd has the gradients of those inputs, i.e. once this call of the
    module has run backward (FSDP2's ``RegisterPostBackwardFunction`` plays the same part). As
    there, the module receives views, so it must not modify its inputs in place."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _cast_floating(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor in a module output: nested tuples, lists, mappings (Hugging Face ModelOutput
    included) and dataclasses."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name))


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor ``t`` found by :func:`_tensors_in` replaced by ``fn(t)``."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: _map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init})
    return obj
