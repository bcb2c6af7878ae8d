"""Hugging Face checkpoints in: a model folder (sharded safetensors with its index, or
``pytorch_model.bin`` shards) loaded partitioned, against ``from_pretrained`` of the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from lightning_zinf import PrefetchConfig, ZeroEngine, load_full_state_dict
from lightning_zinf.checkpoint import CheckpointError, checkpoint_keys, matching_prefix, provided_parameters
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
