"""One process trains a model whose first unit is a 42 MB fp32 Linear (above the 32 MiB beyond
which glibc maps every block on its own) for a few AdamW steps on the CPU, and prints as JSON the
minor page faults of each step (``getrusage``), the losses, and the huge page mode of the system.
For tests/test_heap.py, which runs it with ``LIGHTNING_ZINF_HEAP`` on and off.

    python tests/pages_script.py
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_zinf import ZeroEngine  # noqa: E402

STEPS = 5


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 2560), torch.nn.ReLU(), torch.nn.Linear(2560, 16))
    engine = ZeroEngine(model)  # no process group: one rank
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    faults, losses = [], []
    for step in range(STEPS):
        x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(step))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        losses.append(loss.item())
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = None
    print(json.dumps({"faults": faults, "losses": losses, "units": len(engine.units), "thp": mode}))


if __name__ == "__main__":
    main()
