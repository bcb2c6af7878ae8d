"""The ``zinf`` command: LightningCLI with the strategy given by name or by class path in YAML."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests import models

ROOT = Path(__file__).resolve().parents[1]
from tests.harness import run_distributed


class TinyLit(L.LightningModule):
    """Records what the CLI built, so the rank can report it."""

    seen: dict = {}

    def __init__(self, hidden: int = 48) -> None:
        super().__init__()
        self.hidden = hidden
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = models.MLP(hidden=self.hidden)

    def training_step(self, batch, batch_idx):
        loss = models.loss_fn(self.model, *batch)
        TinyLit.seen.setdefault("losses", []).append(loss.item())
        return loss

    def on_fit_end(self) -> None:
        strategy = self.trainer.strategy
        TinyLit.seen.update(strategy=type(strategy).__name__, blocks=list(strategy.options.block_classes),
                            bucket=strategy.options.prefetch.bucket_size,
                            tiled=strategy.engine.tiled_layers,
                            compute=sorted({str(g.compute_dtype) for g in strategy.engine.groups}),
                            checkpointed=strategy.engine.checkpointed_modules)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)), batch_size=4)


_TRAINER = """
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
model:
  class_path: tests.test_cli.TinyLit
"""
_BY_NAME = "trainer:\n  strategy: zero_infinity" + _TRAINER
_BY_CLASS_PATH = """trainer:
  strategy:
    class_path: lightning_zinf.ZeroInfinityStrategy
    init_args:
      block_classes: [MLP]
      prefetch: {{bucket_size: 1000}}
      tiling: {{tile_numel: 600}}
      mixed_precision: {{param_dtype: bf16, reduce_dtype: fp32}}
      activation_checkpointing: [Linear]""" + _TRAINER + "  init_args: {{hidden: 32}}\n"


def _zinf_fit(rank: int, world: int, config: str) -> dict:
    from lightning_zinf.cli import main

    main(["fit", "--config", config])
    return TinyLit.seen


@pytest.mark.parametrize("text, blocks, bucket, tiled", [(_BY_NAME, [], 10_000_000, []),
                                                        (_BY_CLASS_PATH, ["MLP"], 1000, ["model.fc2"])],
                         ids=["by-name", "by-class-path"])
def test_zinf_fit_from_yaml(tmp_path: Path, text: str, blocks: list, bucket: int, tiled: list) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text.format(root=tmp_path))
    seen = run_distributed(_zinf_fit, 2, str(config), init_pg=False)[0]
    assert seen["strategy"] == "ZeroInfinityStrategy"
    assert seen["blocks"] == blocks and seen["bucket"] == bucket and seen["tiled"] == tiled
    # The policy and the checkpointed modules from YAML (names and dtype names as strings).
    by_class_path = text is _BY_CLASS_PATH
    assert seen["compute"] == ["torch.bfloat16" if by_class_path else "torch.float32"]
    assert seen["checkpointed"] == (["model.fc1", "model.fc3"] if by_class_path else [])
    assert len(seen["losses"]) == 3 and all(torch.isfinite(torch.tensor(seen["losses"])))


_BAD = """trainer:
  strategy:
    class_path: lightning_zinf.ZeroInfinityStrategy
    init_args:
      {option}
  accelerator: cpu
  devices: 1
  max_steps: 1
  logger: false
model:
  class_path: tests.test_cli.TinyLit
"""


@pytest.mark.parametrize("option, last", [
    # a value a config class refuses when jsonargparse builds it (its own check, buried in the union tree)
    ("prefetch: {bucket_size: -1}", "zinf: error: PrefetchConfig.bucket_size=-1 is invalid: allowed values are an "
                                    "integer >= 0"),
    ("tiling: {tile_numel: 0}", "zinf: error: TilingConfig.tile_numel=0 is invalid: allowed values are an integer > 0"),
    ("state_dict_type: shards", "zinf: error: state_dict_type='shards': use 'sharded'"),
    # a value of the wrong type (jsonargparse's own check against the dataclass field)
    ("zero_pp: {hpz: 3}", "zinf: error: trainer.strategy.init_args.zero_pp.hpz: Expected a <class 'bool'>. Got value: 3"),
    # unknown keys, nested and in the strategy
    ("prefetch: {bucket_sise: 10}", "zinf: error: trainer.strategy.init_args.prefetch.bucket_sise=10: PrefetchConfig "
                                    "has no option 'bucket_sise'; did you mean 'bucket_size' or 'unit_size'?"),
    ("prefech: {bucket_size: 10}", "zinf: error: trainer.strategy.init_args.prefech={'bucket_size': 10}: "
                                   "ZeroInfinityStrategy has no option 'prefech'; did you mean 'prefetch'?"),
], ids=["refused-value", "refused-tiling", "refused-strategy-option", "wrong-type", "unknown-field", "unknown-option"])
def test_a_config_error_ends_with_its_cause(tmp_path: Path, option: str, last: str) -> None:
    """``zinf fit --config bad.yaml``: whatever jsonargparse prints above it (the usage, the tree of
    union members it tried), the last line names the option, the value and what is allowed, and
    the command exits with argparse's status 2, without a traceback."""
    config = tmp_path / "bad.yaml"
    config.write_text(_BAD.format(option=option))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "lightning_zinf.cli", "fit", "--config", str(config)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(last), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
