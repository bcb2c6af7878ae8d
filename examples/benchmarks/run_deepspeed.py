"""One rank of the ``deepspeed`` contender: a raw DeepSpeed ZeRO-3 engine on CPU with gloo.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 run_deepspeed.py --steps N --result-dir DIR [--nvme DIR]
        [--precision {32-true,bf16-mixed}]

With ``--nvme DIR`` it is ZeRO-Infinity: parameters and optimizer state offloaded to NVMe under DIR
through DeepSpeed's libaio op (``nvme_config``, the working configuration of
``shared/research/deepspeed_cpu_peer.md``); rank 0 prints the swap files' sizes by kind at the end of
training (``swap files:``, one JSON line in the log).

``--precision bf16-mixed`` adds DeepSpeed's ``"bf16": {"enabled": true}``: the engine holds the
module's parameters in bf16 (with NVMe offload, swapped as bf16), keeps fp32 masters, gradients and
Adam moments in its optimizer (on NVMe with ``--nvme``), and the forward and the loss run under
``torch.autocast("cpu", dtype=torch.bfloat16)``, as Lightning's ``bf16-mixed`` runs them for the
other contenders. The default, ``32-true``, is fp32 throughout.

Runs in a separate venv with DeepSpeed installed (Lightning's DeepSpeedStrategy needs CUDA).
A step is timed around ``engine(x)``, the loss, ``engine.backward`` and ``engine.step``.
"""

import argparse
import gc
import json

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from data import RandomTokens
from examples.gpt import GPT, GPTConfig, lm_loss
from measure import LR, MICRO_BATCH, SEED, StepClock, swap_files, write_rank_result

# fp32 ZeRO-3 without offload, with DeepSpeed's own defaults for everything else (prefetch,
# persistence, bucket sizes): a speed comparison should not switch off its prefetch. (The
# research note's prefetch-0 knobs avoid a buffer assertion that only NVMe offload hits.)
# Weight decay matches torch.optim.AdamW's default, which the other contenders use.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3},
    "steps_per_print": 1_000_000,
}


def nvme_config(nvme_path: str, largest_param: int = 10_000_000) -> dict:
    """ZeRO-Infinity: parameters and optimizer state on NVMe under ``nvme_path``.

    The configuration the research note found to work with DeepSpeed 0.19.8 on CPU. With
    prefetching or parameter reuse on, param swap-in runs out of buffers ("Not enough buffers 0 for
    swapping 1", deepspeedai/DeepSpeed#3062), so ``stage3_prefetch_bucket_size`` and
    ``stage3_max_reuse_distance`` are 0 and ``offload_param.buffer_count`` is 16;
    ``sub_group_size`` 1e7 lowered the peak RSS (4.0 -> 3.2 GiB per rank) and did not abort at exit.
    ``offload_param.buffer_size`` (elements) must hold the largest parameter (the 6.3M-element
    embedding; ``largest_param`` for other models). The optimizer (AdamW as in ``DS_CONFIG``)
    becomes DeepSpeedCPUAdam.
    """
    zero = {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 50_000_000,
        "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": 10_000,
        "stage3_max_live_parameters": 30_000_000,
        "stage3_max_reuse_distance": 0,
        "sub_group_size": 10_000_000,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": nvme_path,
            "buffer_count": 4,
            "pipeline_read": False,
            "pipeline_write": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": nvme_path,
            "buffer_count": 16,
            "buffer_size": max(10_000_000, largest_param),
            "max_in_cpu": 1_000_000,
        },
    }
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}
    return {**DS_CONFIG, "zero_optimization": zero, "aio": aio}


def with_precision(config: dict, precision: str) -> dict:
    """``config`` with DeepSpeed's bf16 mode on for ``bf16-mixed`` (unchanged for ``32-true``)."""
    return {**config, "bf16": {"enabled": True}} if precision == "bf16-mixed" else config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--nvme", help="offload parameters and optimizer state to NVMe in this folder")
    parser.add_argument("--d-model", type=int, default=GPTConfig.d_model, help="model width (scale runs)")
    parser.add_argument("--layers", type=int, default=GPTConfig.n_layers, help="blocks (scale runs)")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="bf16-mixed: DeepSpeed's bf16 mode, forward under bf16 autocast (default: %(default)s)")
    args = parser.parse_args()
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64)
    largest = max(4 * cfg.d_model * cfg.d_model, cfg.vocab_size * cfg.d_model)
    config = with_precision(nvme_config(args.nvme, largest) if args.nvme else DS_CONFIG, args.precision)
    bf16 = args.precision == "bf16-mixed"

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(SEED)
    # Partition parameters as they are created, as ZeRO-3 users do for large models.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    data = RandomTokens(args.steps * world_size * MICRO_BATCH, seed=SEED)
    # The same sharding of the data set that Lightning applies for the other contenders.
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    clock = StepClock()
    for inputs, targets in DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler):
        clock.start()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        clock.stop(loss.item())
    write_rank_result(args.result_dir, rank, clock)
    if args.nvme:
        dist.barrier()
        if rank == 0:
            print("swap files:", json.dumps(swap_files(args.nvme)), flush=True)

    # DeepSpeed has been seen to abort at interpreter exit (research note, section 4), so tear
    # down explicitly; the driver judges success by the results written above.
    del engine, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
