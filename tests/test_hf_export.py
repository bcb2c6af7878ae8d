"""Hugging Face folders out of a sharded checkpoint: ``from_pretrained`` and
``PeftModel.from_pretrained`` load them with nothing missing or unexpected, and compute the logits
of the partitioned model that was saved."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.checkpoint import CheckpointError, save_sharded
from lightning_zinf.engine.partition import meta_parameters
from lightning_zinf.hf_export import export_peft_adapters, export_pretrained
from lightning_zinf.hf_export import main as hf_export_main
from tests.harness import run_distributed

TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(5))


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def _save(rank: int, world: int, path: str) -> torch.Tensor:
    torch.manual_seed(0)
    with meta_parameters():
        model = transformers.LlamaForCausalLM(_config())
    engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0))
    save_sharded(engine, [], Path(path), {})
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def test_export_pretrained_loads_strictly_with_the_saved_models_logits(tmp_path: Path) -> None:
    """From a 2-rank checkpoint: sharded safetensors with their index and config.json; a tied
    Llama loads with no missing, unexpected or mismatched key, and gives the partitioned model's
    logits; in bf16 every value is the fp32 value rounded."""
    logits = run_distributed(_save, 2, str(tmp_path / "ckpt"))[0]
    out = export_pretrained(tmp_path / "ckpt", tmp_path / "hf", config=_config(), max_shard_size="150KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "model.embed_tokens.weight" in index["weight_map"]
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKENS).logits, logits, rtol=1e-5, atol=1e-5)
    half = export_pretrained(tmp_path / "ckpt", tmp_path / "bf16", config=_config(), dtype=torch.bfloat16)
    assert not (half / "model.safetensors.index.json").exists() and (half / "model.safetensors").is_file()
    bf16 = transformers.LlamaForCausalLM.from_pretrained(half, dtype=torch.bfloat16)
    for name, value in model.named_parameters():
        assert torch.equal(dict(bf16.named_parameters())[name], value.to(torch.bfloat16)), name
    _config().save_pretrained(tmp_path / "pretrained")
    hf_export_main([str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--config", str(tmp_path / "pretrained")])
    cli = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "cli", dtype=torch.float32)
    for name, value in model.named_parameters():
        assert torch.equal(dict(cli.named_parameters())[name], value), name
    with pytest.raises(CheckpointError, match="holds no tensor under strip_prefix='nope.'"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "x", config=_config(), strip_prefix="nope.")
    with pytest.raises(ValueError, match="max_shard_size='big'"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "x", config=_config(), max_shard_size="big")


def test_export_peft_adapters_loads_into_peft_with_the_trained_adapters(tmp_path: Path) -> None:
    """A LoRA model partitioned with its adapters edited (as training would): the adapters-only
    folder loads with ``PeftModel.from_pretrained`` on the same base and gives the same logits."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_config())
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with meta_parameters():
        model = peft.get_peft_model(base, lora)
    engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"])
    with engine.gathered(write_back=True), torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    with torch.no_grad():
        want = model(input_ids=TOKENS).logits
    save_sharded(engine, [], tmp_path / "ckpt", {})
    out = export_peft_adapters(tmp_path / "ckpt", tmp_path / "adapters", peft_config=model.peft_config["default"])
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    fresh = transformers.LlamaForCausalLM(_config())
    fresh.load_state_dict(base_state)
    loaded = peft.PeftModel.from_pretrained(fresh, out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=TOKENS).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="no LoRA tensor of adapter 'other'"):
        export_peft_adapters(tmp_path / "ckpt", tmp_path / "y", peft_config=lora, adapter_name="other")
