"""A process killed at any filesystem step of a checkpoint save loses nothing.

Each run trains a 2-rank GPT for 6 steps and saves the checkpoint ``last.ckpt`` after steps 2 and
4. The second save (the one that replaces a checkpoint) is first run under an observer outside the
library: Python's audit hooks (every ``open`` for writing, ``mkdir``, ``rename``/``replace``,
``remove``, ``rmdir``, ``rmtree``) and a wrapper of ``os.fsync``, on every rank. That enumerates
the save's filesystem steps. Then, for each step of each rank, a fresh run is SIGKILLed just before
that step, and the test checks what a user resuming from ``last`` would get: ``last.ckpt`` is a
complete checkpoint, of step 4 (the new one) or step 2 (the previous one), and training from it
continues with exactly the losses of the uninterrupted run. The next save into the folder removes
what the killed save left behind.

The same holds for a full (one-file) checkpoint, for a name that changes kind (a sharded folder
replaced by a full file and back), and under Lightning's Trainer, whose ``fit(ckpt_path="last")``
finds the checkpoint by name.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_zinf import ZeroEngine
from lightning_zinf.checkpoint import durable
from lightning_zinf.checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.checkpoint.full import (full_optimizer_state_dict, load_full_checkpoint,
                                            load_full_optimizer_state_dict, save_full_checkpoint)
from tests import models
from tests.harness import RankDied, run_distributed

STEPS = 6
SAVES = (2, 4)
BATCH = 4
NAME = "last.ckpt"

#: Audit events that change the filesystem; ``open`` counts when it writes.
_MUTATIONS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.link", "os.symlink",
              "os.truncate"}


def _writes(args: tuple) -> bool:
    _, mode, flags = args
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))


class _Observer:
    """Counts this process's filesystem mutations under ``root`` (and relative ones, as ``rmtree``
    makes them) and the ``fsync`` calls; records them, or SIGKILLs the process before step ``kill_at``."""

    def __init__(self, root: str, kill_at: Optional[int | str], marker: Path) -> None:
        self.root, self.kill_at, self.marker = root.rstrip("/") + "/", kill_at, marker
        self.steps: list[str] = []
        self.active = False

    def _step(self, text: str) -> None:
        if len(self.steps) == self.kill_at or (isinstance(self.kill_at, str) and re.fullmatch(self.kill_at, text)):
            self.marker.write_text(text)  # (not under the checkpoint folder: the observer is inactive for it)
            os.kill(os.getpid(), signal.SIGKILL)
        self.steps.append(text)

    def audit(self, event: str, args: tuple) -> None:
        if not self.active or event not in _MUTATIONS:
            return
        if event == "open" and not _writes(args):
            return
        path = str(args[0])
        if os.path.isabs(path) and not path.startswith(self.root):
            return
        self.active = False  # the observer's own I/O is not a step
        try:
            self._step(f"{event} {' -> '.join(str(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))}")
        finally:
            self.active = True

    def install(self) -> None:
        sys.addaudithook(self.audit)
        fsync, exchange = os.fsync, durable._exchange

        def observed_fsync(fd: int) -> None:
            if self.active:
                target = os.readlink(f"/proc/self/fd/{fd}")
                self.active = False
                try:
                    self._step(f"fsync {target}")
                finally:
                    self.active = True
            fsync(fd)

        def observed_exchange(a: Path, b: Path) -> bool:  # renameat2 through ctypes: no audit event
            if self.active:
                self.active = False
                try:
                    self._step(f"exchange {a} <-> {b}")
                finally:
                    self.active = True
            return exchange(a, b)

        os.fsync = observed_fsync
        durable._exchange = observed_exchange


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = models.make_batch("gpt", step, BATCH)
    share = BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def _setup(seed: int) -> tuple[torch.nn.Module, ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = models.GPT()
    engine = ZeroEngine(model)
    return model, engine, engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train_step(model, optimizer, step: int, rank: int, world: int) -> float:
    loss = models.loss_fn(model, *_batch(step, rank, world))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _save(kind: str, model, engine, optimizer, path: Path, step: int) -> None:
    if kind == "sharded":
        save_sharded(engine, [optimizer], path, {"step": step})
        return
    with state_dict_options(model, rank0_only=True):
        state = model.state_dict()
    full = {"state_dict": state, "optimizer": full_optimizer_state_dict(engine, optimizer, rank0_only=True), "step": step}

    def broadcast(obj: Any) -> Any:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    save_full_checkpoint(full, path, writer=engine.comm.rank == 0, broadcast=broadcast)


def _load(model, engine, optimizer, path: Path) -> int:
    if is_sharded_checkpoint(path):
        return load_sharded(engine, [optimizer], path)["step"]
    checkpoint = load_full_checkpoint(path)
    model.load_state_dict(checkpoint["state_dict"])
    load_full_optimizer_state_dict(engine, optimizer, checkpoint["optimizer"])
    return checkpoint["step"]


def _run(rank: int, world: int, folder: str, kinds: tuple[str, str], kill: Optional[tuple[int, int]]) -> dict:
    """Train STEPS steps, saving ``last.ckpt`` of kind ``kinds[i]`` after step ``SAVES[i]``; the
    second save observed (``kill``: ``(rank, step)`` to SIGKILL before)."""
    model, engine, optimizer = _setup(0)
    observer = _Observer(folder, kill[1] if kill and kill[0] == rank else None, Path(folder + ".killed"))
    observer.install()
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(_train_step(model, optimizer, step, rank, world))
        if step in SAVES:
            observer.active = step == SAVES[-1]
            _save(kinds[SAVES.index(step)], model, engine, optimizer, Path(folder) / NAME, step)
            observer.active = False
    return {"losses": losses, "steps": observer.steps}


def _resume(rank: int, world: int, folders: list[str], kind: str) -> list[tuple[int, list[float]]]:
    """For each folder: load ``last.ckpt`` into a differently initialised model, train two steps,
    save again (removing what a killed save left), return (the step it resumed from, losses)."""
    out = []
    for folder in folders:
        model, engine, optimizer = _setup(99)
        start = _load(model, engine, optimizer, Path(folder) / NAME)
        losses = [_train_step(model, optimizer, step, rank, world) for step in (start + 1, start + 2)]
        _save(kind, model, engine, optimizer, Path(folder) / NAME, start + 2)
        out.append((start, losses))
    return out


def _same_step(killed: str, folder: Path, enumerated: str, reference: Path) -> bool:
    """Whether a killed run stopped at the enumerated step (the folders and save ids differ, and
    ``rmtree`` removes a folder's entries in the order the folder lists them)."""
    def plain(text: str, where: Path) -> str:
        event, _, target = text.partition(" ")
        if event in ("os.remove", "os.rmdir") and not target.startswith("/"):
            return "a removal inside rmtree"
        return re.sub(r"save-[0-9a-f]{12}", "save-<id>", text.replace(str(where), "<folder>"))
    return plain(killed, folder) == plain(enumerated, reference)


def _enumerate_and_kill(tmp_path: Path, kinds: tuple[str, str]) -> tuple[dict, list[tuple[int, int, str]], list[Path]]:
    reference = run_distributed(_run, 2, str(tmp_path / "reference"), kinds, None)
    steps = [(rank, i, text) for rank, result in enumerate(reference) for i, text in enumerate(result["steps"])]
    folders = []
    for rank, i, text in steps:
        folder = tmp_path / f"kill-{rank}-{i}"
        with pytest.raises((RankDied, RuntimeError)):
            run_distributed(_run, 2, str(folder), kinds, (rank, i), grace=0.0)
        assert _same_step(Path(str(folder) + ".killed").read_text(), folder, text, tmp_path / "reference")
        folders.append(folder)
    return reference, steps, folders


def _check_resumed(reference: list[dict], steps: list, folders: list[Path], kind: str) -> dict[int, int]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    resumed = run_distributed(_resume, 2, [str(f) for f in folders], kind)
    starts: dict[int, int] = {}
    for (rank, i, text), folder, *per_rank in zip(steps, folders, *resumed):
        assert (folder / NAME).exists(), f"killed before '{text}' on rank {rank}: no {NAME}"
        for r, (start, losses) in enumerate(per_rank):
            assert start in SAVES, (text, start)
            assert losses == reference[r]["losses"][start:start + 2], f"killed before '{text}' on rank {rank}"
        starts[per_rank[0][0]] = starts.get(per_rank[0][0], 0) + 1
        # The next save removed the killed save's leftovers: only the checkpoint remains.
        assert sorted(p.name for p in folder.iterdir()) == [NAME], (text, sorted(os.listdir(folder)))
        if (folder / NAME).is_dir():
            assert len(list((folder / NAME).iterdir())) == 2  # meta.pt and one save's shards
        # Lightning's ckpt_path="last" lookup finds it.
        callback = ModelCheckpoint(dirpath=folder)
        assert callback._find_last_checkpoints(trainer=None) == {str(folder / NAME)}
    return starts


@pytest.mark.parametrize("kinds", [("sharded", "sharded"), ("full", "full"), ("sharded", "full"), ("full", "sharded")],
                         ids=["sharded", "full", "sharded-to-full", "full-to-sharded"])
def test_a_rank_killed_at_any_filesystem_step_of_a_save_loses_nothing(tmp_path: Path, kinds: tuple[str, str]) -> None:
    reference, steps, folders = _enumerate_and_kill(tmp_path, kinds)
    kind = kinds[1]
    if kind == "sharded":
        texts = [t for _, _, t in steps]
        # What the enumeration must cover: each rank's shard file and its fsync, the commit, the removal.
        assert sum(t.startswith("fsync") and t.endswith(".safetensors") for t in texts) == 2, texts
        assert any(t.startswith("os.rename") and t.endswith("/meta.pt") for t in texts), texts
        assert any(t.startswith(("os.remove", "shutil.rmtree")) for t in texts), texts
    starts = _check_resumed(reference, steps, folders, kind)
    assert set(starts) == set(SAVES), starts  # some kill points keep the previous save, later ones the new


# --- under Lightning's Trainer --------------------------------------------------------------------------
EPOCHS = 3  # of 2 steps; ModelCheckpoint saves last.ckpt after each


def _fit_and_kill(rank: int, world: int, folder: str, kill: Optional[str], resume: bool) -> list[float]:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _tokens, _trainer

    class TwoStepEpochs(LitGPT):
        def train_dataloader(self):
            return self._loader(_tokens(GLOBAL_BATCH * 2, 1))

    observer = _Observer(folder, kill, Path(folder + ".killed"))
    observer.install()
    observer.active = not resume
    lit = TwoStepEpochs(GLOBAL_BATCH // world)
    callback = ModelCheckpoint(dirpath=folder, save_top_k=1, save_last=True, every_n_epochs=1)
    trainer = _trainer("zero_infinity", world, max_steps=-1, max_epochs=EPOCHS, limit_val_batches=0,
                       enable_checkpointing=True, callbacks=[callback])
    assert isinstance(trainer, L.Trainer)
    trainer.fit(lit, ckpt_path="last" if resume else None)
    return lit.train_losses


@pytest.mark.parametrize("kill, resumes_at", [
    (r"os\.rename .*/\.meta\.pt\.zinf-partial -> .*/last\.ckpt/meta\.pt", 2),  # the second save's commit
    (r"shutil\.rmtree .*/last\.ckpt/save-.*", 4),  # the second save's removal of the first
], ids=["before-commit", "removing-previous"])
def test_trainer_resumes_from_last_after_a_rank_is_killed_in_a_save(tmp_path: Path, kill: str, resumes_at: int) -> None:
    """``fit(ckpt_path="last")`` after rank 0 was SIGKILLed inside ModelCheckpoint's second save of
    ``last.ckpt`` resumes from a complete checkpoint (the previous one before the commit, the new one
    after) and continues the uninterrupted run's losses exactly; before this, a kill between two
    renames left no ``last.ckpt`` and the run silently started again from step 0."""
    reference = run_distributed(_fit_and_kill, 2, str(tmp_path / "reference"), None, False, init_pg=False)[0]
    assert len(reference) == 2 * EPOCHS
    folder = tmp_path / "killed"
    with pytest.raises((RankDied, RuntimeError)):
        run_distributed(_fit_and_kill, 2, str(folder), kill, False, init_pg=False, grace=0.0)
    assert re.fullmatch(kill, Path(str(folder) + ".killed").read_text())
    resumed = run_distributed(_fit_and_kill, 2, str(folder), None, True, init_pg=False)[0]
    assert len(resumed) == 2 * EPOCHS - resumes_at  # resumed at the expected step, not at 0
    assert resumed == reference[resumes_at:]
