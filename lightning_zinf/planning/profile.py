"""A training step's compute and activations, known before the run: one forward of the model on an
example input with fake tensors, and one block run for real to time it.

The forward runs under torch's ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no
data, so a model of any size costs nothing) through ``torch.func.functional_call`` with fake
parameters in the compute dtype on the compute device, so every operator takes the kernel the run
will take (the saved tensors of attention differ between devices). Saved-tensor hooks count what
autograd keeps, per block (an instance of ``block_classes``) and outside the blocks, by storage,
parameters left out, as :class:`~lightning_zinf.planning.activations.ActivationPlan` counts the
first step; torch's ``FlopCounterMode`` counts the FLOPs of each block and of the whole forward.
The model's output in fp32 is counted with the outside: the loss computed from it keeps a tensor of
that size (a cross-entropy's log-softmax). The example is Lightning's ``example_input_array``
convention: a tuple is the forward's positional arguments, a dict its keyword arguments, anything
else its one argument. A forward whose control flow reads tensor values (``.item()``, boolean
masks) cannot run on fake tensors: :func:`profile_forward` then returns ``None`` and the
activations are planned from the first step.

:func:`time_blocks` runs the first block of each class for real, forward and backward, on random
inputs of the shapes the fake forward saw, with the block's own parameters (random ones if they are
on the meta device): its FLOPs over its time is the rate the whole step's FLOPs are timed at
(small layers reach well under a matmul's peak: 65 of 89 GFLOP/s for width 256 on this machine's
cores, 81 of 86 for width 768). It runs the block checkpointed too: a recompute costs what that
adds, less than a forward (0.65-0.7 of one for a block of width 256 here: the activations it does
not keep are not written to fresh memory). Memory: one block's parameters and activations, on the
device.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from lightning_zinf.planning.activations import tensors_in

__all__ = ["BlockProfile", "ForwardProfile", "block_seconds", "profile_forward", "time_blocks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockProfile:
    """One block's forward on the example.

    Attributes:
        name: Its qualified name in the model.
        cls: Its class name.
        flops: FLOPs of its forward (backward: about twice as many; a recompute: as many again).
        saved: Bytes autograd keeps for its backward when it is not checkpointed.
        inputs: Bytes of its tensor arguments (what checkpointing keeps of it instead).
        arguments: Its ``(args, kwargs)``, tensors as meta tensors of their shapes and dtypes.
        copied: Bytes the activation offload copies to the host when it is offloaded: each saved
            tensor, dense, as often as it is saved (views of one storage each copied); ``None``:
            ``saved``.
        pinned: The page-locked host memory those copies take on an accelerator: each rounded up
            to a power of two, as torch's caching host allocator rounds its blocks; ``None``: ``saved``.
    """

    name: str
    cls: str
    flops: int
    saved: int
    inputs: int
    arguments: Any = field(default=((), {}), compare=False, repr=False)
    copied: Optional[int] = None
    pinned: Optional[int] = None


@dataclass(frozen=True)
class ForwardProfile:
    """The model's forward on the example, per block.

    Attributes:
        flops: FLOPs of the whole forward (the blocks' included).
        outside: Bytes kept for backward outside the blocks, the output in fp32 for the loss included.
        blocks: The blocks the forward called, in module order (``blocks``' order), each at its
            first call; :meth:`activation_bytes` keeps the first ones, as the engine's
            :class:`~lightning_zinf.planning.activations.ActivationPlan` does.
        seconds_per_flop: Seconds per FLOP of a block's forward and backward run for real
            (:func:`block_seconds`), or ``None`` until measured.
        recompute_seconds_per_flop: Seconds a checkpointed block adds to its forward and backward,
            per FLOP of its forward (:func:`time_blocks`; less than a forward's: the activations it
            does not keep are not written to fresh memory), or ``None`` until measured.
    """

    flops: int
    outside: int
    blocks: tuple[BlockProfile, ...]
    seconds_per_flop: Optional[float] = None
    recompute_seconds_per_flop: Optional[float] = None

    def activation_bytes(self, kept: int, offloaded: int = 0) -> int:
        """Peak bytes of activations on the compute device when the first ``kept`` blocks keep
        theirs, the next ``offloaded`` keep theirs in host memory and the rest are checkpointed:
        what is kept outside, by the kept blocks and of the checkpointed blocks' inputs, and one
        block's own while backward recomputes it or copies it back (the copy back of an offloaded
        block's tensors runs about one tensor ahead of its use; a whole block bounds it), or while
        the forward copies it to the host (the next offloaded block waits for those copies)."""
        saved = [b.saved for b in self.blocks]
        return (self.outside + sum(saved[:kept]) + sum(b.inputs for b in self.blocks[kept + offloaded:])
                + max(saved[kept:], default=0))

    def offloaded_bytes(self, kept: int, offloaded: int) -> int:
        """Bytes of host memory the blocks after the first ``kept`` take when ``offloaded`` of them
        are offloaded: their saved tensors' copies, in page-locked blocks (:attr:`BlockProfile.pinned`)."""
        return sum(b.saved if b.pinned is None else b.pinned for b in self.blocks[kept:kept + offloaded])

    def offloaded_traffic(self, kept: int, offloaded: int) -> int:
        """Bytes those blocks' saved tensors move over the host link each way (to the host in the
        forward, back in backward: :attr:`BlockProfile.copied`)."""
        return sum(b.saved if b.copied is None else b.copied for b in self.blocks[kept:kept + offloaded])

    def recompute_flops(self, kept: int, offloaded: int = 0) -> int:
        """FLOPs backward spends recomputing the forwards of the checkpointed blocks (those after
        the first ``kept + offloaded``)."""
        return sum(b.flops for b in self.blocks[kept + offloaded:])


class _Saved:
    """Bytes of the storages autograd saves, each once, parameters left out (fake tensors have no
    data pointer: a view is counted as its base)."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters = parameters
        self.seen: dict[int, Tensor] = {}  # holding the bases keeps their ids unique
        self.copies: list[int] = []  # bytes of each saved tensor, as the activation offload copies it

    def add(self, tensor: Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.parameters and tensor.layout == torch.strided:
            self.seen.setdefault(id(base), base)
            if tensor.numel():
                self.copies.append(tensor.numel() * tensor.element_size())

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.seen.values())

    @property
    def pinned(self) -> int:
        """Page-locked bytes of the copies: each rounded up to a power of two."""
        return sum(1 << (n - 1).bit_length() for n in self.copies)

    def pack(self, tensor: Tensor) -> Tensor:
        self.add(tensor)
        return tensor


def _call(module: nn.Module, parameters: dict[str, Tensor], example: Any) -> Any:
    if isinstance(example, tuple):
        return functional_call(module, parameters, example)
    if isinstance(example, dict):
        return functional_call(module, parameters, (), example)
    return functional_call(module, parameters, (example,))


def profile_forward(module: nn.Module, example: Any, blocks: list[tuple[str, nn.Module]], *,
                    device: torch.device, dtype: Optional[torch.dtype]) -> Optional[ForwardProfile]:
    """``module``'s forward on ``example`` with fake tensors: its FLOPs and saved bytes, per block.

    Args:
        module: The model, real or on the meta device; it is not run and not changed (hooks are
            added for the call and removed).
        example: The forward's input (``example_input_array``'s convention); its tensors' shapes and
            dtypes are used, on ``device``.
        blocks: ``(qualified name, module)`` of the blocks, outermost, in module order.
        device: The compute device.
        dtype: The compute dtype of floating parameters (``param_dtype``), or ``None`` for theirs.

    Returns:
        The :class:`ForwardProfile` (without ``seconds_per_flop``), or ``None`` when the forward
        cannot run on fake tensors (the reason is logged).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    handles = []
    found: dict[str, BlockProfile] = {}
    try:
        with mode:
            parameters = {}
            for name, p in module.named_parameters():
                fake_dtype = dtype if dtype is not None and p.is_floating_point() else p.dtype
                parameters[name] = torch.empty(p.shape, dtype=fake_dtype, device=device).requires_grad_(p.requires_grad)
            for name, b in module.named_buffers():
                parameters[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
            fake_example = tree_map(
                lambda v: torch.empty(v.shape, dtype=v.dtype, device=device) if isinstance(v, Tensor) else v, example)
        ids = {id(t) for t in parameters.values()}
        outside = _Saved(ids)
        with FlopCounterMode(display=False) as flops, _in_training_mode(module):
            for name, block in blocks:
                handles.extend(_watch(name, block, found, flops, ids))
            with mode, torch.autograd.graph.saved_tensors_hooks(outside.pack, lambda t: t):
                output = _call(module, parameters, fake_example)
        loss_input = sum(t.numel() * max(t.element_size(), 4) for t in tensors_in(output)
                         if t.requires_grad and t.is_floating_point())
        return ForwardProfile(flops=flops.get_total_flops(), outside=outside.nbytes + loss_input,
                              blocks=tuple(found[name] for name, _ in blocks if name in found))
    except Exception as error:  # any operator or model code that needs real values
        log.info("lightning_zinf: the example input's forward does not run on fake tensors (%s: %s); activations "
                 "are planned from the first training step instead.", type(error).__name__, error)
        return None
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _in_training_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and its submodules in training mode for the block, as the training step runs
    them (a model fresh from ``from_pretrained`` is in eval mode: dropout would save no masks),
    each submodule's own mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _watch(name: str, block: nn.Module, found: dict[str, BlockProfile], flops: FlopCounterMode,
           parameters: set[int]) -> list[Any]:
    """Hooks that count ``block``'s first call: its FLOPs, what it saves and its inputs (kept as
    meta tensors of their shapes, which :func:`block_seconds` runs it on)."""
    scopes = ExitStack()
    state: dict[str, Any] = {}

    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in found or state or not torch.is_grad_enabled():
            return
        saved = _Saved(parameters)
        inputs = _Saved(set())
        for tensor in tensors_in((args, kwargs)):
            inputs.add(tensor)
        shapes = tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, Tensor)
                          else _copied(v), (args, kwargs))
        state.update(saved=saved, inputs=inputs.nbytes, flops=flops.get_total_flops(), shapes=shapes)
        scopes.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not state:
            return
        scopes.close()
        saved = state["saved"]
        found[name] = BlockProfile(name, type(block).__name__, flops.get_total_flops() - state["flops"],
                                   saved.nbytes, state["inputs"], state["shapes"], sum(saved.copies), saved.pinned)
        state.clear()

    return [block.register_forward_pre_hook(enter, with_kwargs=True),
            block.register_forward_hook(leave, always_call=True)]


