"""Where a user's code meets the strategies as it meets Lightning's own sharded strategies (FSDP,
DeepSpeed, ModelParallel): ``trainer.init_module``, the model summary at fit start, ``sync_batchnorm``,
plugins the strategies cannot use, Fabric calls given the wrong module, the warning for a model
that checkpoints its own activations, and the exception types users catch. Real Trainer and Fabric
runs on CPU/gloo processes (tests/harness.py); two ranks where the partition shows.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as LightningSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import ShardedModelSummary, ZeroInfinityFabricStrategy, ZeroInfinityStrategy
from tests import models
from tests.harness import run_distributed
from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer


def _plain_summary(max_depth: int) -> LightningSummary:
    """Lightning's own summary of the unpartitioned model: the numbers the strategy must show."""
    lit = LitGPT(GLOBAL_BATCH)
    lit.model = models.GPT()
    return LightningSummary(lit, max_depth=max_depth)


# --- trainer.init_module and the model summary ---------------------------------------------------
def _init_module_rank(rank: int, world: int) -> dict:
    from rich import get_console

    # No unit stays gathered between steps (by default this small model's would all be persistent).
    def strategy() -> ZeroInfinityStrategy:
        return ZeroInfinityStrategy(prefetch={"persistence_threshold": 0})

    short = {"max_steps": 3, "limit_val_batches": 0}
    built_in_hook = LitGPT(GLOBAL_BATCH // world)
    _trainer(strategy(), world, **short).fit(built_in_hook)

    trainer = _trainer(strategy(), world, enable_model_summary=True, **short)  # Lightning's default summary
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trainer.init_module(empty_init=True):
            torch.manual_seed(0)
            lit = LitGPT(GLOBAL_BATCH // world)
            lit.model = models.GPT()
    on_meta = [p.is_meta for p in lit.parameters()]
    with trainer.init_module(empty_init=False):
        real = [not p.is_meta for p in models.GPT().parameters()]
    with trainer.init_module():
        default = [p.is_meta for p in models.GPT().parameters()]

    with get_console().capture() as printed:
        trainer.fit(lit)
    callback = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))
    summary = callback._summary(trainer, lit)  # the summary the callback built (and printed) at fit start
    layers = ShardedModelSummary(lit, max_depth=-1)
    return {
        "warnings": [str(w.message) for w in caught], "on_meta": on_meta, "real": real, "default": default,
        "losses": lit.train_losses, "hook_losses": built_in_hook.train_losses,
        "printed": printed.get(), "summary_type": type(summary).__name__,
        "total": summary.total_parameters, "trainable": summary.trainable_parameters,
        "names": layers.layer_names, "layer_params": layers.param_nums, "per_device": layers.parameters_per_device,
        "resident": sum(p.numel() for p in lit.parameters()),
    }


@pytest.fixture(scope="module")
def init_module_runs() -> list[dict]:
    return run_distributed(_init_module_rank, 2, init_pg=False)


def test_init_module_builds_on_meta_and_trains_as_configure_model(init_module_runs: list[dict]) -> None:
    """``trainer.init_module(empty_init=True)`` puts the parameters on the meta device (nothing of
    the model allocated on any rank), without Lightning's warning that the strategy cannot support
    it, and the model trains exactly as the same model built in ``configure_model``: partitioned
    at setup, initialised unit by unit by ``reset_parameters()``. ``empty_init=False`` builds real
    tensors; the default (``None``) is the meta device, as for ``configure_model``."""
    for rank in init_module_runs:
        assert rank["on_meta"] and all(rank["on_meta"])
        assert all(rank["real"])
        assert all(rank["default"])
        assert not [w for w in rank["warnings"] if "init_module" in w], rank["warnings"]
        assert len(rank["losses"]) == len(rank["hook_losses"]) > 0
        assert rank["losses"] == rank["hook_losses"]


