"""The user's optimizer, stepped on fp32 master shards (ZeRO stage 3 optimizer-state partitioning):
the refusal of an optimizer that was not re-pointed at them, and gradient clipping over the
ranks' shards. The re-pointing itself is :class:`~lightning_zinf.engine.sharded.ShardedOptimizers`'.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_zinf.comm import Collectives

__all__ = ["clip_grad_norm_", "local_grad_sq_norm", "refuse_unsharded_steps"]


# The parameters' ids of every live engine, keyed by the engine: an entry leaves with its
# engine. One global hook reads them all; removing a hook per engine instead would happen inside a
# garbage collection, which may run while torch iterates its table of hooks in another optimizer's
# step ("OrderedDict mutated during iteration").
_PARTITIONED: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()
_generation = 0  # bumped per engine: an optimizer checked before may hold the new one's parameters
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_hook: Optional[RemovableHandle] = None


def refuse_unsharded_steps(owner: object, params: Iterable[Tensor]) -> None:
    """Make the step of any optimizer that holds one of ``params`` raise, for as long as ``owner``
    (the engine partitioning them) lives.

    Partitioned parameters are empty tensors between uses and never get a gradient (it goes to the
    shards): an optimizer over them that
    :meth:`~lightning_zinf.engine.sharded.ShardedOptimizers.adopt` did not re-point would step
    nothing, and the loss would stay flat with no error. Its ``step()`` raises ``RuntimeError``
    instead, on every rank, naming the fix. An optimizer is checked at its first step and again whenever its
    param groups change (or another engine is built); the check compares parameter identities, so
    it costs no tensor work. DeepSpeed and FSDP2 have no such check: this project's own, from a
    new-user trial in which the engine silently trained nothing.

    Args:
        owner: The object whose lifetime bounds the refusal (the :class:`ZeroEngine`); held weakly.
        params: The parameters it partitioned (any shape and dtype; frozen ones too, since they may
            be unfrozen later).

    Nothing is raised here: a refused optimizer's ``step()`` raises ``RuntimeError``.
    """
    global _generation, _hook
    _PARTITIONED[owner] = frozenset(id(p) for p in params)
    _generation += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_unsharded)


def _refuse_unsharded(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    groups = optimizer.param_groups
    signature = (_generation, tuple((id(g["params"]), len(g["params"])) for g in groups))
    try:
        if _checked.get(optimizer) == signature:
            return
    except TypeError:  # an optimizer class that is not hashable: check it at every step
        pass
    partitioned = list(_PARTITIONED.values())
    if any(id(p) in ids for ids in partitioned for g in groups for p in g["params"]):
        raise RuntimeError(
            f"The {type(optimizer).__name__} optimizer steps the partitioned model's own parameters, "
            "which hold no values or gradients between uses (only this rank's shards do), so it would "
            "train nothing. Call `optimizer = engine.shard_optimizer(optimizer)` once, after building it "
            "and before its first step (the Lightning strategies do this for `configure_optimizers`); "
            "a wrapper optimizer must be sharded through the optimizer that holds the parameters."
        )
    try:
        _checked[optimizer] = signature
    except TypeError:
        pass


def clip_grad_norm_(fragments: Iterable[Tensor], max_norm: float, comm: Collectives) -> Tensor:
    """Scale gradient shards so the global L2 norm over all ranks is at most ``max_norm``.

    Same result as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the squared norms of
    the shards are summed over ranks (one all-reduce of one fp32 scalar), and every shard is
    multiplied by ``min(1, max_norm / (norm + 1e-6))``.

    Args:
        fragments: This rank's fp32 master fragments; those without ``.grad`` are skipped.
        max_norm: The largest allowed global norm (> 0).
        comm: The data-parallel collectives.

    Returns:
        The global norm before clipping, a 0-d fp32 tensor. As in torch, a non-finite norm makes
        the gradients non-finite too (a mixed-precision loss scaler then skips the step).
    """
    grads = [f.grad for f in fragments if f.grad is not None]
    # Multi-tensor kernels: a few launches for all fragments, not four per fragment, per device
    # (fragments on the device and on the host under OffloadConfig.device_bytes), the norms then
    # combined in the fragments' order.
    devices = list(dict.fromkeys(g.device for g in grads))
    norms: list[Optional[Tensor]] = [None] * len(grads)
    for device in devices:
        at = [i for i, g in enumerate(grads) if g.device == device]
        for i, n in zip(at, torch._foreach_norm([grads[i] for i in at])):
            norms[i] = n
    norm = comm.sum_over_shards(local_grad_sq_norm(norms)).sqrt()  # type: ignore[arg-type]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for device in devices:
        torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device, grads[0].dtype))
    return norm


def local_grad_sq_norm(norms: list[Tensor]) -> Tensor:
    """This rank's squared gradient norm from the L2 norms of its gradient fragments (fp32 0-d
    tensors, as ``torch._foreach_norm`` gives them, in the order of the engine's fragments): the
    square of their vector norm, as ``torch.nn.utils.get_total_norm`` combines them. One function
    for resident gradients (:func:`clip_grad_norm_`) and for norms recorded before the gradients
    were swapped out (NVMe optimizer offload), so both clip bit for bit alike. Empty: a 0-d zero
    on the CPU."""
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    # Norms of fragments on two devices (OffloadConfig.device_bytes) are combined on the first's.
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])).float().pow(2)
