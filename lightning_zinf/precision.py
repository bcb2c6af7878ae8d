"""Lightning precision plugins that know gradients are sharded.

Lightning picks a generic plugin for a third-party strategy (``Precision``, ``MixedPrecision`` or
``HalfPrecision``). Two of its behaviours are wrong for ZeRO shards: clipping by norm computes the
norm of this rank's shard only, and fp16 loss scaling would let one rank skip a step another takes.
:func:`to_zero_precision` swaps in subclasses that clip by the global norm and scale with torch's
``ShardedGradScaler`` (which all-reduces the found-inf flag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zinf.config import MixedPrecisionConfig
from lightning_zinf.unsupported import NotSupportedError

if TYPE_CHECKING:
    from lightning_zinf.engine import ZeroEngine

__all__ = ["ZeroPrecision", "ZeroMixedPrecision", "ZeroHalfPrecision", "to_zero_precision", "to_zero_fabric_precision",
           "policy_for", "UnsupportedPrecisionError", "refuse_clipping_by_value"]

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


class UnsupportedPrecisionError(TypeError, ValueError):
    """A precision the strategy does not support (``"64-true"``, transformer-engine, a custom plugin).

    Both types Lightning's sharded strategies raise for it, so code written for them catches it:
    ``ValueError`` for a ``precision=`` string (``FSDPPrecision``, ``DeepSpeedPrecision``,
    ``ModelParallelStrategy``), ``TypeError`` for a plugin of another class (the ``precision_plugin``
    setter of ``FSDPStrategy``).
    """


class _GlobalNormClipping:
    """Clip by the L2 norm over every rank's gradient shards (``Trainer(gradient_clip_val=...)``),
    and run the closure (forward, backward, clipping) before ``optimizer.step()`` rather than inside
    it, so the engine's step pre-hook sees the finished gradients (the offloaded optimizer steps
    there, sub-group by sub-group). Exact for the elementwise optimizers the strategy accepts,
    which call their closure once, first."""

    engine: Optional["ZeroEngine"] = None

    @override
    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if getattr(self, "scaler", None) is not None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # runs the closure first itself
        closure_result = self._wrap_closure(model, optimizer, closure)
        optimizer.step(**kwargs)
        return closure_result

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Elementwise, so exact on shards, when the gradients are in memory.

        Raises:
            NotSupportedError: with NVMe optimizer offload (the gradients are on disk until the step;
                the clamp would find none and do nothing). A ``MisconfigurationException``, as
                Lightning's DeepSpeed strategy raises for clipping by value, and a ``ValueError``.
        """
        if self.engine is not None:
            refuse_clipping_by_value(self.engine)
        super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.engine is None:
            raise RuntimeError("The zero_infinity strategy has not set up its engine yet; clipping needs it.")
        self.engine.clip_grad_norm_(float(clip_val))


class ZeroPrecision(_GlobalNormClipping, Precision):
    """fp32 training (``"32-true"``) with global-norm clipping."""


class ZeroMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """Autocast training (``"bf16-mixed"``, ``"16-mixed"``) with global-norm clipping; fp16 uses a
    ``ShardedGradScaler`` so every rank agrees on skipping a step with inf/nan gradients."""


class ZeroHalfPrecision(_GlobalNormClipping, HalfPrecision):
    """Parameters in bf16/fp16 (``"bf16-true"``, ``"16-true"``); fp32 master shards in the optimizer."""


def to_zero_precision(plugin: Precision) -> Precision:
    """Translate one of Lightning's generic precision plugins into its sharding-aware subclass.

    Args:
        plugin: The plugin Lightning chose from ``Trainer(precision=...)``, or one of ours.

    Returns:
        A :class:`ZeroPrecision`, :class:`ZeroMixedPrecision` or :class:`ZeroHalfPrecision`.

    Raises:
        UnsupportedPrecisionError: a plugin for another precision (``"64-true"``, transformer-engine, a
            custom one); a ``TypeError`` and a ``ValueError``.
    """
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    if type(plugin) is Precision:
        return ZeroPrecision()
    if type(plugin) is MixedPrecision:
        scaler = _sharded(plugin.scaler, plugin.device)
        return ZeroMixedPrecision(plugin.precision, plugin.device, scaler=scaler)  # type: ignore[arg-type]
    if type(plugin) is HalfPrecision:
        return ZeroHalfPrecision(plugin.precision)  # type: ignore[arg-type]
    raise _unsupported(plugin)


