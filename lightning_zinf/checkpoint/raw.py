"""``fabric.load_raw`` before ``fabric.setup``: a plain state dict (a ``torch.save`` file, a
``.safetensors`` file, a Hugging Face folder) loaded into a model or optimizer the strategy has not
set up yet, as under DDP, DeepSpeed and Lightning's base strategy (the usual way to bring
pretrained weights in).

A model with real parameters takes the values at once, through its own ``load_state_dict``, as
under DDP; setup then partitions them from rank 0's. A model built inside ``fabric.init_module()``
has its parameters on the meta device, which cannot hold values: its keys and shapes are checked at
once (torch's own ``load_state_dict`` checks, on the meta parameters), and the values are loaded
when the model is set up, one unit at a time into the shards. An optimizer's plain state dict is
checked against its param groups at once and loaded into the fp32 master shards' state when the
optimizer is set up. :class:`PendingLoads` keeps what waits for setup.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_zinf.checkpoint.format import CheckpointError, is_sharded_checkpoint, require_checkpoint
from lightning_zinf.checkpoint.full import load_full_checkpoint
from lightning_zinf.checkpoint.sources import tensor_source

__all__ = ["read_state_dict", "PendingLoads"]


def read_state_dict(path: os.PathLike | str, weights_only: Optional[bool] = None) -> Mapping[str, Any]:
    """A plain state dict from ``path``, memory-mapped (its tensors are read where they are used): a
    ``.safetensors`` file or a Hugging Face model folder, or else a ``torch.save`` file
    (:func:`~lightning_zinf.checkpoint.full.load_full_checkpoint`, with ``weights_only``).

    Raises:
        CheckpointNotFoundError: nothing at ``path``, a folder that is neither a checkpoint nor a
            Hugging Face model's, or a part of a sharded checkpoint (which the message names).
        CheckpointError: a sharded checkpoint (its values live in shard files), or a file that
            cannot be read.
    """
    path = Path(path)
    require_checkpoint(path, folders=True)
    if is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{path} is a sharded checkpoint: its values go straight into a partitioned model's shards. Set the "
            "model up first (model = fabric.setup(model)) and load it then, or consolidate it into one file "
            "(zinf-consolidate) to load before setup."
        )
    if path.suffix == ".safetensors" or path.is_dir():
        return tensor_source(path)
    return load_full_checkpoint(path, weights_only)


def _check_optimizer_state(optimizer: Optimizer, state_dict: Any, path: Path) -> None:
    """The checks ``torch.optim.Optimizer.load_state_dict`` makes: a state dict with ``state`` and
    ``param_groups``, as many groups as the optimizer has and as many parameters in each.

    Raises:
        ValueError: naming the mismatch (as torch raises it).
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{path} does not hold an optimizer's state dict (a dict with 'state' and 'param_groups').")
    saved = [len(group["params"]) for group in state_dict["param_groups"]]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if len(saved) != len(mine):
        raise ValueError(f"{path} holds the state of an optimizer with {len(saved)} parameter groups; this one has "
                         f"{len(mine)}.")
    if saved != mine:
        raise ValueError(f"{path} holds an optimizer state whose parameter groups have {saved} parameters; this "
                         f"optimizer's have {mine}: it was built over other parameters.")


class PendingLoads:
    """Plain state dicts loaded into models and optimizers before the strategy set them up, waiting
    for it. The models and optimizers are held weakly (a pickled strategy, as a launcher sends it,
    holds none)."""

    def __init__(self) -> None:
        # id(object) -> (a weak reference to it, what waits for its setup)
        self._waiting: dict[int, tuple[weakref.ref, Any]] = {}

    def _put(self, obj: Any, what: Any) -> None:
        self._waiting = {k: v for k, v in self._waiting.items() if v[0]() is not None}  # drop the dead
        self._waiting[id(obj)] = (weakref.ref(obj), what)

    def _take(self, obj: Any) -> Any:
        entry = self._waiting.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        del self._waiting[id(obj)]
        return entry[1]

    def load_module(self, path: os.PathLike | str, module: nn.Module, strict: bool,
                    weights_only: Optional[bool]) -> None:
        """``module.load_state_dict(state dict at path, strict)`` for a model not set up yet: at once
        if its parameters are real; if any is on the meta device, the keys and shapes are checked at
        once and the values wait for :meth:`take_module`.

        Raises:
            RuntimeError: ``strict`` and the keys do not match, or a shape differs (torch's message).
            CheckpointNotFoundError, CheckpointError: as :func:`read_state_dict`.
        """
        state_dict = read_state_dict(path, weights_only)
        if not any(p.is_meta for p in module.parameters()):
            module.load_state_dict(state_dict, strict=strict)
            return
        with warnings.catch_warnings():
            # torch's checks run as usual; copying into a meta parameter is a no-op it warns about.
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            module.load_state_dict(state_dict, strict=strict)
        self._put(module, (str(path), strict, weights_only))

    def load_optimizer(self, path: os.PathLike | str, optimizer: Optimizer, weights_only: Optional[bool]) -> None:
        """Check the plain optimizer state dict at ``path`` against ``optimizer`` (not set up yet) and
        keep it for :meth:`take_optimizer`.

        Raises:
            ValueError: not an optimizer state dict, or other param groups (torch's checks).
            CheckpointNotFoundError, CheckpointError: as :func:`read_state_dict` (a file only).
        """
        state_dict = read_state_dict(path, weights_only)
        _check_optimizer_state(optimizer, state_dict, Path(path))
        self._put(optimizer, state_dict)

    def take_module(self, module: nn.Module) -> Optional[tuple[str, bool, Optional[bool]]]:
        """The ``(path, strict, weights_only)`` of the load waiting for ``module``'s setup, or ``None``."""
        return self._take(module)

    def take_optimizer(self, optimizer: Optimizer) -> Optional[Mapping[str, Any]]:
        """The plain state dict waiting for ``optimizer``'s setup, or ``None``."""
        return self._take(optimizer)
