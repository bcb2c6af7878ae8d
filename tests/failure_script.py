"""One rank of a Trainer run that goes wrong in the way ``FAILURE`` names, for tests/test_failures.py.

    FAILURE=<scenario> OUT=<folder> python tests/failure_script.py

Each process writes its pid to ``OUT/pid<rank>`` first. Scenarios (rank 1 misbehaves, at step 2
unless said otherwise): ``raise`` (user code raises), ``stuck`` (sleeps forever in its step),
``killed`` (SIGKILL to itself; ``killed_quiet``: while rank 0 sleeps outside any collective;
``killed_in_reduce``: under ``sharding="hybrid"`` with a group per rank, in backward, once the last
layer's gradient went to the all-reduce across the groups;
``raise_in_quantized_reduce``: under ``sharding="hybrid"`` with a group per rank and qgZ, the quantized
all-reduce across the groups raises on rank 1's thread of it, in backward;
``killed_zero``: rank 0, which hosts the rendezvous store, is killed instead; ``killed_zero_quiet``:
while rank 1 sleeps outside any collective), ``rank_only_first`` / ``rank_only_later`` (a module that rank 0
alone runs, from the first step / from step 2), ``rank_only_validation`` / ``rank_only_predict``
(the same in validation / in ``trainer.predict``),
``generation_rank0_only`` (from step 2 rank 0 alone enters ``strategy.generation()``),
``step_raise`` (with the optimizer offloaded to the CPU, its update raises on rank 1 in the step
in the background), ``corrupt`` (resume from ``OUT/ckpt`` after rank 1's shard file was damaged), ``save`` (train and
save ``OUT/ckpt``), ``fabric_raise`` (a Fabric loop whose rank 1 raises), ``fabric_rank0_forward`` (a
Fabric loop whose rank 0 alone runs the model while rank 1 waits in ``fabric.barrier()``).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_zinf import ZeroInfinityStrategy  # noqa: E402

SCENARIO = os.environ["FAILURE"]
OUT = Path(os.environ["OUT"])


def _threads_left() -> None:
    # Registered before the strategy exists, so it runs after every handler the run registers:
    # which of this process's threads the interpreter's shutdown would meet (names from /proc; a
    # thread may end while they are read).
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append((Path("/proc/self/task") / tid / "comm").read_text().strip())
        except OSError:
            continue
    (OUT / f"threads{os.environ.get('LOCAL_RANK', '0')}").write_text("\n".join(names))


if SCENARIO.startswith(("rank_only", "fabric_rank0")):  # the runs that end normally and check it
    atexit.register(_threads_left)


class Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
        self.extra = torch.nn.Linear(32, 32)  # the module some ranks run and others do not

    def _rank_only(self, step_from: int) -> bool:
        return self.global_rank == 0 and self.global_step >= step_from

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if SCENARIO == "killed_in_reduce" and self.global_rank == 1 and self.global_step == 2 and self.training:
            # Fires in backward after b's gradient, whose all-reduce across the groups is under way.
            h.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        if SCENARIO == "raise_in_quantized_reduce":
            _QuantizedReduce.armed = self.global_rank == 1 and self.global_step == 2 and self.training
        if extra:
            h = torch.tanh(self.extra(h))
        return self.b(h)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 2:
            if SCENARIO == "raise":
                raise ValueError("boom in rank 1's training_step")
            if SCENARIO == "stuck":
                time.sleep(10**6)
            if SCENARIO in ("killed", "killed_quiet"):
                os.kill(os.getpid(), signal.SIGKILL)
        if SCENARIO.startswith("killed_zero") and self.global_rank == 0 and self.global_step == 2:
            (OUT / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # the store's host: the survivors lose the store too
        if SCENARIO == "killed_zero_quiet" and self.global_rank == 1 and self.global_step == 2:
            time.sleep(120)
        if SCENARIO == "killed_quiet" and self.global_rank == 0 and self.global_step == 2:
            time.sleep(120)  # not in a collective: only the watch can notice rank 1 is gone
        extra = (SCENARIO == "rank_only_first" and self._rank_only(0)) or (
            SCENARIO == "rank_only_later" and self._rank_only(2))
        if SCENARIO == "generation_rank0_only" and self._rank_only(2):
            with self.trainer.strategy.generation(), torch.no_grad():  # rank 1 skips the rollout
                self(batch[0], False)
        return torch.nn.functional.mse_loss(self(batch[0], extra), batch[1])

    def validation_step(self, batch, batch_idx):
        extra = SCENARIO == "rank_only_validation" and self.global_rank == 0
        return torch.nn.functional.mse_loss(self(batch[0], extra), batch[1])

    def predict_step(self, batch, batch_idx):
        return self(batch[0], SCENARIO == "rank_only_predict" and self.global_rank == 0)

    def on_train_batch_start(self, batch, batch_idx):
        if SCENARIO == "step_raise":
            self.trainer.optimizers[0].boom = self.global_rank == 1 and self.global_step == 2

    def configure_optimizers(self):
        return _FailingSGD(self.parameters(), lr=0.1)


class _FailingSGD(torch.optim.SGD):
    """SGD whose update raises while ``boom`` is set and it has gradients to apply."""

    boom = False

    def step(self, closure=None):
        if self.boom and any(p.grad is not None for group in self.param_groups for p in group["params"]):
            raise ValueError("boom in rank 1's optimizer step")
        return super().step(closure)


class _QuantizedReduce:
    """The quantized all-reduce's middle kernel (dequantize, sum, requantize), raising while
    ``armed``: on rank 1's all-reduce thread, between the two collectives of that all-reduce."""

    armed = False

    def __init__(self) -> None:
        from lightning_zinf.comm import collectives

        self.module, self.kernel = collectives, collectives.dequantize_reduce_requantize
        collectives.dequantize_reduce_requantize = self

    def __call__(self, *args, **kwargs):
        if self.armed:
            raise ValueError("boom in rank 1's quantized all-reduce")
        return self.kernel(*args, **kwargs)