def _copied(value: Any) -> Any:
    """``value`` as it is now, for a later call: a deep copy, as the forward goes on to change
    objects passed to each block (a Hugging Face ``Cache`` gains every layer's keys and values);
    ``value`` itself for a module, a callable (a bound method or partial would copy the model it
    holds) or what cannot be copied."""
    if isinstance(value, nn.Module) or callable(value):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # any object's own __deepcopy__ or pickling protocol
        return value


def block_seconds(block: nn.Module, arguments: Any, *, device: torch.device, dtype: Optional[torch.dtype],
                  repeats: int = 5) -> tuple[float, float]:
    """Seconds of one forward and backward of ``block`` for real on ``device``, and what running
    its forward under activation checkpointing adds (backward recomputes it).

    Args:
        block: The block; its parameters are copied to ``device`` in ``dtype`` (random ones if on
            the meta device), and it is not changed.
        arguments: ``(args, kwargs)`` as :attr:`BlockProfile.arguments` has them: each tensor
            becomes a random one of its shape and dtype (floating ones requiring a gradient, as a
            block's input does in training; integer and boolean ones zeros), and each run gets a
            copy of the other objects (a cache the block appends to starts as the forward gave it).
        device: The compute device.
        dtype: The compute dtype of floating parameters, or ``None`` for theirs.
        repeats: Pairs of runs timed after one warm-up of each kind: a plain run, then one under
            non-reentrant checkpointing. Medians are returned (a run the machine's other work
            disturbed moves them less than a mean; the fastest run would be optimistic for a
            step that shares the machine with other ranks), and the added time is the median of
            each pair's difference: the kinds alternate so that a machine whose speed drifts
            slows both alike (two separate medians differed by less than nothing on a shared
            2-core VM, which priced recomputation at zero).

    Returns:
        ``(seconds, added)``: the median plain run's wall-clock seconds (the device synchronized
        before and after each) and the median of what checkpointing added, at least 0.

    Raises:
        Exception: whatever the block's forward or backward raises on these inputs (a block whose
            arguments must hold particular values); the caller then does without a rate.
    """
    def real(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return _copied(value)
        if value.is_floating_point():
            return torch.randn(value.shape, dtype=value.dtype, device=device).requires_grad_(True)
        return torch.zeros(value.shape, dtype=value.dtype, device=device)

    parameters = {}
    with torch.no_grad():
        for name, p in block.named_parameters():
            cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
            value = torch.randn(p.shape, device=device).mul_(0.02).to(cast) if p.is_meta else p.detach().to(device, cast)
            parameters[name] = value.requires_grad_(p.requires_grad)
        for name, b in block.named_buffers():
            # A copy: a block that updates its buffers in place (batch norm's running statistics)
            # must not change the model's by being timed.
            parameters[name] = torch.zeros(b.shape, dtype=b.dtype, device=device) if b.is_meta else \
                b.to(device, copy=True)
    calls = [tree_map(real, arguments) for _ in range(2 * (repeats + 1))]

    def run(args: tuple, kwargs: dict, checkpointed: bool) -> float:
        def forward(*positional: Any) -> Any:
            return functional_call(block, parameters, positional, kwargs)

        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        start = time.perf_counter()
        out = checkpoint(forward, *args, use_reentrant=False) if checkpointed else forward(*args)
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter() - start

    run(*calls[0], checkpointed=False)
    run(*calls[1], checkpointed=True)
    plain, added = [], []
    for i in range(1, repeats + 1):
        plain.append(run(*calls[2 * i], checkpointed=False))
        added.append(run(*calls[2 * i + 1], checkpointed=True) - plain[-1])
    return statistics.median(plain), max(0.0, statistics.median(added))


def time_blocks(profile: ForwardProfile, blocks: list[tuple[str, nn.Module]], *, device: torch.device,
                dtype: Optional[torch.dtype]) -> ForwardProfile:
    """``profile`` with its rates measured: the first block of each class run for real
    (:func:`block_seconds`), plainly and checkpointed in turn. ``seconds_per_flop``: their plain
    time over their FLOPs (forward and backward: three forwards'); ``recompute_seconds_per_flop``:
    what checkpointing added over their forward FLOPs. Unchanged when no block has FLOPs to time.

    Args:
        profile: :func:`profile_forward`'s result on this process (its blocks' ``arguments``).
        blocks: The ``(qualified name, module)`` pairs ``profile`` was made with.
        device: The compute device the blocks are run on.
        dtype: The compute dtype of floating parameters, or ``None`` for theirs.

    Raises:
        Exception: as :func:`block_seconds`.
    """
    modules = dict(blocks)
    plain = added = flops = 0.0
    timed: set[str] = set()
    for b in profile.blocks:
        if b.cls in timed or not b.flops:
            continue
        timed.add(b.cls)
        with _in_training_mode(modules[b.name]):
            seconds, recompute = block_seconds(modules[b.name], b.arguments, device=device, dtype=dtype)
        plain, added, flops = plain + seconds, added + recompute, flops + b.flops
    if device.type != "cpu":
        # The timed blocks' parameters and activations are free now: give the cached blocks back
        # (only this rank ran them, and memory the driver holds for torch is not free for NCCL).
        torch.accelerator.empty_cache()
    if not flops:
        return profile
    return dataclasses.replace(profile, seconds_per_flop=plain / (3 * flops),
                               recompute_seconds_per_flop=added / flops)
