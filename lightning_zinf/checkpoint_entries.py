"""The entries of a strategy's checkpoint outside the shard files: the model's buffers and extra
state, and the optimizers' hyper-parameters per param group."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch import nn

from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.tiling import tile_views

__all__ = ["module_buffers", "optimizer_hyperparameters", "restore_hyperparameters"]


def module_buffers(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` without its parameters (replicated buffers, extra state): what a
    checkpoint's ``state_dict`` entry holds, since the parameters are in the shard files. The
    partitioned parameters are not gathered for it (:func:`~lightning_zinf.state_dict_options`)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    params.update(view.name for view in tile_views(module).values())  # a TiledLinear's "weight"
    engine = getattr(module, "_zinf_engine", None)
    with state_dict_options(module, parameters=False) if engine is not None else contextlib.nullcontext():
        state = module.state_dict()
    return {k: v for k, v in state.items() if k not in params}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's hyper-parameters per param group (a checkpoint's ``optimizer_states`` entry);
    its per-element state is in the shard files."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def restore_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], saved: Sequence[dict[str, Any]]) -> None:
    """Put back what :func:`optimizer_hyperparameters` saved (learning rates a scheduler changed...)."""
    for optimizer, state in zip(optimizers, saved):
        for group, hyper in zip(optimizer.param_groups, state["param_groups"]):
            group.update(hyper)
