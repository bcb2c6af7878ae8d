"""Gradient clipping on fragments against torch's own, side by side.

The engine clips the fp32 gradient fragments of this rank (``ZeroEngine.clip_grad_norm_`` ->
:func:`lightning_zinf.engine.optim.clip_grad_norm_`: multi-tensor norms, one all-reduce of the
squared norm, a multi-tensor scale). Here, at one rank (no collective), its time on the 91M GPT's
parameters (examples/gpt.py, 148 tensors) against ``torch.nn.utils.clip_grad_norm_`` (foreach) on
the same tensors, alternating, with a ``max_norm`` that scales every gradient; the median of
``--rounds`` rounds and the ratio.

    python examples/benchmarks/clip.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.gpt import GPT, GPTConfig  # noqa: E402
from lightning_zinf.comm import Collectives  # noqa: E402
from lightning_zinf.engine.optim import clip_grad_norm_  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tensors = [torch.zeros(p.numel(), requires_grad=True) for p in GPT(GPTConfig()).parameters()]
    for t in tensors:
        t.grad = torch.randn_like(t)
    comm = Collectives(None)
    contenders = {"zinf": lambda: clip_grad_norm_(tensors, 1.0, comm),
                  "torch": lambda: torch.nn.utils.clip_grad_norm_(tensors, 1.0, foreach=True)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    zinf, peer = statistics.median(times["zinf"]), statistics.median(times["torch"])
    print(f"{len(tensors)} tensors, {sum(t.numel() for t in tensors) / 1e6:.1f}M elements, {args.rounds} rounds")
    print(f"zinf clip_grad_norm_  {zinf * 1e3:8.1f} ms (median)")
    print(f"torch clip_grad_norm_ {peer * 1e3:8.1f} ms (median, foreach)")
    print(f"zinf / torch          {zinf / peer:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
