"""Sharded checkpoints: exact resume, resume at another world size, atomic saves, bad input.

Each uninterrupted run trains 2 epochs of 5 steps and keeps its ModelCheckpoint directories; a
resumed run starts from the step-5 checkpoint (of a run at the same or another world size) and must
reproduce steps 6-10 of the uninterrupted run: bit for bit at the same world size, within fp32
tolerance at another (the reduce-scatter sums in another order). The checkpoints hold what Lightning
checkpoints usually hold (model and datamodule hyper-parameters with a path and a nested
AttributeDict, ModelCheckpoint and EarlyStopping state, an LR scheduler), so resuming also shows that
the safe (weights-only) read of ``meta.pt`` accepts all of it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict

from lightning_zinf import checkpoint
from lightning_zinf.checkpoint import CheckpointError, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_zinf import PrefetchConfig, ZeroEngine
from tests import models, optimizer_resume
from tests.harness import run_distributed
from tests.test_trainer import GLOBAL_BATCH, LitGPT, _tokens, _trainer

EPOCH_STEPS = 5


class LitEpochs(LitGPT):
    """LitGPT over epochs of 5 steps, with saved hyper-parameters (a nested ``AttributeDict`` and a
    path among them) and a logged ``train_loss`` for EarlyStopping."""

    def __init__(self, batch_size: int, schedule: AttributeDict | None = None, log_dir: Path = Path("logs")) -> None:
        super().__init__(batch_size)
        self.save_hyperparameters({"batch_size": batch_size, "log_dir": log_dir,
                                   "schedule": schedule or AttributeDict(step_size=2, decay=AttributeDict(gamma=0.5))})

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.detach(), sync_dist=True)
        return loss

    def train_dataloader(self):
        return self._loader(_tokens(GLOBAL_BATCH * EPOCH_STEPS, 1))


class EpochData(L.LightningDataModule):
    """LitEpochs' training data as a datamodule, so that the checkpoint holds datamodule
    hyper-parameters too (a path among them)."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return self.trainer.lightning_module.train_dataloader()


def _fit(rank: int, world: int, root: str, ckpt: str | None, manual: str | None,
         weights_only: bool | None = None) -> dict:
    lit = LitEpochs(GLOBAL_BATCH // world)
    callback = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    # mode="max" on a falling loss: epoch 0 stays the best, so a resumed run knows its score (and
    # counts epoch 1 as not improving) only from the checkpoint's callback state.
    stopping = EarlyStopping("train_loss", mode="max", patience=100, check_on_train_epoch_end=True)
    trainer = _trainer("zero_infinity", world, max_steps=-1, max_epochs=2, limit_val_batches=0,
                       enable_checkpointing=True, callbacks=[callback, stopping], default_root_dir=root)
    trainer.fit(lit, datamodule=EpochData(Path(root) / "data"), ckpt_path=ckpt, weights_only=weights_only)
    if manual:
        trainer.save_checkpoint(manual)
    with trainer.strategy.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in lit.named_parameters()}
    return {"losses": lit.train_losses, "weights": weights, "stopping": stopping.state_dict()}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    """Uninterrupted 10-step runs at world sizes 1, 2 and 4, with their checkpoint directories."""
    runs = {}
    for world in (1, 2, 4):
        root = tmp_path_factory.mktemp(f"full{world}")
        runs[world] = (root, run_distributed(_fit, world, str(root), None, str(root / "manual.ckpt"))[0])
    return runs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_resume_is_bit_exact(full_runs, tmp_path: Path, world: int) -> None:
    root, full = full_runs[world]
    step5 = root / "epoch=0-step=5.ckpt"
    assert is_sharded_checkpoint(step5) and is_sharded_checkpoint(root / "epoch=1-step=10.ckpt")
    assert len(list(step5.glob("save-*/rank_*.safetensors"))) == world
    resumed = run_distributed(_fit, world, str(tmp_path), str(step5), None)[0]
    assert len(full["losses"]) == 2 * EPOCH_STEPS and len(resumed["losses"]) == EPOCH_STEPS
    assert resumed["losses"] == full["losses"][EPOCH_STEPS:]
    for name, value in full["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert resumed["stopping"]["wait_count"] == full["stopping"]["wait_count"] == 1
    assert torch.equal(resumed["stopping"]["best_score"], full["stopping"]["best_score"])


@pytest.mark.parametrize("saved, resumed", [(4, 2), (2, 4), (2, 1)])
def test_resume_at_another_world_size(full_runs, tmp_path: Path, saved: int, resumed: int) -> None:
    root, _ = full_runs[saved]
    out = run_distributed(_fit, resumed, str(tmp_path), str(root / "epoch=0-step=5.ckpt"), None)[0]
    reference = full_runs[resumed][1]  # the uninterrupted run at the new world size
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(reference["losses"][EPOCH_STEPS:]),
                               rtol=1e-5, atol=0)


