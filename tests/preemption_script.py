"""One rank of a 2-rank Trainer run that a test preempts with a real signal, for tests/test_preemption.py.

    OUT=<folder> STEPS=<n> [STOP_AT=<step> STOP_RANK=<rank>] [SIGNALS=SIGTERM,SIGUSR1] [EXIT_CODE=<n>]
    [RESUME=1] [NO_CHECKPOINT_CALLBACK=1] [FABRIC=1] python tests/preemption_script.py

Started as ``python tests/preemption_script.py`` (Lightning's launcher: rank 0 starts rank 1) or by
``torchrun --nproc_per_node 2``. Each rank writes its pid to ``OUT/pid<rank>`` first, and one line
``<global step> <loss as float.hex>`` per training step to ``OUT/losses<rank>.<run>`` (``<run>`` is
``resumed`` with ``RESUME=1``, else ``first``). With ``STOP_AT``, rank ``STOP_RANK`` stops inside
the training step at that global step, writes ``OUT/at_step``, and goes on only once the test has
signalled it and written ``OUT/signalled`` (so the signal arrives at a known step, whatever the
machine's speed). With ``RESUME=1`` the run resumes with ``trainer.fit(..., ckpt_path=...)`` (``"last"``,
or ``"hpc"`` without a ModelCheckpoint). Each rank also writes the SIGTERM handler it runs its first
step under to ``OUT/handler<rank>.<run>``, the one it has after ``fit`` returns to
``OUT/handler_after<rank>.<run>``, and the status it exits with (``SystemExit``) to ``OUT/exit<rank>.<run>``.

``FABRIC=1``: the same training (the same losses) as a Fabric loop that checks ``fabric.strategy.preempted()`` after
each optimizer step, saves ``OUT/fabric.ckpt`` with ``fabric.save`` and ends with
``fabric.strategy.exit_preempted()``; ``RESUME=1`` loads it with ``fabric.load`` first.

The batch of each step is drawn from the global step and the rank, not from the DataLoader:
Lightning restarts a plain DataLoader's epoch when it resumes mid-epoch, and this script tests
what the strategy owns (weights, optimizer state, scheduler, loop counters), not the data order.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_zinf import ZeroInfinityStrategy  # noqa: E402

OUT = Path(os.environ["OUT"])
STEPS = int(os.environ.get("STEPS", "8"))
STOP_AT = int(os.environ.get("STOP_AT", "-1"))
STOP_RANK = int(os.environ.get("STOP_RANK", "1"))
RESUME = os.environ.get("RESUME") == "1"
RUN = "resumed" if RESUME else "first"
RANK = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def _handler() -> str:
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(handler, "__qualname__", None) or repr(handler)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """The step's loss on a batch drawn from the step and the rank; the first rank to stop at
    ``STOP_AT`` waits there until the test has signalled it."""
    if step == STOP_AT and rank == STOP_RANK:
        (OUT / "at_step").write_text(str(step))
        while not (OUT / "signalled").exists():  # the handler runs in between (sleep is interrupted)
            time.sleep(0.01)
    if not (OUT / f"handler{rank}.{RUN}").exists():
        (OUT / f"handler{rank}.{RUN}").write_text(_handler())
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    with open(OUT / f"losses{rank}.{RUN}", "a") as f:
        f.write(f"{step} {loss.item().hex()}\n")
    return loss


def _preemption() -> dict | None:
    preemption: dict = {}
    if "SIGNALS" in os.environ:
        preemption["signals"] = os.environ["SIGNALS"].split(",")
    if "EXIT_CODE" in os.environ:
        preemption["exit_code"] = int(os.environ["EXIT_CODE"])
    return preemption or None


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _model()

    def training_step(self, batch, batch_idx):
        return _loss(self.model, self.global_step, self.global_rank)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.7),
                              "interval": "step"}]


def fabric_main() -> None:
    from lightning.fabric import Fabric

    from lightning_zinf import ZeroInfinityFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroInfinityFabricStrategy(
        timeout=timedelta(seconds=30), preemption=_preemption()))
    fabric.launch()
    with fabric.init_module():
        model = _model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.7)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if RESUME:
        fabric.load(OUT / "fabric.ckpt", state)
    for step in range(state["step"], STEPS):
        fabric.backward(_loss(model, step, fabric.global_rank))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if fabric.strategy.preempted():
            fabric.save(OUT / "fabric.ckpt", state)
            fabric.strategy.exit_preempted()
    print(f"rank {fabric.global_rank} finished", flush=True)


def main() -> None:
    preemption = _preemption()
    with_callback = os.environ.get("NO_CHECKPOINT_CALLBACK") != "1"
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(timeout=timedelta(seconds=30), preemption=preemption),
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, default_root_dir=OUT,
        enable_checkpointing=with_callback, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=OUT / "checkpoints", save_last=True)] if with_callback else None)
    data = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)  # 32 steps per epoch on each rank
    ckpt = ("last" if with_callback else "hpc") if RESUME else None
    trainer.fit(Lit(), data, ckpt_path=ckpt)
    (OUT / f"handler_after{trainer.global_rank}.{RUN}").write_text(_handler())
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    (OUT / f"pid{RANK}").write_text(str(os.getpid()))
    try:
        fabric_main() if os.environ.get("FABRIC") == "1" else main()
    except SystemExit as stop:
        (OUT / f"exit{RANK}.{RUN}").write_text(str(stop.code))
        raise
