"""Resuming a sharded optimizer whose param groups carry torch's ``foreach``/``fused``/``capturable``
flags, against torch's own ``Optimizer.load_state_dict`` (used by test_checkpoint.py on the CPU and by
test_gpu.py on CUDA, where fused and capturable AdamW keep ``step`` on the device).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_zinf import ZeroEngine
from lightning_zinf.checkpoint import load_sharded, save_sharded
from tests import models

BATCH = 4


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: str) -> float:
    x, y = (t.to(device) for t in models.make_batch("mlp", step, BATCH))
    loss = models.loss_fn(model, x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def torch_placement(flags: dict, device: str,
                    kind: type = torch.optim.AdamW) -> set[tuple[str, torch.device, torch.dtype]]:
    """``(state key, device, dtype)`` of every state tensor after torch's own
    ``Optimizer.load_state_dict`` restores a stepped ``kind(**flags)`` into a fresh one: the
    reference for where a restored state belongs for these flags."""
    torch.manual_seed(0)
    model = models.MLP().to(device)
    optimizer = kind(model.parameters(), lr=1e-2, **flags)
    _step(model, optimizer, 0, device)
    fresh = kind(model.parameters(), lr=1e-2, **flags)
    fresh.load_state_dict(optimizer.state_dict())
    return {(k, v.device, v.dtype) for state in fresh.state.values() for k, v in state.items()}


def _engine(flags: dict, device: str, kind: type) -> tuple[ZeroEngine, torch.optim.Optimizer, torch.nn.Module]:
    torch.manual_seed(0)
    model = models.MLP()
    engine = ZeroEngine(model, device=device)
    return engine, engine.shard_optimizer(kind(model.parameters(), lr=1e-2, **flags)), model


def resumed_run(flags: dict, device: str, folder: Path, steps: int = 4, at: int = 2,
                kind: type = torch.optim.AdamW) -> dict:
    """Train ``steps`` steps uninterrupted, and again saving after ``at`` steps and resuming into a
    fresh engine and optimizer; returns both runs' losses and the resumed optimizer's
    ``(state key, device, dtype)`` set right after the load."""
    engine, optimizer, model = _engine(flags, device, kind)
    straight = [_step(model, optimizer, s, device) for s in range(steps)]
    engine, optimizer, model = _engine(flags, device, kind)
    first = [_step(model, optimizer, s, device) for s in range(at)]
    save_sharded(engine, [optimizer], folder, {})
    engine, optimizer, model = _engine(flags, device, kind)
    load_sharded(engine, [optimizer], folder)
    placed = {(k, v.device, v.dtype) for state in optimizer.state.values() for k, v in state.items()}
    resumed = first + [_step(model, optimizer, s, device) for s in range(at, steps)]
    return {"straight": straight, "resumed": resumed, "placed": placed}