def test_manual_save_checkpoint_resumes(full_runs, tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after fit (step 10) loads into a new run that has nothing left to
    do: the weights it ends with are the saved ones, exactly."""
    root, full = full_runs[2]
    out = run_distributed(_fit, 2, str(tmp_path), str(root / "manual.ckpt"), None)[0]
    assert out["losses"] == []
    for name, value in full["weights"].items():
        assert torch.equal(out["weights"][name], value), name


# --- meta.pt is read without running code from it ----------------------------------------------------
def _touch(path: str) -> None:
    """What the crafted checkpoint makes the unpickler call: creates ``path`` (a harmless stand-in
    for any code an attacker would run)."""
    Path(path).touch()


class _RunsCode:
    """Unpickles by calling :func:`_touch` on ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def _craft(source: Path, target: Path, marker: Path) -> Path:
    """A copy of the real checkpoint ``source`` whose ``meta.pt`` also holds a :class:`_RunsCode`."""
    shutil.copytree(source, target)
    meta = torch.load(target / "meta.pt", weights_only=False)  # written by the strategy above
    meta["payload"] = _RunsCode(marker)
    torch.save(meta, target / "meta.pt", pickle_module=checkpoint.format._META_PICKLE)  # as the strategy saves it
    return target


def _resume_refused(rank: int, world: int, root: str, ckpt: str, weights_only: bool | None) -> str:
    with pytest.raises(CheckpointError) as refused:
        _fit(rank, world, root, ckpt, None, weights_only)
    return str(refused.value)


@pytest.mark.parametrize("weights_only", [None, True])
def test_crafted_meta_runs_no_code_unless_trusted(full_runs, tmp_path: Path, weights_only: bool | None) -> None:
    """A checkpoint whose meta.pt would run code when unpickled: resuming through the Trainer (with
    Lightning's default ``weights_only=None``, and ``True``) and consolidating both refuse on every
    rank, naming the global, the file and the two fixes, and the code never runs. Trusted
    (``weights_only=False``, ``--no-weights-only``), it is unpickled fully and the run resumes exactly."""
    from lightning_zinf.consolidate import main

    root, full = full_runs[2]
    marker = tmp_path / "code-ran"
    crafted = _craft(root / "epoch=0-step=5.ckpt", tmp_path / "crafted.ckpt", marker)
    refusal = (r"crafted.ckpt/meta.pt names tests.test_checkpoint._touch, which the safe \(weights-only\) load "
               r"refuses.*add_safe_globals\(\[tests.test_checkpoint._touch\]\).*trainer.fit\(model, ckpt_path=..., "
               r"weights_only=False\).*zinf-consolidate --no-weights-only")
    for message in run_distributed(_resume_refused, 2, str(tmp_path / "resumed"), str(crafted), weights_only):
        assert re.search(refusal, message), message
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match=refusal):
        main([str(crafted), str(out)])
    assert not marker.exists() and not out.exists()
    if weights_only is not None:
        return  # the trusted runs below are the same for both

    main([str(crafted), str(out), "--no-weights-only"])
    assert marker.exists() and out.exists()
    marker.unlink()
    resumed = run_distributed(_fit, 2, str(tmp_path / "trusted"), str(crafted), None, False)[0]
    assert marker.exists()
    assert resumed["losses"] == full["losses"][EPOCH_STEPS:]