def to_zero_fabric_precision(plugin: fabric_precision.Precision) -> fabric_precision.Precision:
    """The same translation for one of Fabric's precision plugins: fp16 loss scaling with a
    ``ShardedGradScaler``. (Fabric clips through the strategy, which clips by the global norm.)

    Args:
        plugin: The plugin Fabric chose from ``Fabric(precision=...)``.

    Returns:
        ``plugin``, or for ``"16-mixed"`` a ``MixedPrecision`` with a ``ShardedGradScaler``.

    Raises:
        UnsupportedPrecisionError: a plugin for another precision (``"64-true"``, transformer-engine, a
            custom one); a ``TypeError`` and a ``ValueError``.
    """
    if type(plugin) in (fabric_precision.Precision, fabric_precision.HalfPrecision):
        return plugin
    if type(plugin) is fabric_precision.MixedPrecision:
        if plugin.scaler is None or isinstance(plugin.scaler, ShardedGradScaler):
            return plugin
        scaler = _sharded(plugin.scaler, plugin.device)
        return fabric_precision.MixedPrecision(plugin.precision, plugin.device, scaler=scaler)
    raise _unsupported(plugin)


def _sharded(scaler: Optional[torch.amp.GradScaler], device: str) -> Optional[ShardedGradScaler]:
    """The same scaler settings, but the found-inf flag is agreed by all ranks."""
    if scaler is None:
        return None
    sharded = ShardedGradScaler(device=device)
    sharded.load_state_dict(scaler.state_dict())
    return sharded


def refuse_clipping_by_value(engine: "ZeroEngine", fabric: bool = False) -> None:
    """Refuse to clip by value where the gradients are not in memory at clipping time (with NVMe
    optimizer offload they are on disk until the step: a clamp would find none and do nothing).

    Args:
        engine: The strategy's engine.
        fabric: Word the fix for ``fabric.clip_gradients`` rather than the Trainer's arguments.

    Raises:
        NotSupportedError: ``engine`` offloads the optimizer to NVMe.
    """
    if engine.offload is None or not engine.offload.nvme:
        return
    if fabric:
        raise NotSupportedError("Clipping by value needs the gradients in memory; with OffloadConfig(optimizer='nvme') "
                                "use fabric.clip_gradients(max_norm=...), or optimizer='cpu'.")
    raise NotSupportedError("gradient_clip_algorithm='value' needs the gradients in memory; with "
                            "OffloadConfig(optimizer='nvme') clip by norm (the default), or use optimizer='cpu'.")


def _unsupported(plugin: Any) -> UnsupportedPrecisionError:
    return UnsupportedPrecisionError(
        f"The zero_infinity strategy does not support {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}). Use precision= with one of {', '.join(SUPPORTED)}."
    )


def policy_for(plugin: Precision) -> MixedPrecisionConfig:
    """The engine's precision policy for a Lightning precision plugin (when the strategy is given none).

    ``"bf16-mixed"`` and ``"16-mixed"`` gather and compute in bf16/fp16, as FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)`` and DeepSpeed's bf16/fp16 modes do, and
    reduce-scatter gradients in fp32 (``docs/precision.md`` gives the measurement behind that choice); autocast
    still runs for the ops it exists for. ``"*-true"`` precisions gather the parameters as they are.

    Args:
        plugin: The plugin from :func:`to_zero_precision` or :func:`to_zero_fabric_precision`.

    Returns:
        A :class:`~lightning_zinf.MixedPrecisionConfig`.
    """
    mode = getattr(plugin, "precision", "32-true")  # the Trainer's plugins and Fabric's both carry it
    if mode in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if mode == "bf16-mixed" else torch.float16
        return MixedPrecisionConfig(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionConfig()
