"""Models built on the meta device (``configure_model``) get their library's own initialisation,
and values that were real at construction are never overwritten.

References are independent of the engine: the same ``transformers`` model built eagerly (its
``post_init`` applies ``_init_weights`` to every module), and the base model's own forward.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.engine.partition import meta_parameters


def _llama_config():
    return transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02)


def _gathered(model: nn.Module, engine: ZeroEngine) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch, units", [("llama", "blocks"), ("gpt2", "blocks"), ("gpt2", "modules")])
def test_transformers_model_built_on_meta_gets_its_own_init(arch: str, units: str) -> None:
    """A Llama (``LlamaRMSNorm`` has no ``reset_parameters``) and a GPT-2 (``Conv1D``, tied
    embeddings, c_proj scaled by 1/sqrt(2 n_layer) at the block level) built on the meta device
    come out with the values of the same model built eagerly from the same seed, bit for bit, with
    blocks as units and with the default unit per module (where the attention and MLP modules that scale
    their c_proj hold no parameters of their own, and their children are units of their own)."""
    if arch == "llama":
        config, cls = _llama_config(), transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=512, n_embd=256, n_layer=3, n_head=4, n_positions=64)
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    eager = cls(config)
    torch.manual_seed(0)
    with meta_parameters():
        model = cls(config)
    block = ["LlamaDecoderLayer"] if arch == "llama" else ["GPT2Block"]
    engine = ZeroEngine(model, block_classes=block if units == "blocks" else (),
                        prefetch=PrefetchConfig(persistence_threshold=0))
    got = _gathered(model, engine)
    want = dict(eager.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():  # the model's own post_init, recorded and replayed: eager's values
        assert torch.equal(got[name], value.detach()), name
    if arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
        for where in ("attn", "mlp"):
            c_proj = got[f"transformer.h.0.{where}.c_proj.weight"].std()
            assert abs(c_proj / (0.02 / (2 * 3) ** 0.5) - 1) < 0.05
    tokens = torch.randint(0, 512, (2, 16))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_peft_lora_added_on_meta_keeps_the_real_base_and_peft_init() -> None:
    """The base model built with real values (``__init__``, or loaded), LoRA adapters added by
    ``get_peft_model`` inside the meta context (``configure_model``): the base weights are
    partitioned from their values, bit for bit; ``lora_B`` is PEFT's zeros and ``lora_A`` PEFT's
    kaiming-uniform, so step 0 computes exactly the base model's logits."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_llama_config())
    with torch.no_grad():  # values no init route would produce
        for p in base.parameters():
            p.add_(0.5)
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        want_logits = base(input_ids=tokens).logits
    with meta_parameters():
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert any(p.is_meta for p in model.parameters())
    engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0))
    got = _gathered(model, engine)
    prefix = "base_model.model."
    for name, value in original.items():
        key = prefix + name.replace(".q_proj.", ".q_proj.base_layer.").replace(".v_proj.", ".v_proj.base_layer.")
        assert torch.equal(got[key], value), key
    lora_a = [v for n, v in got.items() if "lora_A" in n]
    lora_b = [v for n, v in got.items() if "lora_B" in n]
    assert len(lora_a) == len(lora_b) == 4
    assert all(torch.equal(b, torch.zeros_like(b)) for b in lora_b)
    bound = 1 / lora_a[0].shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    assert all(a.abs().max() <= bound and a.std() > bound / 3 for a in lora_a)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, want_logits)