# --- bad input, engine level (one process) -----------------------------------------------------------
def _saved_engine(path: Path, frozen: bool = False, unit_size: Optional[int] = None) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = models.MLP(frozen=frozen)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=unit_size))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    models.loss_fn(model, *models.make_batch("mlp", 0, 4)).backward()
    optimizer.step()
    save_sharded(engine, [optimizer], path, {"note": "test"})
    return engine, optimizer


@pytest.mark.parametrize("frozen", [False, True])
def test_round_trip_restores_weights_and_state(tmp_path: Path, frozen: bool) -> None:
    engine, optimizer = _saved_engine(tmp_path / "ckpt", frozen)
    torch.manual_seed(1)
    other_model = models.MLP(frozen=frozen)
    other = ZeroEngine(other_model)
    other_opt = other.shard_optimizer(torch.optim.AdamW(other_model.parameters(), lr=1e-2))
    assert load_sharded(other, [other_opt], tmp_path / "ckpt")["note"] == "test"
    assert any(not g.trainable for g in other.groups) == frozen
    for a, b in zip(engine.groups, other.groups):
        assert torch.equal(a.shard, b.shard)  # frozen parameters included
    for a, b in zip(engine.master_fragments(), other.master_fragments()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[a][key], other_opt.state[b][key])


