"""Bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import importlib

import lightning.pytorch as L
import pytest
import torch
from torch import nn

import lightning_zinf
from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroInfinityStrategy, meta_parameters
from tests import models


def test_unknown_strategy_option() -> None:
    with pytest.raises(TypeError, match="prefech"):
        ZeroInfinityStrategy(prefech={"bucket_size": 10})  # type: ignore[call-arg]


def test_unknown_prefetch_field_suggests_the_right_one() -> None:
    with pytest.raises(ValueError, match="no option 'bucket_sise'.*Did you mean 'bucket_size'"):
        ZeroInfinityStrategy(prefetch={"bucket_sise": 10})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, field", [({"bucket_size": -1}, "bucket_size"), ({"persistence_threshold": 1.5}, "persistence_threshold"),
                      ({"persistence_limit": -1}, "persistence_limit"), ({"enabled": "yes"}, "enabled")]
)
def test_invalid_prefetch_value_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"PrefetchConfig\.{field}=.*allowed values are"):
        PrefetchConfig(**kwargs)


def test_unknown_preset_name() -> None:
    with pytest.raises(ValueError, match="zero_infinty"):
        L.Trainer(strategy="zero_infinty", accelerator="cpu", devices=2)


def test_registration_is_idempotent() -> None:
    importlib.reload(lightning_zinf)
    importlib.reload(lightning_zinf)
    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy).__name__ == "ZeroInfinityStrategy"


def test_unsupported_precision() -> None:
    with pytest.raises(TypeError, match="does not support DoublePrecision.*32-true"):
        L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, precision="64-true")


def test_model_without_parameters() -> None:
    with pytest.raises(ValueError, match="has no parameters to partition"):
        ZeroEngine(nn.Sequential(nn.ReLU(), nn.Dropout()))


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, device="meta"))  # no values to record, no route to make them


def test_meta_module_without_reset_parameters() -> None:
    """A parameter the model itself makes on the meta device is not recorded (there is nothing to
    record); with no ``reset_parameters()`` either, the engine refuses it by name."""
    with meta_parameters():
        model = nn.Sequential(nn.Linear(4, 4), _NoReset())
    with pytest.raises(ValueError, match=r"Module '1' \(_NoReset\).*no initialisation route.*\(scale\).*no `reset_parameters\(\)`"):
        ZeroEngine(model)


def test_non_elementwise_optimizer() -> None:
    model = models.MLP()
    engine = ZeroEngine(model)
    with pytest.raises(ValueError, match="LBFGS is not an elementwise optimizer"):
        engine.shard_optimizer(torch.optim.LBFGS(model.parameters()))


def test_optimizer_over_foreign_tensor() -> None:
    model = models.MLP()
    engine = ZeroEngine(model)
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(3,\) that is not a parameter of the partitioned model"):
        engine.shard_optimizer(torch.optim.SGD([*model.parameters(), stray], lr=0.1))


def test_unsharded_optimizer_is_refused_at_its_step() -> None:
    """An optimizer over the partitioned parameters that was never given to ``shard_optimizer``
    steps empty tensors without gradients: the loss would stay where it is, with no error."""
    torch.manual_seed(0)
    model = models.MLP()
    engine = ZeroEngine(model)
    unsharded = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD optimizer steps the partitioned model's own parameters.*"
                                           r"engine.shard_optimizer\(optimizer\)"):
        unsharded.step()
    # Optimizers over other tensors, and the sharded one, are left alone.
    other = nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.5).step()
    assert torch.equal(other.detach(), torch.full((3,), 0.5))
    sharded = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with engine.gathered():
        before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 16)).sum().backward()
    sharded.step()
    with engine.gathered():
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # add_param_group takes the model's parameters (engine/sharded.py): one already held is
    # refused as plain torch refuses it.
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        sharded.add_param_group({"params": [next(model.parameters())]})


def test_bad_block_class_entry() -> None:
    with pytest.raises(ValueError, match=r"block_classes entries must be module classes or class names, got 3 \(int\)"):
        ZeroEngine(models.GPT(), block_classes=[3])  # type: ignore[list-item]
    model = models.GPT()
    with pytest.raises(ValueError, match=r"got a module instance \(Block\); pass its class, block_classes=\[Block\]"):
        ZeroEngine(model, block_classes=[model.blocks[0]])  # type: ignore[list-item]


def test_block_class_matching_no_module_is_named() -> None:
    """A typo in ``block_classes`` would silently leave every module its own unit (DeepSpeed's
    ``set_z3_leaf_modules`` raises too)."""
    with pytest.raises(ValueError, match=r"\['Blok'\] match no module of GPT .*Block"):
        ZeroEngine(models.GPT(), block_classes=["Block", "Blok"])
