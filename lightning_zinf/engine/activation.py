"""Activation checkpointing of chosen module classes (Chen et al., "Training Deep Nets with
Sublinear Memory Cost", 2016; ZeRO-Infinity §5.1.2 pairs it with parameter partitioning).

A wrapped module keeps only its inputs for backward; backward runs its forward again (under the
engine, that re-gathers its units) with torch's non-reentrant ``torch.utils.checkpoint``. Only the
module's ``forward`` is wrapped, on the instance: its class, parameter names, state-dict keys and
hooks stay as they are, so checkpoints and ``block_classes`` are unaffected.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zinf.engine.partition import matches_classes, resolve_block_classes

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(root: nn.Module, classes: Sequence[Union[str, type]]) -> list[str]:
    """Wrap the forward of every submodule of ``root`` whose class is in ``classes`` (classes, or
    names matching a class's ``__name__`` or ``module.qualname``, as Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)`` takes them) in non-reentrant activation
    checkpointing. Idempotent: a module already wrapped is left as it is. Under ``torch.no_grad``
    (validation, generation) a wrapped module runs plainly.

    Args:
        root: The model.
        classes: Module classes or class names; empty: nothing is wrapped.

    Returns:
        The qualified names of the wrapped modules, in module order.

    Raises:
        ValueError: an entry is neither a class nor a name, or no module matches an entry (the
            message lists the model's module classes).
    """
    if not classes:
        return []
    wanted, names = resolve_block_classes(classes)
    wrapped: list[str] = []
    used: set[Union[str, type]] = set()
    for name, module in root.named_modules():
        hit = matches_classes(module, wanted, names)
        if hit is None:
            continue
        used.add(hit)
        if not getattr(module, "_zinf_checkpointed", False):
            module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
            module._zinf_checkpointed = True  # type: ignore[assignment]
        wrapped.append(name)
    missing = [c for c in classes if c not in used]
    if missing:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"activation_checkpointing={[getattr(c, '__name__', c) for c in missing]} matches no module of "
            f"{type(root).__name__}. Its module classes are: {', '.join(present)}."
        )
    return wrapped


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
