"""Hugging Face checkpoints in: a model folder (sharded safetensors with its index, or
``pytorch_model.bin`` shards) loaded partitioned, against ``from_pretrained`` of the same folder;
one folder per model for a LightningModule holding several (``load_full_weights={prefix: folder}``).
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from lightning_zinf import PrefetchConfig, ZeroEngine, load_full_state_dict
from lightning_zinf.checkpoint import (CheckpointError, checkpoint_keys, load_full_state_dicts, matching_prefix,
                                      provided_parameters)
from lightning_zinf.engine.partition import meta_parameters
from tests.harness import run_distributed

TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def _save_llama_bf16(folder: Path) -> None:
    """A pretrained-looking checkpoint: bf16, sharded in several safetensors files with an index."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")


def _load_partitioned(rank: int, world: int, folder: str) -> dict:
    with meta_parameters():
        model = transformers.LlamaForCausalLM(_llama_config())
    names = provided_parameters(model, checkpoint_keys(folder), "")
    engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0),
                        preloaded=names)
    load_full_state_dict(engine, folder)
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "weights": weights, "preloaded": len(names)}


def test_sharded_bf16_folder_loads_partitioned_exactly(tmp_path: Path) -> None:
    """At 2 ranks: every parameter equals ``from_pretrained(folder, dtype=fp32)``'s bit for bit
    (bf16 values into fp32 exactly), and so do the logits; none was initialised first."""
    _save_llama_bf16(tmp_path)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    want = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        want_logits = want(input_ids=TOKENS).logits
    ranks = run_distributed(_load_partitioned, 2, str(tmp_path))
    for got in ranks:
        assert got["preloaded"] == len(list(want.parameters()))
        for name, value in want.named_parameters():
            assert got["weights"][name].dtype == torch.float32 and torch.equal(got["weights"][name], value), name
        torch.testing.assert_close(got["logits"], want_logits, rtol=1e-5, atol=1e-5)