def test_model_summary_counts_partitioned_parameters_at_full_size(init_module_runs: list[dict]) -> None:
    """The summary Lightning prints at fit start shows the model's real size, not the few elements
    resident on rank 0; per layer it matches Lightning's summary of the unpartitioned model, and
    "Params per Device" (this rank's shards) adds up over the ranks to each layer's count."""
    plain, layers = _plain_summary(max_depth=1), _plain_summary(max_depth=-1)
    zero, one = init_module_runs
    assert zero["resident"] < plain.total_parameters // 10  # what Lightning alone would have counted
    for rank in init_module_runs:
        assert rank["summary_type"] == "ShardedModelSummary"
        assert rank["total"] == plain.total_parameters
        assert rank["trainable"] == plain.trainable_parameters
        assert rank["names"] == layers.layer_names
        assert rank["layer_params"] == layers.param_nums
    assert [a + b for a, b in zip(zero["per_device"], one["per_device"])] == layers.param_nums
    assert 0 < zero["per_device"][0] < layers.param_nums[0]
    printed = " ".join(zero["printed"].split())
    assert f"Total params: {get_human_readable_count(plain.total_parameters).strip()}" in printed
    assert "Params per Device" in printed


# --- sync_batchnorm, activation checkpointing ------------------------------------------------------
class _BatchNormNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8))

    def training_step(self, batch, batch_idx):
        return models.loss_fn(self.net, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([models.make_batch("mlp", i, 4) for i in range(2)], batch_size=None)


def _sync_batchnorm_rank(rank: int, world: int) -> str:
    lit = _BatchNormNet()
    # No batches: torch's SyncBatchNorm refuses to train on CPU once a process group exists.
    L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, sync_batchnorm=True,
              limit_train_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(lit)
    return type(lit.net[1]).__name__


def test_sync_batchnorm_converts_the_batch_norm_layers() -> None:
    """``Trainer(sync_batchnorm=True)`` is applied (as Lightning's FSDP strategy does), not ignored:
    the model is partitioned with ``SyncBatchNorm`` layers."""
    assert run_distributed(_sync_batchnorm_rank, 2, init_pg=False) == ["SyncBatchNorm"] * 2


class _SelfCheckpointingGPT(LitGPT):
    """Wraps its blocks in torch's ``CheckpointWrapper`` itself."""

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            apply_activation_checkpointing(self.model, check_fn=lambda m: isinstance(m, models.Block))


def _already_checkpointed_rank(rank: int, world: int) -> dict:
    lit = _SelfCheckpointingGPT(GLOBAL_BATCH // world)
    trainer = _trainer(ZeroInfinityStrategy(activation_checkpointing=["Block"]), world, max_steps=2,
                       limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit)
    return {"warnings": [str(w.message) for w in caught], "losses": lit.train_losses,
            "wrapped_by_strategy": [n for n, m in lit.named_modules() if getattr(m, "_zinf_checkpointed", False)]}


def test_activation_checkpointing_option_on_a_model_that_checkpoints_itself_warns() -> None:
    """As Lightning's FSDP strategies: the model's own checkpointed layers are kept and the
    strategy's ``activation_checkpointing`` is ignored, with a warning (recomputing inside a
    recomputation would run those forwards three times)."""
    result = run_distributed(_already_checkpointed_rank, 1, init_pg=False)[0]
    assert any("already contains checkpointed layers" in w and "model.blocks.0" in w for w in result["warnings"])
    assert result["wrapped_by_strategy"] == []
    assert len(result["losses"]) == 2


# --- plugins the strategies cannot use, and the exception types -----------------------------------
def test_checkpoint_io_plugins_are_refused() -> None:
    """Checkpoints are written shard by shard on every rank, so a ``CheckpointIO`` plugin would never
    be called: it is refused when the Trainer or Fabric is built (in every process), with the type
    Lightning Fabric's FSDP and ModelParallel strategies raise."""
    with pytest.raises(NotImplementedError, match="does not use a CheckpointIO plugin.*TorchCheckpointIO"):
        L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, plugins=[TorchCheckpointIO()], logger=False)
    with pytest.raises(NotImplementedError, match="does not use a CheckpointIO plugin"):
        ZeroInfinityStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(NotImplementedError, match="does not use a CheckpointIO plugin"):
        Fabric(strategy="zero_infinity", accelerator="cpu", devices=2, plugins=[TorchCheckpointIO()])
    with pytest.raises(NotImplementedError, match="does not use a CheckpointIO plugin"):
        ZeroInfinityFabricStrategy(checkpoint_io=TorchCheckpointIO())
    # Lightning still deletes old checkpoints through the default one.
    assert type(ZeroInfinityStrategy().checkpoint_io) is TorchCheckpointIO


def _fabric_teardown_rank(rank: int, world: int) -> str:
    fabric = Fabric(accelerator="cpu", devices=world, strategy="zero_infinity")
    fabric.launch()
    with fabric.init_module():
        model = models.GPT()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(NotImplementedError) as error:
        fabric.strategy.checkpoint_io
    fabric.strategy.teardown()  # which tears down no CheckpointIO
    return str(error.value)


def test_fabric_strategy_has_no_checkpoint_io() -> None:
    """The Fabric strategy's ``checkpoint_io`` raises ``NotImplementedError``, as Lightning's Fabric
    ``FSDPStrategy`` does (it returned Fabric's default plugin, which nothing calls), and its
    teardown needs none."""
    message = run_distributed(_fabric_teardown_rank, 1, init_pg=False)[0]
    assert "ZeroInfinityFabricStrategy` does not use the `CheckpointIO` plugin interface" in message


@pytest.mark.parametrize("build", [
    lambda: L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, precision="64-true", logger=False),
    lambda: Fabric(strategy="zero_infinity", accelerator="cpu", devices=2, precision="64-true"),
], ids=["trainer", "fabric"])
def test_unsupported_precision_is_a_value_error_and_a_type_error(build) -> None:
    """Lightning's sharded strategies raise ``ValueError`` for an unsupported ``precision=`` string
    (and FSDP ``TypeError`` for a plugin of another class): code written for either catches it."""
    with pytest.raises(ValueError, match="does not support DoublePrecision") as error:
        build()
    assert isinstance(error.value, TypeError)


