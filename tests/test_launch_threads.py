"""Every rank a launcher starts computes with its share of the CPU threads.

Lightning's DDP gives each process ``cores // ranks per node`` intra-op threads (and sets
``OMP_NUM_THREADS`` for what it starts later) in its launcher's ``launch``, in the launching process
and in the ones it, torchrun or SLURM started alike. The strategies skipped their launcher in a
process started by another, so rank 1 of ``python train.py`` ran as many threads as the machine
has cores beside rank 0: on the 2-core CI machine the main job's GPT ran at 0.70x DDP's step.
The reference is Lightning's own suggestion (``_suggested_max_num_threads``), read in a plain
``python`` run of a script through Lightning's real script launcher, with ``OMP_NUM_THREADS``
unset as in a user's shell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
import torch
sys.path.insert(0, {root!r})
from tests import models

out, kind = sys.argv[1], sys.argv[2]
if kind == "trainer":
    import lightning.pytorch as L
    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = models.GPT(d=32, layers=1, vocab=64, heads=2)

        def training_step(self, batch, batch_idx):
            return models.loss_fn(self.model, *batch)

        def train_dataloader(self):
            x, y = models.make_batch("gpt", 0, 8)
            return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(strategy=ZeroInfinityStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Lit())
    rank = trainer.global_rank
else:
    import lightning.fabric as LF
    from lightning_zinf import ZeroInfinityFabricStrategy

    fabric = LF.Fabric(accelerator="cpu", devices=2, strategy=ZeroInfinityFabricStrategy())
    fabric.launch()
    model = models.GPT(d=32, layers=1, vocab=64, heads=2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    rank = fabric.global_rank
with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}}, f)
"""


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
def test_every_rank_computes_with_its_share_of_the_cores(kind: str, tmp_path: Path) -> None:
    """``python script.py`` with 2 devices on CPU, ``OMP_NUM_THREADS`` unset: both ranks, the
    launching one and the one it starts, run ``cores // 2`` intra-op threads (at least 1), as
    Lightning's DDP gives them."""
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    script = tmp_path / "threads.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path), kind], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    want = _suggested_max_num_threads(2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"threads": want, "omp": str(want)}, (rank, got)
