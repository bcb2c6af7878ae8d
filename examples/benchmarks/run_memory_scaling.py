"""One rank of memory_scaling.py: a few training steps of the GPT under one ZeRO-3 contender, with
this process's peak memory measured over the steps after a warm-up step.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node N run_memory_scaling.py {zinf,zinf_frozen_bf16,fsdp2,deepspeed} \
        --layers L --mode {full,lora} [--fp32] [--steps 4] --result-dir DIR

(``deepspeed`` also needs ``DS_ACCELERATOR=cpu``.) Every contender builds the model without any
rank holding it whole (zinf: ``meta_parameters``; FSDP2: the meta device, ``fully_shard``, then
``to_empty`` and ``reset_parameters``; DeepSpeed: ``deepspeed.zero.Init``), trains it with torch's
AdamW over the trainable parameters, and runs forward under ``torch.autocast("cpu", bfloat16)``
(``--fp32``, zinf only: no autocast and no precision policy).

Modes: ``full`` trains every parameter; ``lora`` freezes the model and trains rank-8 adapters on
each block's attention ``qkv`` and ``proj`` (:class:`LoRALinear`).

Every contender's process imports ``lightning.pytorch`` first, as a Lightning job using any of them
would (``lightning_zinf`` imports it to register its strategy), so that import costs them alike.

Memory: after the warm-up step (which creates the AdamW state), ``gc.collect()`` and a write of
"5" to ``/proc/self/clear_refs`` reset the kernel's peak RSS (``VmHWM``) to the RSS of the moment;
``VmHWM`` read after the last step is the peak RSS of the measured steps. zinf also reports its
memory ledger's ``device_total`` peak (everything the engine holds) and the bytes its all-gathers
received, per measured step. Each rank writes ``<result_dir>/rank<r>.json``.
"""

import argparse
import gc
import importlib
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # examples.gpt and lightning_zinf from this checkout

from examples.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402

D_MODEL, N_HEADS, SEQ_LEN, VOCAB = 512, 8, 128, 8192
LORA_RANK = 8
MICRO_BATCH = 1
LR = 1e-4
PERSISTENCE_THRESHOLD = 100_000  # zinf's and DeepSpeed's default: units (params) this small stay gathered
WARMUP_STEPS = 1


def gpt_config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=layers, n_heads=N_HEADS, seq_len=SEQ_LEN)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + x A^T B^T`` with
    ``A`` (rank x in) and ``B`` (out x rank, zero at init, so training starts from the base)."""

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def build_gpt(layers: int, mode: str) -> GPT:
    """The GPT of ``layers`` blocks; in ``lora`` mode with adapters and only the adapters trainable.
    Built in whatever construction context the caller holds (meta, ``zero.Init``, eager)."""
    model = GPT(gpt_config(layers))
    if mode == "lora":
        for block in model.blocks:
            block.attn.qkv = LoRALinear(block.attn.qkv)
            block.attn.proj = LoRALinear(block.attn.proj)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, different on every rank and step: (inputs, next-token targets)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(VOCAB, (MICRO_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def proc_status_mib(field: str) -> float:
    """A ``VmXXX`` line of ``/proc/self/status`` (kB), in MiB."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def reset_peak_rss() -> None:
    """Make ``VmHWM`` the current RSS (Linux ``clear_refs``, value 5)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, use_autocast: bool):
    """One plain PyTorch training step (forward, backward, step, zero_grad), as zinf and FSDP2 run it."""

    def step(inputs, targets):
        with autocast(use_autocast):
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def setup_zinf(args, frozen_dtype=None):
    """``ZeroEngine`` over the meta-built model: blocks as units, bf16 gathers and fp32 reductions,
    scheduled as FSDP2 schedules them on the CPU: one unit gathered ahead (``bucket_size=0``; zinf's
    default bucket of 1e7 elements holds three of these 3.15M-parameter blocks ahead) and each
    reduce-scatter waited for as it is issued (``overlap_reduce=False``; FSDP2 overlaps it only on
    GPUs, through its reduce-scatter stream)."""
    from lightning_zinf import MixedPrecisionConfig, PrefetchConfig, ZeroEngine, meta_parameters

    with meta_parameters():
        model = build_gpt(args.layers, args.mode)
    bf16 = MixedPrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, frozen_dtype=frozen_dtype)
    precision = MixedPrecisionConfig() if args.fp32 else bf16
    engine = ZeroEngine(model, block_classes=[Block], mixed_precision=precision,
                        prefetch=PrefetchConfig(persistence_threshold=PERSISTENCE_THRESHOLD, bucket_size=0,
                                                 overlap_reduce=False))
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR))

    return engine, torch_step(model, opt, use_autocast=not args.fp32)


def setup_zinf_frozen_bf16(args):
    """zinf storing the frozen parameters' shards in bf16 (``frozen_dtype``), as DeepSpeed's bf16
    mode stores its whole model."""
    return setup_zinf(args, frozen_dtype=torch.bfloat16)


def setup_fsdp2(args):
    """FSDP2: ``fully_shard`` on each block, then the root (embeddings, final norm), bf16 params and
    fp32 reductions; built on the meta device and initialised after sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = build_gpt(args.layers, args.mode)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    done: set[int] = set()  # the tied lm_head weight is the embedding's: initialise it once
    for module in model.modules():
        own = [id(p) for p in module.parameters(recurse=False)]
        if hasattr(module, "reset_parameters") and own and not done.issuperset(own):
            module.reset_parameters()
            done.update(own)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    return None, torch_step(model, opt, use_autocast=True)