def fabric_main() -> None:
    """``fabric_raise``: a Fabric loop whose rank 1 raises at step 2 (no Trainer: the uncaught
    exception reaches the watch's ``sys.excepthook``); ``fabric_rank0_forward``: at step 2 rank 0
    alone runs the model, then every rank enters ``fabric.barrier()``."""
    from lightning.fabric import Fabric

    from lightning_zinf import ZeroInfinityFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ZeroInfinityFabricStrategy(timeout=timedelta(seconds=20)))
    fabric.launch()
    with fabric.init_module():
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        if SCENARIO == "fabric_raise" and fabric.global_rank == 1 and step == 2:
            raise ValueError("boom in rank 1's Fabric loop")
        if SCENARIO == "fabric_rank0_forward" and step == 2:
            # LitGPT's finetune scripts: generate_example on rank 0 alone, then fabric.barrier()
            if fabric.global_rank == 0:
                with torch.no_grad():
                    model(torch.randn(1, 8))
            fabric.barrier()
        fabric.backward(model(torch.randn(4, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    (OUT / f"pid{os.environ.get('LOCAL_RANK', '0')}").write_text(str(os.getpid()))
    if SCENARIO == "raise_in_quantized_reduce":
        _QuantizedReduce()
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 8))
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(timeout=timedelta(seconds=20), prefetch={"persistence_threshold": 0},
                                      offload={"optimizer": "cpu"} if SCENARIO == "step_raise" else None,
                                      **({"sharding": "hybrid", "shard_group_size": 1}
                                         if SCENARIO in ("killed_in_reduce", "raise_in_quantized_reduce") else {}),
                                      **({"zero_pp": {"qgz": True}} if SCENARIO == "raise_in_quantized_reduce" else {})),
        accelerator="cpu", devices=2, max_steps=4 if SCENARIO != "save" else 2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2 if SCENARIO == "rank_only_validation" else 0, val_check_interval=2,
        num_sanity_val_steps=0)
    ckpt = str(OUT / "ckpt") if SCENARIO == "corrupt" else None
    if SCENARIO == "rank_only_predict":
        trainer.predict(Lit(), DataLoader(data, batch_size=4))
        return
    trainer.fit(Lit(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), ckpt_path=ckpt)
    if SCENARIO == "save":
        trainer.save_checkpoint(OUT / "ckpt")
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    fabric_main() if SCENARIO.startswith("fabric") else main()
