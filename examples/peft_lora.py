"""LoRA fine-tuning of a Hugging Face causal LM with PEFT under ``zero_infinity``, end to end:

1. a pretrained checkpoint: a byte-level ``transformers`` Llama (vocabulary 256) built from its
   config and saved with ``save_pretrained`` as sharded safetensors (a real one is a download);
2. the LightningModule builds the PEFT model in ``configure_model`` (on the meta device: nothing
   is allocated whole); the strategy loads the checkpoint into it partitioned
   (``load_full_weights``), PEFT's adapters keep their own init;
3. LoRA fine-tuning on the Python stdlib's bytes; checkpoints hold the adapters only
   (``exclude_frozen_parameters``); with ``--frozen-bits 8`` the frozen base is stored as INT8 codes;
4. ``generate()`` in ``predict_step`` (units kept gathered across the decode steps);
5. the adapters exported as PEFT writes them, reloaded with plain ``PeftModel.from_pretrained`` on
   the pretrained base in this process, generating again.

    python examples/peft_lora.py --out runs/peft_lora [--steps 60] [--devices 2] [--frozen-bits 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as L
import peft
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.gpt import lm_loss  # noqa: E402
from examples.pretrain import StdlibBytes  # noqa: E402
from lightning_zinf import ZeroInfinityStrategy  # noqa: E402
from lightning_zinf.hf_export import export_peft_adapters  # noqa: E402

PROMPT = b"def __init__(self"


def llama_config(width: int, layers: int, seq_len: int) -> transformers.LlamaConfig:
    """A small byte-level Llama."""
    return transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=seq_len + 64, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=0)


class LoraFinetune(L.LightningModule):
    """A PEFT LoRA model (rank ``r`` on every attention projection) over a ``transformers`` causal LM.

    Args:
        base: The pretrained model's folder (its config builds the architecture).
        r: LoRA rank.
        lr: AdamW learning rate of the adapters.
        new_tokens: Bytes ``predict_step`` generates.
    """

    def __init__(self, base: str, r: int = 8, lr: float = 3e-3, new_tokens: int = 24) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: peft.PeftModel | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.hparams.base)
            lora = peft.LoraConfig(r=self.hparams.r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            self.model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), lora)

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model(input_ids=batch[0]).logits, batch[1])
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.model.generate(batch[0], max_new_tokens=self.hparams.new_tokens, do_sample=False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/peft_lora"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--frozen-bits", type=int, choices=(0, 4, 8), default=0)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    base = args.out / "pretrained"
    if not (base / "config.json").exists():  # the launcher re-runs this script on the other ranks
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(args.width, args.layers, args.seq_len))
        model.save_pretrained(base, max_shard_size="200KB")

    strategy = ZeroInfinityStrategy(
        block_classes=["LlamaDecoderLayer"], load_full_weights=base, exclude_frozen_parameters=True,
        zero_pp={"frozen_bits": args.frozen_bits} if args.frozen_bits else None,
        prefetch={"inference_budget": 1 << 30},
    )
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=args.out / "checkpoints", save_last=True)])
    lit = LoraFinetune(str(base))
    trainer.fit(lit, datamodule=StdlibBytes(seq_len=args.seq_len, batch_size=8))
    prompt = torch.tensor([list(PROMPT)])
    # One prompt per rank: every rank takes part in generate()'s gathers.
    generated = trainer.predict(lit, DataLoader(TensorDataset(prompt.repeat(args.devices, 1)), batch_size=1))[0]
    if not trainer.is_global_zero:
        return {}

    adapters = export_peft_adapters(args.out / "checkpoints" / "last.ckpt", args.out / "adapters",
                                    peft_config=lit.model.peft_config["default"], strip_prefix="model.")
    reloaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapters).eval()
    with torch.no_grad():
        again = reloaded.generate(prompt, max_new_tokens=lit.hparams.new_tokens, do_sample=False)
    first, last = sum(lit.losses[:5]) / 5, sum(lit.losses[-5:]) / 5
    result = {"loss_first": first, "loss_last": last, "same_after_reload": torch.equal(generated, again)}
    print(f"loss over the first 5 steps {first:.3f}, over the last 5 {last:.3f}")
    print("generated:", bytes(generated[0].tolist()).decode("utf-8", errors="replace"))
    print(f"adapters in {adapters}; PeftModel.from_pretrained generates the same bytes: {result['same_after_reload']}"
          + (" (the partitioned base was INT8 codes, the reloaded one fp32)" if args.frozen_bits else ""))
    return result


if __name__ == "__main__":
    main()
