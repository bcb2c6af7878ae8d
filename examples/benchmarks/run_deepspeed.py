"""One rank of the ``deepspeed`` contender: a raw DeepSpeed ZeRO-3 engine on CPU with gloo.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 run_deepspeed.py --steps N --result-dir DIR

Runs in a separate venv with DeepSpeed installed (Lightning's DeepSpeedStrategy needs CUDA).
A step is timed around ``engine(x)``, the loss, ``engine.backward`` and ``engine.step``.
"""

import argparse
import gc

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from data import RandomTokens
from examples.gpt import GPT, lm_loss
from measure import LR, MICRO_BATCH, SEED, StepClock, write_rank_result

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(SEED)
    # Partition parameters as they are created, as ZeRO-3 users do for large models.
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        model = GPT()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)

    data = RandomTokens(args.steps * world_size * MICRO_BATCH, seed=SEED)
    # The same sharding of the data set that Lightning applies for the other contenders.
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    clock = StepClock()
    for inputs, targets in DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler):
        clock.start()
        loss = lm_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        clock.stop(loss.item())
    write_rank_result(args.result_dir, rank, clock)

    # DeepSpeed has been seen to abort at interpreter exit (research note, section 4), so tear
    # down explicitly; the driver judges success by the results written above.
    del engine, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
