"""Offload tiers of the infinity offload engine (ZeRO-Infinity, Rajbhandari et al., SC'21, §6).

- :class:`NvmeSwapper`: asynchronous swap out/in of CPU tensors to files on a local disk
  (DeepNVMe, §6.3), with ``O_DIRECT``, aligned buffers and many requests in flight.
- :func:`aligned_empty`: page-aligned CPU tensors that the swapper moves without a copy.
- :func:`~lightning_zinf.offload.preflight.ensure_space`: the free-space check made before the
  engine writes its swap files.

What the engine calls: :class:`~lightning_zinf.offload.params.ParamOffload` swaps parameter
shards in before a gather (``acquire``, called by the unit state machine's ``start_gather``) and
reads the next ones ahead; :class:`~lightning_zinf.offload.optimizer.OptimizerOffload` keeps fp32
masters, gradient shards and optimizer states on the CPU or NVMe and steps them sub-group by
sub-group, in the background while the next forward runs
(:class:`~lightning_zinf.offload.stepping.StepPipeline`);
:class:`~lightning_zinf.offload.activations.ActivationOffload` keeps saved activations in host memory.
"""

from lightning_zinf.offload.swapper import AioConfig, IoHandle, NvmeSwapper, SwapError, aligned_empty

__all__ = ["AioConfig", "IoHandle", "NvmeSwapper", "SwapError", "aligned_empty"]
