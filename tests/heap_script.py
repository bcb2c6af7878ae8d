"""One process builds a GPT on the meta device, partitions it with parameters and optimizer on NVMe
under bf16 compute, and takes two AdamW steps; prints glibc's heap accounting (``mallinfo2``) right
after setup and at the end, and the peak RSS, as JSON. For tests/test_heap.py, which runs it with
``LIGHTNING_ZINF_HEAP`` on and off.

    NVME=<folder> python tests/heap_script.py
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, ZeroEngine, meta_parameters  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def free_heap() -> int:
    """Bytes glibc holds free in its heaps (``fordblks``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().fordblks


def main() -> None:
    torch.manual_seed(0)
    with meta_parameters():
        model = GPT(GPTConfig(d_model=512, n_layers=4, n_heads=8))
    engine = ZeroEngine(model, block_classes=["Block"],
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=os.environ["NVME"]),
                        mixed_precision=MixedPrecisionConfig(param_dtype=torch.bfloat16))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    after_setup = free_heap()
    for step in range(2):
        tokens = torch.randint(0, 8192, (1, 129), generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    engine.release_all()
    print(json.dumps({"free_after_setup": after_setup, "free_at_end": free_heap(), "loss": loss.item(),
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


if __name__ == "__main__":
    main()
