"""Activations under a memory budget: which blocks keep theirs for backward, which keep them in
host memory, and which are checkpointed.

With an example input the choice is the plan's, made at setup (:attr:`MemoryPlan.kept_blocks
<lightning_zinf.planning.MemoryPlan.kept_blocks>`, ``offloaded_blocks``): the first blocks keep
their activations, the next ones run inside the engine's activation offload (their saved tensors
wait in host memory, ZeRO-Infinity §5.1.2), the rest are checkpointed. Without one it is made from
the first training step, as follows (keeping or checkpointing only).

What autograd keeps depends on the batch, which setup does not see, so the state is placed first
(:mod:`lightning_zinf.planning.planner`) and the activations are planned with what the first
training step measures. During that step every block (an instance of ``block_classes``) runs under
non-reentrant activation checkpointing (Chen et al., 2016; ZeRO-Infinity §5.1.2) but the first of
each class, whose saved tensors are counted; so are the tensors saved outside the blocks and the
inputs each checkpointed block keeps. Counting uses saved-tensor hooks, by storage, and leaves out
parameters and views of gathered parameter buffers (the re-gather restores those; they are in the
ledger). At the start of the next training pass the plan keeps the activations of as many blocks
as the budget has room for, in forward order, and checkpoints the rest:

    budget >= planned peak + saved outside the blocks + activations of the kept blocks
              + inputs of the checkpointed blocks + those of one checkpointed block (its recompute)

Every rank takes the smallest count any rank found (the gathers of backward follow it). When
even every block checkpointed does not fit, a warning gives the bytes over. DeepSpeed's DeepCompile
plans activations against a budget inside ``torch.compile`` on CUDA; FSDP2 and DeepSpeed's ZeRO
leave checkpointing to the user.
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_zinf.comm import Collectives
from lightning_zinf.planning.sizes import format_bytes

__all__ = ["ActivationPlan", "tensors_in"]

log = logging.getLogger(__name__)


class _Count:
    """Bytes of the storages saved for backward, each once, but parameters and gathered buffers."""

    def __init__(self, is_gathered: Callable[[Tensor], bool]) -> None:
        self.is_gathered = is_gathered
        self.seen: set[int] = set()
        self.nbytes = 0

    def add(self, tensor: Tensor) -> None:
        if isinstance(tensor, nn.Parameter) or tensor.layout != torch.strided or self.is_gathered(tensor):
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.nbytes += storage.nbytes()

    def add_as(self, tensor: Tensor, itemsize: int) -> None:
        """Count a tensor of ``tensor``'s elements of ``itemsize`` bytes each (what a computation
        on it outside the scope saves), unless its storage was counted."""
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.nbytes += tensor.numel() * itemsize

    def pack(self, tensor: Tensor) -> Tensor:
        self.add(tensor)
        return tensor

    @staticmethod
    def unpack(tensor: Tensor) -> Tensor:
        return tensor


class ActivationPlan:
    """Per-block activation checkpointing for ``memory_budget``, decided after the first training step.

    The driver runs each training forward inside :meth:`scope` (the Trainer's strategy around
    ``training_step``; Fabric's through :meth:`scope_every_forward`) and calls
    :meth:`at_training_pass` at the start of each training pass (the engine's ``begin_pass``).

    Args:
        blocks: ``(qualified name, module)`` of the blocks in forward (module) order.
        budget: The per-rank budget in bytes.
        planned: The placement's predicted peak in bytes (the ledger's, activations excluded).
        is_gathered: Whether a tensor is a view of a gathered parameter buffer (the engine's).
        kept: Blocks (the first ones) that keep their activations, chosen at setup from the example
            input (:attr:`MemoryPlan.kept_blocks <lightning_zinf.planning.MemoryPlan.kept_blocks>`):
            decided at once, nothing measured. ``None``: decided after the first training step.
        offloaded: With ``kept``: blocks after the kept ones whose saved tensors wait in host memory
            between forward and backward (:attr:`MemoryPlan.offloaded_blocks
            <lightning_zinf.planning.MemoryPlan.offloaded_blocks>`); the rest are checkpointed.
        offload: With ``offloaded``: the engine's activation offload context
            (:meth:`ZeroEngine.offload_activations <lightning_zinf.engine.ZeroEngine.offload_activations>`),
            called with ``fresh=True`` where the offloaded blocks start over (a block entered that
            is not after the last one entered: a new forward), so that the copies back ahead follow
            one forward's order across its offloaded blocks.

    Raises:
        ValueError: ``offloaded`` without ``kept`` or without ``offload``, or more blocks kept and
            offloaded than there are.

    Attributes:
        measured: Block class name -> bytes one block of it saved in the first step.
        outside: Bytes saved outside the blocks in the first step.
        inputs: Bytes of the blocks' inputs kept by checkpointing (all blocks, per step).
        kept: Names of the blocks whose activations are kept (not checkpointed) once decided.
        offloaded: Names of the blocks whose activations are offloaded to host memory.
        checkpointed: Names of the blocks checkpointed once decided.
        decided: The choice is made (at the second training pass).
        over: Bytes by which the activations exceed the budget with every block checkpointed (0 if none).
    """

    def __init__(self, blocks: list[tuple[str, nn.Module]], budget: int, planned: int,
                 is_gathered: Callable[[Tensor], bool], kept: Optional[int] = None, offloaded: int = 0,
                 offload: Optional[Callable[[bool], ContextManager[None]]] = None) -> None:
        if offloaded and (kept is None or offload is None or kept + offloaded > len(blocks)):
            raise ValueError(f"ActivationPlan: offloaded={offloaded} needs kept (given {kept}) and an offload context, "
                             f"and at most {len(blocks)} blocks kept and offloaded together.")
        self.blocks, self.budget, self.planned = blocks, budget, planned
        self.offload = offload
        self.is_gathered = is_gathered
        self.measured: dict[str, int] = {}
        self.outside = 0
        self.inputs = 0
        self.kept: list[str] = []
        self.offloaded: list[str] = []
        self.checkpointed: list[str] = []
        self.decided = False
        self.over = 0
        self._stepped = False
        self._outside: Optional[_Count] = None  # the count of the scope in progress, if measuring
        self._inputs: dict[str, int] = {}
        self._originals = {name: module.forward for name, module in blocks}
        self._last_offloaded = len(blocks)  # the index of the offloaded block entered last
        if kept is not None:
            self._decide(kept, offloaded)
            return
        seen_classes: set[str] = set()
        for name, module in blocks:
            original = self._originals[name]
            cls = type(module).__name__
            if cls not in seen_classes:
                seen_classes.add(cls)
                module.forward = self._measured(original, cls, name)  # type: ignore[method-assign]
            else:
                module.forward = self._checkpointed(original, name)  # type: ignore[method-assign]

    # --- the first training step -------------------------------------------------------------------
    def _measuring(self) -> bool:
        return not self.decided and torch.is_grad_enabled()

    def _measured(self, forward: Callable[..., Any], cls: str, name: str) -> Callable[..., Any]:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._measuring():
                return forward(*args, **kwargs)
            count = _Count(self.is_gathered)
            with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
                out = forward(*args, **kwargs)
            self.measured[cls] = max(self.measured.get(cls, 0), count.nbytes)
            self._inputs[name] = _tensor_bytes(args, kwargs)
            return out

        return run

    def _checkpointed(self, forward: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            if not self.decided:
                self._inputs[name] = _tensor_bytes(args, kwargs)
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run

    def _offloaded(self, forward: Callable[..., Any], index: int) -> Callable[..., Any]:
        assert self.offload is not None
        offload = self.offload

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            # A new saving order where the blocks start over (a new forward, whichever offloaded
            # block it reaches first: one may be skipped, as under LayerDrop), not at one block.
            fresh = index <= self._last_offloaded
            self._last_offloaded = index
            with offload(fresh):
                return forward(*args, **kwargs)

        return run

    @contextmanager
    def scope(self) -> Iterator[None]:
        """A training forward (the strategy's ``training_step``): during the first, what is saved
        outside the blocks is counted."""
        if not self._measuring():
            yield
            return
        count = self._outside = _Count(self.is_gathered)  # the blocks' own hooks take over inside them
        try:
            with torch.autograd.graph.saved_tensors_hooks(count.pack, count.unpack):
                yield
        finally:
            self._outside = None
        self.outside = max(self.outside, count.nbytes)
        self._stepped = True

    def scope_every_forward(self, module: nn.Module) -> None:
        """Enter :meth:`scope` around every forward of ``module`` (Fabric's model, whose forward
        is the training forward). The loss is computed after the forward, outside the scope: what
        it saves is counted as its output in fp32 (a cross-entropy's log-softmax keeps one such
        tensor), the output's floating-point tensors that require a gradient."""
        scopes = ExitStack()

        def leave(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._outside is not None:
                for tensor in tensors_in(output):
                    if tensor.requires_grad and tensor.is_floating_point():
                        self._outside.add_as(tensor, max(tensor.element_size(), 4))
            scopes.close()

        module.register_forward_pre_hook(lambda *_: scopes.enter_context(self.scope()))
        module.register_forward_hook(leave, always_call=True)

    # --- the choice ----------------------------------------------------------------------------------
    def at_training_pass(self, comm: Collectives) -> None:
        """At the start of a training pass: after the first one, choose the blocks that keep their
        activations (the same on every rank: the smallest count any rank found) and rewrap them.

        Args:
            comm: The engine's collectives. The choice is one exchange of every rank's count, so
                every rank must call this at the same pass (the engine does, where every rank is
                at a training pass together) with the first step measured everywhere.

        Warns:
            RuntimeWarning: with every block checkpointed the activations still exceed the budget
                (the bytes over, and the fixes: ``example_input_array``, ``activation_memory``, a
                smaller batch per device or a larger budget).
        """
        if self.decided or not self._stepped:
            return
        self.inputs = sum(self._inputs.values())
        sizes = [self.measured.get(type(m).__name__, 0) for _, m in self.blocks]
        inputs = [self._inputs.get(name, 0) for name, _ in self.blocks]
        room = self.budget - self.planned

        def need(kept: int) -> int:
            # The first ``kept`` blocks hold their activations; each checkpointed one its input, and
            # backward recomputes one checkpointed block at a time.
            return (self.outside + sum(sizes[:kept]) + sum(inputs[kept:])
                    + max(sizes[kept:], default=0))

        count = max((k for k in range(len(sizes) + 1) if need(k) <= room), default=0)
        counts = comm.all_gather_ints([count])
        count = min(c[0] for c in counts if c is not None)
        self.over = max(0, need(0) - room)
        self._decide(count)
        if self.over:
            warnings.warn(
                f"memory_budget={format_bytes(self.budget)}: with every block checkpointed the activations of this "
                f"micro-batch ({format_bytes(self.outside)} outside the blocks, {format_bytes(self.inputs)} of block "
                f"inputs, {format_bytes(max(sizes, default=0))} to recompute one block) and the planned "
                f"{format_bytes(self.planned)} exceed the budget by {format_bytes(self.over)}. Give the model an "
                "example_input_array (one micro-batch: the plan then counts the activations before it places the "
                "state), or reserve them with activation_memory, lower the batch size per device or raise "
                "memory_budget.", RuntimeWarning, stacklevel=2)

    def _decide(self, count: int, offloaded: int = 0) -> None:
        """The first ``count`` blocks keep their activations, the next ``offloaded`` offload them,
        the others are checkpointed."""
        for index, (name, module) in enumerate(self.blocks):
            original = self._originals[name]
            if index < count:
                module.forward = original  # type: ignore[method-assign]
                self.kept.append(name)
            elif index < count + offloaded:
                module.forward = self._offloaded(original, index)  # type: ignore[method-assign]
                self.offloaded.append(name)
            else:
                module.forward = self._checkpointed(original, name)  # type: ignore[method-assign]
                self.checkpointed.append(name)
        self.decided = True
        log.info("lightning_zinf: %s", self.describe())

    def describe(self) -> str:
        """What the first step measured and what is kept: one line for the log."""
        decision = (f"{len(self.kept)} of {len(self.blocks)} blocks keep their activations, "
                    + (f"{len(self.offloaded)} keep them in host memory, " if self.offloaded else "")
                    + f"{len(self.checkpointed)} are checkpointed")
        if not self.measured:
            return f"from the example input's plan: {decision}"
        classes = ", ".join(f"{cls} {format_bytes(n)}" for cls, n in self.measured.items())
        return (f"activations per block ({classes}), outside the blocks {format_bytes(self.outside)}, block inputs "
                f"{format_bytes(self.inputs)}: {decision}")


def tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors in ``value`` (a module's output, a call's arguments): itself, or those in its
    tuples, lists and dicts (a Hugging Face ``ModelOutput`` is a dict), in order; other objects are
    not searched."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _tensor_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the storages of a call's tensor arguments, each once (a block's input)."""
    count = _Count(lambda tensor: False)
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            count.add(value)
    return count.nbytes