def _wrong_modules_rank(rank: int, world: int) -> list[str]:
    def fabric() -> Fabric:
        f = Fabric(accelerator="cpu", devices=world, strategy="zero_infinity")
        f.launch()
        return f

    first = fabric()
    with first.init_module():
        other = models.GPT()
    other, _ = first.setup(other, torch.optim.AdamW(other.parameters()))
    second = fabric()
    with second.init_module():
        model = models.GPT()
    model, optimizer = second.setup(model, torch.optim.AdamW(model.parameters()))
    second.backward(models.loss_fn(model, *models.make_batch("gpt", 0, 2)))
    messages = []
    for call in (lambda: second.no_backward_sync(other),
                 lambda: second.clip_gradients(model.blocks[0], optimizer, max_norm=1.0)):
        with pytest.raises(TypeError) as error:
            with call():
                pass
        messages.append(str(error.value))
    with second.no_backward_sync(other, enabled=False), second.no_backward_sync(model):
        pass  # the model this strategy set up, or nothing blocked: accepted
    assert second.clip_gradients(model, optimizer, max_norm=1.0) > 0
    return messages


def test_fabric_calls_given_a_module_this_strategy_did_not_set_up_raise_type_error() -> None:
    """``fabric.no_backward_sync`` and ``fabric.clip_gradients`` act on the engine's shards, which
    belong to the model it set up: given another model (here one set up by another Fabric) or a
    submodule, they raise ``TypeError`` as Lightning's FSDP strategy does, instead of acting on
    the wrong model."""
    sync, clip = run_distributed(_wrong_modules_rank, 1, init_pg=False)[0]
    assert "Blocking backward sync (fabric.no_backward_sync) is only possible with the module set up" in sync
    assert "Got: GPT" in sync
    assert "Gradient clipping (fabric.clip_gradients) is only possible" in clip and "Got: Block" in clip


def _fabric_clip_by_value_rank(rank: int, world: int, nvme: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=ZeroInfinityFabricStrategy(
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": nvme}))
    fabric.launch()
    with fabric.init_module():
        model = models.GPT()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    fabric.backward(models.loss_fn(model, *models.make_batch("gpt", 0, 2)))
    with pytest.raises(NotImplementedError) as error:
        fabric.clip_gradients(model, optimizer, clip_val=0.1)
    return {"message": str(error.value), "value_error": isinstance(error.value, ValueError)}


def test_fabric_clipping_by_value_with_gradients_on_disk_raises_as_deepspeed(tmp_path) -> None:
    """With the gradients in swap files until the step a clamp would do nothing: refused with the
    type Lightning Fabric's DeepSpeed strategy raises for clipping it cannot do (and a ``ValueError``,
    as before)."""
    result = run_distributed(_fabric_clip_by_value_rank, 1, str(tmp_path), init_pg=False)[0]
    assert "use fabric.clip_gradients(max_norm=...)" in result["message"]
    assert result["value_error"]