def test_sharded_bin_folder_and_tied_weights_load(tmp_path: Path) -> None:
    """A GPT-2 saved as ``pytorch_model-0000k-of-0000n.bin`` shards with their index, its tied
    ``lm_head`` left out as ``transformers`` leaves it out, loads strictly."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    eager = transformers.GPT2LMHeadModel(config)
    state = {k: v for k, v in eager.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state[k] for k in part}, tmp_path / name)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with meta_parameters():
        model = transformers.GPT2LMHeadModel(config)
    engine = ZeroEngine(model, block_classes=["GPT2Block"])
    assert load_full_state_dict(engine, tmp_path) == []
    with engine.gathered():
        for name, value in eager.named_parameters():
            assert torch.equal(dict(model.named_parameters())[name], value), name
    assert model.lm_head.weight is model.transformer.wte.weight


def test_bad_folders_and_keys_name_the_problem(tmp_path: Path) -> None:
    _save_llama_bf16(tmp_path / "llama")
    with meta_parameters():
        model = transformers.LlamaForCausalLM(_llama_config())
    engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds none of model.safetensors.index.json"):
        load_full_state_dict(engine, tmp_path / "empty")
    index = json.loads((tmp_path / "llama" / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "llama" / first).rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match=f"names shard files that are not there: .*{first}"):
        load_full_state_dict(engine, tmp_path / "llama")
    (tmp_path / "moved").rename(tmp_path / "llama" / first)
    with pytest.raises(CheckpointError, match=r"under prefix 'nothing.': missing \[\], unexpected \['lm_head.weight'"):
        load_full_state_dict(engine, tmp_path / "llama", prefix="nothing.")
    assert matching_prefix(model, checkpoint_keys(tmp_path / "llama")) == ""
    with pytest.raises(ValueError, match=r"The prefixes 'model\.' and 'model\.layers\.0\.' overlap"):
        load_full_state_dicts(engine, {"model.": tmp_path / "llama", "model.layers.0.": tmp_path / "llama"})


def _lora_from_folder(rank: int, world: int, folder: str) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:  # the whole model on the meta device: the checkpoint fills the base
                base = transformers.LlamaForCausalLM(_llama_config())
                self.model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

        def val_dataloader(self):
            return DataLoader(TensorDataset(TOKENS.repeat(world, 1)[rank::world]), batch_size=2)

    strategy = ZeroInfinityStrategy(block_classes=["LlamaDecoderLayer"], load_full_weights=folder)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    lit = Lit()
    loss = trainer.validate(lit, verbose=False)[0]["val_loss"]
    with trainer.strategy.gathered_parameters():
        lora_b = [p.detach().clone() for n, p in lit.named_parameters() if "lora_B" in n]
    return {"loss": loss, "lora_b": lora_b, "prefix": matching_prefix(lit, checkpoint_keys(folder))}


def test_strategy_loads_a_folder_under_a_peft_model_built_in_configure_model(tmp_path: Path) -> None:
    """``ZeroInfinityStrategy(load_full_weights=folder)`` with a PEFT LoRA model built wholly on
    the meta device: the base comes from the folder (the prefix found by itself, through PEFT's
    ``base_layer``), the adapters get PEFT's init, so the loss is ``from_pretrained``'s own."""
    _save_llama_bf16(tmp_path)
    want = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        want_loss = want(input_ids=TOKENS, labels=TOKENS).loss.item()
    got = run_distributed(_lora_from_folder, 2, str(tmp_path), init_pg=False)[0]
    assert got["prefix"] == "model.base_model.model."
    assert len(got["lora_b"]) == 4 and all(torch.equal(b, torch.zeros_like(b)) for b in got["lora_b"])
    assert abs(got["loss"] - want_loss) < 1e-5


# --- several pretrained models in one LightningModule: load_full_weights={prefix: folder} ------------------
def _save_reward_fp32(folder: Path) -> None:
    """A reward model's checkpoint: a one-label sequence classifier over the same Llama config, other
    values (seed 1), fp32 in one safetensors file."""
    torch.manual_seed(1)
    transformers.LlamaForSequenceClassification(_llama_config_rm()).save_pretrained(folder)


def _llama_config_rm() -> transformers.LlamaConfig:
    config = _llama_config()
    config.num_labels, config.pad_token_id = 1, 0
    return config


def _head() -> torch.nn.Linear:
    """A module under no prefix, built with real values in ``__init__``: the load must leave it as it is."""
    torch.manual_seed(5)
    return torch.nn.Linear(4, 4)


def _actor_and_reward(rank: int, world: int, cases: dict) -> dict:
    """Each of ``cases`` (name -> ``load_full_weights``) through a Trainer at ``world`` ranks: the
    gathered parameters after ``validate``, or the message of the error raised."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = _head()
            self.actor = self.reward = None

        def configure_model(self) -> None:
            if self.actor is None:  # on the meta device: the checkpoints fill the actor's base and the reward model
                base = transformers.LlamaForCausalLM(_llama_config())
                self.actor = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
                self.reward = transformers.LlamaForSequenceClassification(_llama_config_rm())

        def validation_step(self, batch, batch_idx):
            loss = self.actor(input_ids=batch[0], labels=batch[0]).loss + self.reward(input_ids=batch[0]).logits.sum()
            self.log("val_loss", loss, sync_dist=True)

        def val_dataloader(self):
            return DataLoader(TensorDataset(TOKENS.repeat(world, 1)[rank::world]), batch_size=2)

    seen = {}
    for name, weights in cases.items():
        try:
            strategy = ZeroInfinityStrategy(block_classes=["LlamaDecoderLayer"], load_full_weights=weights)
            trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
            lit = Lit()
            trainer.validate(lit, verbose=False)
            with trainer.strategy.gathered_parameters():
                seen[name] = {n: p.detach().clone() for n, p in lit.named_parameters()}
        except ValueError as error:  # CheckpointError included
            seen[name] = f"{type(error).__name__}: {error}"
    return seen


def test_strategy_loads_each_model_from_its_own_folder(tmp_path: Path) -> None:
    """``load_full_weights={"actor": sft_folder, "reward.": rm_folder}`` at 2 ranks through the
    Trainer: the PEFT actor's base equals ``from_pretrained(sft_folder)`` and the reward model
    ``from_pretrained(rm_folder)``, bit for bit, on every rank (the actor's prefix found inside
    ``actor``, through PEFT's ``base_model.model.`` and ``base_layer``); the adapters keep PEFT's
    init and the module under no prefix its values."""
    _save_llama_bf16(tmp_path / "sft")
    _save_reward_fp32(tmp_path / "rm")
    want_actor = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sft", dtype=torch.float32)
    want_reward = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32)
    weights = {"actor": str(tmp_path / "sft"), "reward.": str(tmp_path / "rm")}
    ranks = run_distributed(_actor_and_reward, 2, {"both": weights}, init_pg=False)
    head = _head()
    for got in ranks:
        got = got["both"]
        assert not isinstance(got, str), got
        base = {n[len("actor.base_model.model."):].replace(".base_layer.", "."): v for n, v in got.items()
                if n.startswith("actor.") and "lora_" not in n}
        assert sorted(base) == sorted(n for n, _ in want_actor.named_parameters())
        for name, value in want_actor.named_parameters():
            assert base[name].dtype == torch.float32 and torch.equal(base[name], value), name
        reward = {n[len("reward."):]: v for n, v in got.items() if n.startswith("reward.")}
        assert sorted(reward) == sorted(n for n, _ in want_reward.named_parameters())
        for name, value in want_reward.named_parameters():
            assert torch.equal(reward[name], value), name
        lora_b = [v for n, v in got.items() if "lora_B" in n]
        assert len(lora_b) == 4 and all(torch.equal(b, torch.zeros_like(b)) for b in lora_b)
        assert torch.equal(got["head.weight"], head.weight) and torch.equal(got["head.bias"], head.bias)