def test_shard_files_are_safetensors_whatever_the_header_room(tmp_path: Path, monkeypatch) -> None:
    """Shard files open with the safetensors library and hold the engine's shards and optimizer
    state, also when the header outgrows the room reserved for it (the tensor bytes are moved up)."""
    from safetensors import safe_open
    from lightning_zinf import checkpoint

    engine, optimizer = _saved_engine(tmp_path / "roomy")
    monkeypatch.setattr(checkpoint.save, "_HEADER_ROOM_BASE", 8)
    monkeypatch.setattr(checkpoint.save, "_HEADER_ROOM_PER_GROUP", 0)
    save_sharded(engine, [optimizer], tmp_path / "tight", {})
    fragment = engine.groups[0].fragments[0]
    for name in ("roomy", "tight"):
        (data,) = (tmp_path / name).glob("save-*")
        with safe_open(str(data / "rank_00000.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("0.param"), engine.groups[0].shard)
            assert torch.equal(f.get_tensor("0.opt0.exp_avg")[: fragment.numel()], optimizer.state[fragment]["exp_avg"])
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["meta.pt", data.name]
        assert sorted(p.name for p in data.iterdir()) == ["rank_00000.safetensors"]
    torch.manual_seed(1)
    other_model = models.MLP()
    other = ZeroEngine(other_model)
    load_sharded(other, [], tmp_path / "tight")
    for a, b in zip(engine.groups, other.groups):
        assert torch.equal(a.shard, b.shard)


def test_different_model_is_rejected(tmp_path: Path) -> None:
    _saved_engine(tmp_path / "ckpt")
    wider = ZeroEngine(models.MLP(hidden=64))
    with pytest.raises(CheckpointError, match=r"different model: unit 'fc1\.\.fc3' has shapes"):
        load_sharded(wider, [], tmp_path / "ckpt")


def test_missing_and_truncated_shard_files(tmp_path: Path) -> None:
    engine, _ = _saved_engine(tmp_path / "ckpt")
    (shard,) = (tmp_path / "ckpt").glob("save-*/rank_00000.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors is corrupt or truncated"):
        load_sharded(engine, [], tmp_path / "ckpt")
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors is missing"):
        load_sharded(engine, [], tmp_path / "ckpt")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    engine = ZeroEngine(models.MLP())
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match=r"plain is not a lightning_zinf checkpoint"):
        load_sharded(engine, [], tmp_path / "plain")
    (tmp_path / "file.ckpt").write_text("x")
    with pytest.raises(FileExistsError, match="is not a checkpoint .*refusing to replace it"):
        save_sharded(engine, [], tmp_path / "file.ckpt", {})


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A save that dies after writing part of the new checkpoint leaves the old one loadable."""
    engine, optimizer = _saved_engine(tmp_path / "ckpt")
    before = [g.shard.clone() for g in engine.groups]
    for group in engine.groups:
        group.shard.add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", crash)  # dies while writing meta.pt, after the shard files
    with pytest.raises(OSError, match="No space left"):
        save_sharded(engine, [optimizer], tmp_path / "ckpt", {})
    monkeypatch.undo()
    load_sharded(engine, [optimizer], tmp_path / "ckpt")
    for group, old in zip(engine.groups, before):
        assert torch.equal(group.shard, old)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the failed save's files are removed
    assert len(list((tmp_path / "ckpt").glob("save-*"))) == 1


# --- format versions ---------------------------------------------------------------------------------
def _save_version1(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    """Save the way format version 1 did: shards of ``ceil(numel / W)`` elements, no
    ``shard_numel`` in the layout. Returns the full weights."""
    from lightning_zinf.engine import flat

    flat.SHARD_ALIGN = 1  # this worker process only
    torch.manual_seed(3)
    model = models.GPT()
    engine = ZeroEngine(model)
    assert any(g.shard_numel % 16 for g in engine.groups)  # the two layouts differ
    save_sharded(engine, [], path, {})
    if rank == 0:
        meta = torch.load(Path(path) / "meta.pt", weights_only=False)
        meta["zinf"]["version"] = 1
        for group in meta["zinf"]["groups"]:
            del group["shard_numel"]
        torch.save(meta, Path(path) / "meta.pt")
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _load_weights(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(4)
    model = models.GPT()
    engine = ZeroEngine(model)
    load_sharded(engine, [], path)
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_version1_checkpoint_loads_and_consolidates(tmp_path: Path) -> None:
    """Checkpoints from before shards were padded to 16 elements load at another world size and
    consolidate, value for value; a checkpoint from a newer format is refused by name."""
    from safetensors.torch import load_file
    from lightning_zinf.consolidate import consolidate

    saved = run_distributed(_save_version1, 3, str(tmp_path / "v1"))[0]
    loaded = run_distributed(_load_weights, 2, str(tmp_path / "v1"))[0]
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    consolidate(tmp_path / "v1", tmp_path / "v1.safetensors")
    for name, value in load_file(str(tmp_path / "v1.safetensors")).items():
        assert torch.equal(value, saved[name]), name

    meta = torch.load(tmp_path / "v1" / "meta.pt", weights_only=False)
    meta["zinf"]["version"] = 99
    torch.save(meta, tmp_path / "v1" / "meta.pt")
    with pytest.raises(CheckpointError, match="format version 99 by a newer lightning_zinf.*upgrade"):
        load_sharded(ZeroEngine(models.GPT()), [], tmp_path / "v1")
    with pytest.raises(CheckpointError, match="format version 99 by a newer lightning_zinf.*upgrade"):
        consolidate(tmp_path / "v1", tmp_path / "v99.pt")
    assert not list(tmp_path.glob("v99*"))


def _tiny_groups(rank: int, world: int, path: str, seed: int, save: bool) -> dict:
    """A model with a 20-element unit (LayerNorm(10)): at W=3 its shards are 16 elements, so rank 2's
    (elements 32-47) is all padding. Save after one AdamW step, or load; return the weights and the
    optimizer state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.LayerNorm(10))
    engine = ZeroEngine(model)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if save:
        model(torch.randn(4, 16)).pow(2).sum().backward()
        opt.step()
        save_sharded(engine, [opt], path, {})
    else:
        load_sharded(engine, [opt], path)
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    exp_avg = [opt.state[f]["exp_avg"].clone() for f in engine.master_fragments() if f in opt.state]
    return {"weights": weights, "exp_avg": exp_avg}