def test_real_module_beside_meta_modules_keeps_its_values() -> None:
    """In a model mixing real and meta modules only the meta ones are initialised (a meta
    parameter that no route initialises is an error naming its module: test_errors.py)."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.real = nn.Linear(8, 8)

    torch.manual_seed(0)
    model = Mixed()
    before = model.real.weight.detach().clone()
    with meta_parameters():
        model.added = nn.Linear(8, 4)
    ZeroEngine(model)
    assert not any(p.is_meta for p in model.parameters())
    engine = model._zinf_engine
    with engine.gathered():
        assert torch.equal(model.real.weight, before)
        assert not model.added.weight.isnan().any() and model.added.weight.std() > 0


def _lora_through_the_trainer(rank: int, world: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.base = transformers.LlamaForCausalLM(_llama_config())
            self.model: nn.Module | None = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = peft.get_peft_model(self.base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

        def _loss(self, batch):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

        def train_dataloader(self):
            tokens = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(tokens[rank::world]), batch_size=8 // world)

        val_dataloader = train_dataloader

    lit = Lit()
    with torch.no_grad():  # the base model's own loss on the validation data, before any wrapping
        tokens = torch.randint(0, 512, (8, 16), generator=torch.Generator().manual_seed(1))
        base_loss = lit.base(input_ids=tokens, labels=tokens).loss.item()
    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    before = trainer.validate(lit, verbose=False)[0]["val_loss"]
    trainer.fit(lit)
    return {"base_loss": base_loss, "before": before, "losses": lit.losses}


def test_peft_wrapped_in_configure_model_starts_from_the_base_model_through_the_trainer() -> None:
    """The way docs/huggingface.md shows, at 2 ranks through the Trainer: before training, the LoRA model's
    validation loss is the base model's own (nothing re-initialised, ``lora_B`` zero), and
    fine-tuning lowers the loss."""
    from tests.harness import run_distributed

    got = run_distributed(_lora_through_the_trainer, 2, init_pg=False)[0]
    assert abs(got["before"] - got["base_loss"]) < 1e-5
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("neox_init", [False, True], ids=["reset_parameters", "pretrain-initialize_weights"])
def test_litgpt_model_gets_torchs_init_not_a_transformers_one(neox_init: bool) -> None:
    """LitGPT's ``GPT`` has a ``config`` and an ``_init_weights`` but is not a ``transformers``
    model: built on the meta device it gets each module's ``reset_parameters()`` (torch's init, or
    the per-module normal(0, std) that LitGPT's ``pretrain`` sets on them before setup), as the same
    model built eagerly does, bit for bit (the initialisation pretrain applies after construction
    is recorded too). It once got normal(0, 0.02) everywhere: std 0.020 where DDP had 0.056."""
    from lightning.fabric import Fabric
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    config = Config(block_size=64, vocab_size=512, padded_vocab_size=512, n_layer=2, n_head=4, n_embd=128,
                    bias=True, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=256)
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    eager = GPT(config)
    if neox_init:
        initialize_weights(fabric, eager, config.n_layer, config.n_embd)
    torch.manual_seed(0)
    with meta_parameters():
        model = GPT(config)
    if neox_init:  # sets per-module reset_parameters and runs them, on the meta parameters
        initialize_weights(fabric, model, config.n_layer, config.n_embd)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    got = _gathered(model, engine)
    want = dict(eager.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value.detach()), name
    fc = got["transformer.h.0.mlp.fc_1.weight"]
    expected = (2 / 5 / config.n_embd) ** 0.5 if neox_init else (1 / 3 / config.n_embd) ** 0.5  # kaiming-uniform's
    assert abs(fc.std() / expected - 1) < 0.05


@pytest.mark.parametrize("units", ["modules", "blocks"])
def test_litgpt_lora_model_on_meta_draws_eagers_values_exactly(units: str) -> None:
    """LitGPT's LoRA ``GPT``: each ``LoRALinear`` builds its ``nn.Linear`` before its own
    ``lora_A`` (``modules()`` lists it first), and its blocks build plain layers that the LoRA
    ones then replace. Built on the meta device and partitioned, every parameter equals the eager
    model's bit for bit: construction's draws are recorded in the order they happen, the dropped
    layers' too (they once came out shifted: adapters and base layers all different from DDP's)."""
    from litgpt.lora import GPT, Config

    config = Config(block_size=64, vocab_size=512, padded_vocab_size=512, n_layer=2, n_head=4, n_embd=64,
                    bias=True, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128,
                    lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True, lora_mlp=True,
                    lora_head=True)
    torch.manual_seed(1337)
    eager = GPT(config)
    torch.manual_seed(1337)
    with meta_parameters():
        model = GPT(config)
    engine = ZeroEngine(model, block_classes=["Block"] if units == "blocks" else (),
                        prefetch=PrefetchConfig(persistence_threshold=0))
    got = _gathered(model, engine)
    for name, value in eager.named_parameters():
        assert torch.equal(got[name], value.detach()), name


def _parameters_listed(arch: str, layers: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many parameters ``Module.parameters()``/``named_parameters()`` yield (to anyone) while
    a ``ZeroEngine`` partitions a tiny ``transformers`` model of ``layers`` layers built on meta."""
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=layers, n_head=2, n_positions=32,
                                         bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    with meta_parameters():
        model = cls(config)
    listed = [0]
    original = nn.Module._named_members

    def counting(self, *args, **kwargs):
        for item in original(self, *args, **kwargs):
            listed[0] += 1
            yield item

    with monkeypatch.context() as patch:
        patch.setattr(nn.Module, "_named_members", counting)
        ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    return listed[0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_setup_of_a_transformers_model_is_linear_in_its_units(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library init of the modules without parameters of their own (GPT-2's c_proj rescaling
    at the attention and MLP) waits for every parameter below them; listing those of every
    ancestor (the root's are the whole model's) for each unit made setup quadratic: 333 s for a
    512-layer Llama of width 16 (4,611 units). Four times the layers must list about four times the
    parameters (quadratic: sixteen)."""
    small, large = (_parameters_listed(arch, layers, monkeypatch) for layers in (8, 32))
    assert large < 5 * small, (small, large)
