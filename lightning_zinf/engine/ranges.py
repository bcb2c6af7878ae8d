"""Named ranges of the engine's phases in a profiler trace, as FSDP2 names its own (``FSDP::...``):
``zinf.gather``, ``zinf.release``, ``zinf.reduce_scatter``, ``zinf.swap_in``, ``zinf.swap_out``,
``zinf.before_step``, ``zinf.after_step``.

A ``torch.profiler.record_function`` costs host time whether or not a profiler runs: opened
unconditionally, these ranges made ``unit_cost.py``'s overhead per unit 10% larger on the CPU
(1,779 -> 1,962 us per unit per step, three interleaved rounds), so they are opened only while a
profiler runs (torch's own flag, set by ``torch.profiler.profile`` and Lightning's profilers).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

__all__ = ["phase", "phased"]

F = TypeVar("F", bound=Callable[..., Any])


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """A context that is the range ``name`` while a profiler runs, and nothing otherwise."""
    return record_function(name) if autograd_profiler._is_profiler_enabled else contextlib.nullcontext()


def phased(name: str) -> Callable[[F], F]:
    """Decorate a function so that each call is the range ``name`` while a profiler runs."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any) -> Any:
            if not autograd_profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)
        return ranged  # type: ignore[return-value]
    return wrap