def test_ranks_that_own_only_padding_save_and_load(tmp_path: Path) -> None:
    saved = run_distributed(_tiny_groups, 3, str(tmp_path / "ckpt"), 0, True)
    loaded = run_distributed(_tiny_groups, 3, str(tmp_path / "ckpt"), 1, False)
    for before, after in zip(saved, loaded):
        for name, value in before["weights"].items():
            assert torch.equal(after["weights"][name], value), name
        assert len(after["exp_avg"]) == len(before["exp_avg"])
        for a, b in zip(before["exp_avg"], after["exp_avg"]):
            assert torch.equal(a, b)


# --- loading a plain state dict into the partitioned model ------------------------------------------
def _load_pretrained(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    from lightning_zinf import meta_parameters
    from lightning_zinf.checkpoint import load_full_state_dict

    holder = torch.nn.Module()
    with meta_parameters():
        holder.model = models.GPT()
    engine = ZeroEngine(holder)
    load_full_state_dict(engine, path, prefix="model.")
    with engine.gathered():
        return {n: p.detach().clone() for n, p in holder.model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_load_pretrained_safetensors_into_partitioned_model(tmp_path: Path, world: int) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(7)
    pretrained = models.GPT()
    state = {k: v for k, v in pretrained.state_dict().items() if k != "head.weight"}  # tied: stored once
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = run_distributed(_load_pretrained, world, str(tmp_path / "model.safetensors"))[0]
    for name, value in pretrained.state_dict().items():
        assert torch.equal(loaded[name], value), name


def test_load_pretrained_rejects_mismatches(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from lightning_zinf.checkpoint import load_full_state_dict

    save_file({k: v for k, v in models.MLP(hidden=64).state_dict().items()}, str(tmp_path / "m.safetensors"))
    engine = ZeroEngine(models.MLP(buffer=True))
    shift = torch.full((16,), 3.0)
    load_full_state_dict(engine, {**models.MLP().state_dict(), "shift": shift})  # buffers load too
    assert torch.equal(engine.module.shift, shift)
    with pytest.raises(CheckpointError, match=r"'fc1.weight' has shape \[64, 16\] but the model's parameter has \[48, 16\]"):
        load_full_state_dict(engine, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"missing \['fc3.bias'\]"):
        load_full_state_dict(engine, {k: v for k, v in models.MLP().state_dict().items() if k != "fc3.bias"})
    with pytest.raises(CheckpointError, match="does not exist"):
        load_full_state_dict(engine, tmp_path / "nope.safetensors")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_consolidate_matches_the_trained_model(full_runs, tmp_path: Path, suffix: str) -> None:
    from safetensors.torch import load_file

    from lightning_zinf.consolidate import main

    root, full = full_runs[4]
    out = tmp_path / f"model{suffix}"
    main([str(root / "epoch=1-step=10.ckpt"), str(out), "--strip-prefix", "model."])
    state = load_file(str(out)) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    plain = models.GPT()
    plain.load_state_dict(state, strict=True)  # every name of the plain model, tied head included
    assert set(state) == set(plain.state_dict())
    for name, value in plain.named_parameters():
        assert torch.equal(value, full["weights"][f"model.{name}"]), name
    assert torch.equal(plain.head.weight, plain.wte.weight)


def _save_then_die(rank: int, world: int, path: str) -> None:
    """Save once, change the weights, then die (SIGKILL) halfway through writing the next save."""
    import signal

    from lightning_zinf import checkpoint

    engine, optimizer = _saved_engine(Path(path), unit_size=0)  # a unit per module: several groups to write
    for group in engine.groups:
        group.shard.add_(1.0)
    original = checkpoint.save._group_tensors
    written: list[int] = []

    def die_after_the_first_group(i, group, owners):  # the shard file is written group by group
        if written:
            os.kill(os.getpid(), signal.SIGKILL)
        written.append(i)
        return original(i, group, owners)

    checkpoint.save._group_tensors = die_after_the_first_group
    save_sharded(engine, [optimizer], path, {})


def test_killed_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    from tests.harness import RankDied

    with pytest.raises(RankDied, match="exit codes {0: -9}"):
        run_distributed(_save_then_die, 1, str(tmp_path / "ckpt"))
    engine, optimizer = _saved_engine(tmp_path / "expected", unit_size=0)  # the same weights as the first save
    torch.manual_seed(3)
    fresh_model = models.MLP()
    fresh = ZeroEngine(fresh_model, prefetch=PrefetchConfig(unit_size=0))
    fresh_opt = fresh.shard_optimizer(torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    load_sharded(fresh, [fresh_opt], tmp_path / "ckpt")
    for got, want in zip(fresh.groups, engine.groups):
        assert torch.equal(got.shard, want.shard)


def _top_k(rank: int, world: int, root: str) -> list[str]:
    lit = LitEpochs(GLOBAL_BATCH // world)
    keep_last = ModelCheckpoint(dirpath=root, monitor="step", mode="max", save_top_k=1, every_n_epochs=1)
    trainer = _trainer("zero_infinity", world, max_steps=-1, max_epochs=2, limit_val_batches=0,
                       enable_checkpointing=True, callbacks=[keep_last], default_root_dir=root)
    trainer.fit(lit)
    return sorted(os.listdir(root))


def test_model_checkpoint_top_k_removes_old_directories(tmp_path: Path) -> None:
    assert run_distributed(_top_k, 2, str(tmp_path))[0] == ["epoch=1-step=10.ckpt"]
    assert is_sharded_checkpoint(tmp_path / "epoch=1-step=10.ckpt")


def test_checkpoint_save_benchmark_runs(tmp_path: Path) -> None:
    """examples/benchmarks/checkpoint_save.py end to end on a 64K-parameter model (a smoke test;
    no speed is checked): every byte of the checkpoint is written once."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "checkpoint_save.py"
    spec = importlib.util.spec_from_file_location("checkpoint_save_benchmark", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = tmp_path / "result.json"
    assert module.main(["--params", "65536", "--dir", str(tmp_path / "bench"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["current"]
    assert result["params"] == 65536
    assert 0.9 * result["checkpoint_bytes"] < result["wchar"] < 1.2 * result["checkpoint_bytes"]


class LitLoraEpochs(LitEpochs):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = models.GPT(lora_rank=4)  # everything but the adapters frozen


def _fit_lora(rank: int, world: int, root: str, ckpt: str | None) -> dict:
    from lightning_zinf import ZeroInfinityStrategy

    lit = LitLoraEpochs(GLOBAL_BATCH // world)
    callback = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(ZeroInfinityStrategy(exclude_frozen_parameters=True), world, max_steps=-1, max_epochs=2,
                       limit_val_batches=0, enable_checkpointing=True, callbacks=[callback], default_root_dir=root)
    trainer.fit(lit, ckpt_path=ckpt)
    with trainer.strategy.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in lit.named_parameters()}
    trainable = sum(g.padded_numel for g in trainer.strategy.engine.groups if g.trainable)
    return {"losses": lit.train_losses, "weights": weights, "trainable": trainable}


def test_exclude_frozen_parameters_saves_the_adapters_only_and_resumes_exactly(tmp_path: Path) -> None:
    """``exclude_frozen_parameters=True`` on a LoRA run: the shard files hold the adapters (and
    their optimizer state) only, and a resume from the epoch-0 checkpoint, with the frozen base
    rebuilt as before, reproduces epoch 1 bit for bit."""
    from safetensors import safe_open

    full = run_distributed(_fit_lora, 2, str(tmp_path / "full"), None)[0]
    step5 = tmp_path / "full" / "epoch=0-step=5.ckpt"
    params = 0
    for shard in step5.glob("save-*/rank_*.safetensors"):
        with safe_open(shard, "pt") as f:
            params += sum(f.get_slice(k).get_shape()[0] for k in f.keys() if k.endswith(".param"))
    assert params == full["trainable"]  # each rank's adapter shards, nothing of the frozen base
    resumed = run_distributed(_fit_lora, 2, str(tmp_path / "resumed"), str(step5))[0]
    assert resumed["losses"] == full["losses"][EPOCH_STEPS:]
    for name, value in full["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    from lightning_zinf.consolidate import consolidate

    with pytest.raises(CheckpointError, match="saved with exclude_frozen_parameters"):
        consolidate(step5, tmp_path / "whole.safetensors")


def _two_saves(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = models.MLP()
    engine = ZeroEngine(model)
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    models.loss_fn(model, *models.make_batch("mlp", 0, 4)).backward()
    optimizer.step()
    save_sharded(engine, [optimizer], Path(root) / f"w{world}-a", {})
    save_sharded(engine, [optimizer], Path(root) / f"w{world}-b", {})


def test_files_of_different_saves_are_named_as_such(tmp_path: Path) -> None:
    """A meta.pt copied over another checkpoint's (another world size), or a shard file copied in
    from another save of the same layout: the error says the files come from different saves, with
    the world sizes, instead of calling a healthy shard corrupt."""
    run_distributed(_two_saves, 2, str(tmp_path))
    run_distributed(_two_saves, 1, str(tmp_path))
    engine = ZeroEngine(models.MLP())
    shutil.copy(tmp_path / "w1-a" / "meta.pt", tmp_path / "w2-a" / "meta.pt")
    with pytest.raises(CheckpointError, match=r"names the shard folder save-\w+, which is not in .*w2-a \(it holds "
                                              r"save-\w+\): meta.pt comes from a different save \(of 1 ranks\)"):
        load_sharded(engine, [], tmp_path / "w2-a")
    (a,) = (tmp_path / "w2-b").glob("save-*/rank_00001.safetensors")
    (b,) = (tmp_path / "w2-a").glob("save-*/rank_00001.safetensors")  # same layout, another save
    shutil.copy(b, a)
    with pytest.raises(CheckpointError, match=r"rank_00001.safetensors and .*meta.pt come from different saves.*"
                                              r"The shard was written by save save-\w+ as rank 1 of 2; meta.pt by save "
                                              r"save-\w+ of 2 ranks"):
        load_sharded(engine, [], tmp_path / "w2-b")


@pytest.mark.parametrize("kind, flags", [
    (torch.optim.AdamW, {}), (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {"fused": True}),
    (torch.optim.ASGD, {}),  # 0-d states besides step: eta, mu
], ids=["plain", "foreach", "fused", "asgd"])  # fmt: skip
def test_restored_optimizer_state_is_placed_as_torch_places_it(tmp_path: Path, kind: type, flags: dict) -> None:
    """Every restored state tensor has the device and dtype torch's own
    ``Optimizer.load_state_dict`` gives it for the param group's flags (``step`` as fp32, on the
    parameters' device for ``fused``; other scalars in the parameters' dtype), and a fused CPU AdamW
    resumes exactly: the losses after the resume equal the uninterrupted run's. The CUDA run (fused
    and capturable) is in test_gpu.py."""
    run = optimizer_resume.resumed_run(flags, "cpu", tmp_path / "ckpt", kind=kind)
    assert run["placed"] == optimizer_resume.torch_placement(flags, "cpu", kind)
    assert run["resumed"] == run["straight"]


# --- other units than the save's ------------------------------------------------------------------
def _gpt_engine(seed: int, units: dict) -> tuple[ZeroEngine, torch.optim.Optimizer]:
    from lightning_zinf import PrefetchConfig

    torch.manual_seed(seed)
    model = models.GPT(d=64, layers=4, vocab=64, heads=2)
    engine = ZeroEngine(model, block_classes=units.get("block_classes", ()),
                        prefetch=PrefetchConfig(persistence_threshold=0, unit_size=units.get("unit_size")))
    return engine, engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def _train_steps(engine: ZeroEngine, optimizer: torch.optim.Optimizer, rank: int, world: int,
                 steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses += models.accumulate_step(engine.module, rank, world, step, 8, 1)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _regrouped(rank: int, world: int, path: str, saved_units: dict, loaded_units: dict) -> dict:
    engine, optimizer = _gpt_engine(0, saved_units)
    before = _train_steps(engine, optimizer, rank, world, range(2))
    save_sharded(engine, [optimizer], path, {})
    after = _train_steps(engine, optimizer, rank, world, range(2, 4))
    other, other_opt = _gpt_engine(1, loaded_units)
    load_sharded(other, [other_opt], path)
    resumed = _train_steps(other, other_opt, rank, world, range(2, 4))
    return {"before": before, "after": after, "resumed": resumed,
            "units": (len(engine.units), len(other.units))}


@pytest.mark.parametrize("saved_units, loaded_units", [
    ({"unit_size": 0}, {"block_classes": ["Block"]}),
    ({"block_classes": ["Block"]}, {"unit_size": 0}),
    ({"unit_size": 0}, {"unit_size": 60_000}),
], ids=["per-module-to-blocks", "blocks-to-per-module", "per-module-to-grouped"])
def test_a_checkpoint_resumes_in_other_units(tmp_path: Path, saved_units: dict, loaded_units: dict) -> None:
    """A checkpoint saved with one grouping of the modules into units (a unit per module, the
    user's ``block_classes``, a ``unit_size``) resumes with another: every parameter's weights,
    fp32 master and AdamW moments come back from its range of the saved flat groups, and the
    resumed steps' losses equal, bit for bit, those of the run that was never interrupted (AdamW
    with weight decay: moments or step counts out of place would change them)."""
    for r in run_distributed(_regrouped, 2, str(tmp_path / "ckpt"), saved_units, loaded_units):
        assert r["units"][0] != r["units"][1], r["units"]  # the grouping did change
        assert r["resumed"] == r["after"], r


def _unused_then_used(path: str, unit_size: int, save: bool) -> list[float]:
    from lightning_zinf import PrefetchConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=unit_size, persistence_threshold=0))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    if save:  # trained without the middle layer, which so has no optimizer state yet
        for _ in range(2):
            model[2](model[0](x)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        save_sharded(engine, [optimizer], path, {})
    else:
        load_sharded(engine, [optimizer], path)
    losses = []
    for _ in range(2):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_parameter_without_optimizer_state_starts_afresh_in_other_units(tmp_path: Path) -> None:
    """A layer never stepped before the save has no AdamW state in it; loaded into one unit
    with the layers that have, it still starts afresh (no moments, no step count taken from its
    new neighbours), as with the save's own units: the same losses, bit for bit."""
    path = str(tmp_path / "ckpt")
    _unused_then_used(path, 0, save=True)
    same_units = _unused_then_used(path, 0, save=False)
    one_unit = _unused_then_used(path, 10_000, save=False)
    assert one_unit == same_units


def _save_per_module(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    engine, optimizer = _gpt_engine(0, {"unit_size": 0})
    _train_steps(engine, optimizer, rank, world, range(2))
    save_sharded(engine, [optimizer], path, {})
    with engine.gathered():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_a_checkpoint_of_two_ranks_loads_into_other_units_on_one(tmp_path: Path) -> None:
    """Saved by 2 ranks with a unit per module, loaded by 1 rank whose units pack whole blocks:
    each parameter's range is read across the old ranks' files, and every weight is the saved one."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_per_module, 2, path)[0]
    engine, optimizer = _gpt_engine(1, {"unit_size": 60_000})
    assert "blocks.0" in [u.name for u in engine.units]  # a whole block: the save had a unit per module
    load_sharded(engine, [optimizer], path)
    with engine.gathered():
        for name, p in engine.module.named_parameters():
            assert torch.equal(p, saved[name]), name