def test_bad_weight_prefixes_are_refused_on_every_rank(tmp_path: Path) -> None:
    """At 2 ranks through the Trainer, each rank raises the same error, naming the problem: a
    prefix that names no submodule (listing the top-level ones), a checkpoint none of whose keys
    names a parameter under its prefix, overlapping prefixes (both named), a mapping with
    ``load_prefix``."""
    _save_llama_bf16(tmp_path / "sft")
    _save_reward_fp32(tmp_path / "rm")
    sft, rm = str(tmp_path / "sft"), str(tmp_path / "rm")
    cases = {"no-module": {"actr.": sft, "reward.": rm}, "no-key": {"actor.": sft, "head": rm},
             "overlap": {"actor.": sft, "actor.base_model": rm}, "same": {"reward": sft, "reward.": rm}}
    ranks = run_distributed(_actor_and_reward, 2, cases, init_pg=False)
    assert ranks[0] == ranks[1]
    seen = ranks[0]
    assert seen["no-module"] == ("CheckpointError: load_full_weights: the prefix 'actr.' names no submodule of Lit; "
                                 "its top-level submodules are ['head', 'actor', 'reward'].")
    assert seen["no-key"].startswith(f"CheckpointError: load_full_weights['head.']={rm!r}: none of its keys "), seen
    assert "names a parameter or buffer of 'head.' (Linear)" in seen["no-key"]
    assert seen["overlap"].startswith("ValueError: load_full_weights: the prefixes 'actor.' and 'actor.base_model' "
                                      "overlap"), seen
    assert seen["same"].startswith("ValueError: load_full_weights: the prefixes 'reward' and 'reward.' overlap"), seen


def test_weight_mapping_options_outside_a_run(tmp_path: Path) -> None:
    """The mapping's checks at construction, for the Fabric strategy too, and the YAML form: a
    ``zinf`` config's ``load_full_weights`` mapping (dotted keys) reaches the strategy normalised."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_zinf import ZeroInfinityFabricStrategy, ZeroInfinityStrategy
    from lightning_zinf.cli import _Parser

    for cls in (ZeroInfinityStrategy, ZeroInfinityFabricStrategy):
        with pytest.raises(ValueError, match=r"the prefixes 'a\.' and 'a\.b' overlap"):
            cls(load_full_weights={"a.": "x", "a.b": "y"})
        with pytest.raises(ValueError, match=r"the prefixes '' and 'a' overlap"):
            cls(load_full_weights={"": "x", "a": "y"})
        with pytest.raises(ValueError, match=r"load_prefix='model\.' cannot be combined"):
            cls(load_full_weights={"a.": "x"}, load_prefix="model.")
        with pytest.raises(ValueError, match=r"load_full_weights=\{\}"):
            cls(load_full_weights={})
        assert cls(load_full_weights="x").options.load_full_weights == "x"
    config = tmp_path / "config.yaml"
    config.write_text(f"""trainer:
  strategy:
    class_path: lightning_zinf.ZeroInfinityStrategy
    init_args:
      load_full_weights: {{actor: {tmp_path}/sft, "reward.": {tmp_path}/rm/model.safetensors}}
  accelerator: cpu
  devices: 1
  logger: false
model:
  class_path: tests.test_cli.TinyLit
""")
    cli = LightningCLI(args=["--config", str(config)], run=False, parser_class=_Parser)
    assert cli.trainer.strategy.options.load_full_weights == {"actor.": f"{tmp_path}/sft",
                                                               "reward.": f"{tmp_path}/rm/model.safetensors"}
    config.write_text(config.read_text().replace(f"{{actor: {tmp_path}/sft, \"reward.\": {tmp_path}/rm/model.safetensors}}",
                                                 f"{tmp_path}/sft"))
    cli = LightningCLI(args=["--config", str(config)], run=False, parser_class=_Parser)
    assert cli.trainer.strategy.options.load_full_weights == f"{tmp_path}/sft"