def setup_deepspeed(args):
    """DeepSpeed ZeRO-3 in bf16 with torch's AdamW as the client optimizer, the model built under
    ``zero.Init``; DeepSpeed's defaults except the persistence threshold (set to zinf's)."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_gpt(args.layers, args.mode)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=LR), config=config)

    def step(inputs, targets):
        with autocast(True):
            loss = lm_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        return loss

    return None, step


SETUPS = {"zinf": setup_zinf, "zinf_frozen_bf16": setup_zinf_frozen_bf16, "fsdp2": setup_fsdp2,
          "deepspeed": setup_deepspeed}
# Imported before the start RSS is read, so that it counts each contender's library.
LIBRARIES = {"zinf": "lightning_zinf", "zinf_frozen_bf16": "lightning_zinf", "fsdp2": "torch.distributed.fsdp",
             "deepspeed": "deepspeed"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=list(SETUPS))
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--fp32", action="store_true", help="zinf only: fp32 gathers and compute, no autocast")
    parser.add_argument("--steps", type=int, default=4, help=f"steps, the first {WARMUP_STEPS} a warm-up")
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()
    if args.contender == "zinf_frozen_bf16" and args.mode != "lora":
        parser.error("zinf_frozen_bf16 differs from zinf only with frozen parameters: --mode lora")
    if args.fp32 and args.contender != "zinf":
        parser.error("--fp32 is for zinf only")

    # Every contender's process imports Lightning, as the Lightning job that uses any of them would
    # (lightning_zinf imports it to register its strategy): the start RSS is then the same import cost.
    importlib.import_module("lightning.pytorch")
    library = importlib.import_module(LIBRARIES[args.contender])
    if args.contender == "deepspeed":
        library.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    rss_at_start = proc_status_mib("VmRSS")  # imports and process group, before the model exists
    engine, step = SETUPS[args.contender](args)

    result = {"rank": rank, "rss_at_start_mib": rss_at_start, "step_times_s": [], "losses": [],
              "ledger_device_total_peak": [], "ledger_peaks": [], "gathered_bytes": []}
    if engine is not None:  # elements of the units that stay gathered (gathered again after each step)
        result["persistent_numel"] = sum(unit.numel for unit in engine.units if unit.persistent)
    for i in range(args.steps):
        if i == WARMUP_STEPS:
            dist.barrier()
            reset_peak_rss()
            result["rss_at_reset_mib"] = proc_status_mib("VmRSS")
        if engine is not None:
            engine.reset_memory_peaks()
            engine.comm.bytes.reset()
        start = time.perf_counter()
        loss = step(*batch(rank, i))
        result["step_times_s"].append(time.perf_counter() - start)
        result["losses"].append(loss.item())
        if engine is not None:
            peaks = {category: peak for category, (_, peak) in engine.memory().items()}
            result["ledger_peaks"].append(peaks)
            result["ledger_device_total_peak"].append(peaks["device_total"])
            result["gathered_bytes"].append(engine.comm.bytes.gathered)
    result["peak_rss_mib"] = proc_status_mib("VmHWM")
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    # DeepSpeed has been seen to abort at interpreter exit; the driver judges by the files written.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
