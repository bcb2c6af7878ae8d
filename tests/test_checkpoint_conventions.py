"""Checkpoints as Lightning's own strategies behave, where its DeepSpeed and FSDP tests look: no entry
of the user's is overwritten or dropped, a missing checkpoint is a ``FileNotFoundError`` (naming the
folder to pass when a part of one was given), a folder saved under a file's name says so, a plain
state dict loads before setup, the Trainer strategy's state-dict methods return what FSDP's return,
the exception types FSDP raises, a ``fabric.save`` checkpoint consolidates into ``fabric.save``'s
DDP layout. Real Fabric and Trainer runs on two gloo ranks, against the same calls under DDP.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import CheckpointError, ZeroInfinityStrategy
from lightning_zinf.consolidate import consolidate
from tests import models
from tests.harness import run_distributed
from tests.test_full_checkpoint import Lit

MICRO = 4  # samples per rank and step


def _fabric(strategy) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _mlp(fabric: Fabric, meta: bool = True, **kw) -> models.MLP:
    torch.manual_seed(0)
    with fabric.init_module() if meta else contextlib.nullcontext():
        return models.MLP(buffer=True, **kw)


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(fabric: Fabric, model, optimizer, steps: range) -> list[float]:
    """Train each rank on its half of each step's global batch; the losses (mean over ranks)."""
    losses = []
    for step in steps:
        x, y = models.make_batch("mlp", step, 2 * MICRO)
        lo = fabric.global_rank * MICRO
        loss = F.mse_loss(model(x[lo:lo + MICRO]), y[lo:lo + MICRO])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    return losses


# --- no entry of the user's is overwritten or dropped -------------------------------------------------
OWN_NAMES = {"state_dict": {"note": 1}, "optimizer_states": [2, 3], "zinf": "the user's", "zinf_models": "a",
             "zinf_user_state": 4, "zinf_optimizer_keys": ["b"], "pytorch-lightning_version": "0.0"}


def _own_names(rank: int, world: int, folder: str, strategy: str) -> dict:
    fabric = _fabric(strategy)
    model = _mlp(fabric)
    model, optimizer = fabric.setup(model, _adamw(model))
    teacher = fabric.setup(_mlp(fabric))  # a second model, not trained (DDP refuses a frozen one)
    _steps(fabric, model, optimizer, range(2))
    fabric.save(f"{folder}/one", {"model": model, "optimizer": optimizer, **OWN_NAMES})
    fabric.save(f"{folder}/two", {"student": model, "teacher": teacher, "optimizer": optimizer, **OWN_NAMES})
    straight = _steps(fabric, model, optimizer, range(2, 4))

    out = {"straight": straight}
    for name, keys in (("one", ("model",)), ("two", ("student", "teacher"))):
        fabric = _fabric(strategy)
        model = _mlp(fabric)
        model, optimizer = fabric.setup(model, _adamw(model))
        teacher = fabric.setup(_mlp(fabric))
        state = {keys[0]: model, "optimizer": optimizer, **{k: None for k in OWN_NAMES}}
        if len(keys) == 2:
            state[keys[1]] = teacher
        remainder = fabric.load(f"{folder}/{name}", state)
        out[name] = {"entries": {k: state[k] for k in OWN_NAMES}, "remainder": remainder,
                     "resumed": _steps(fabric, model, optimizer, range(2, 4))}
    return out


def test_fabric_save_keeps_every_entry_whatever_its_name(tmp_path: Path) -> None:
    """``fabric.save`` entries named as the checkpoint's own (``state_dict``, ``optimizer_states``,
    ``zinf``...) come back from ``fabric.load`` as saved, as under DDP, and the model and optimizer
    resume exactly, for one model and for several. (They were overwritten by the strategy's own:
    the load failed with ``KeyError``/``TypeError``.)"""
    want = run_distributed(_own_names, 2, str(tmp_path / "ddp"), "ddp", init_pg=False)[0]
    got = run_distributed(_own_names, 2, str(tmp_path / "zinf"), "zero_infinity", init_pg=False)[0]
    for name in ("one", "two"):
        assert got[name]["entries"] == want[name]["entries"] == OWN_NAMES
        assert got[name]["remainder"] == want[name]["remainder"] == {}
        assert got[name]["resumed"] == got["straight"]  # bit for bit
        torch.testing.assert_close(torch.tensor(got[name]["resumed"]), torch.tensor(want[name]["resumed"]),
                                   rtol=1e-5, atol=0)


class _Noting(Lit):
    """Adds an entry named ``zinf`` to its checkpoints."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["zinf"] = "the user's"


def _reserved_in_trainer(rank: int, world: int, folder: str) -> str:
    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Noting(4))
    with pytest.raises(ValueError) as error:
        trainer.save_checkpoint(Path(folder) / "noted.ckpt")
    assert not (Path(folder) / "noted.ckpt").exists()  # nothing written
    return str(error.value)


def test_a_trainer_entry_under_a_reserved_name_is_refused_at_save(tmp_path: Path) -> None:
    """An entry ``on_save_checkpoint`` puts under a name the sharded checkpoint's ``meta.pt`` uses
    itself is refused on every rank before anything is written (it was overwritten silently)."""
    for message in run_distributed(_reserved_in_trainer, 2, str(tmp_path), init_pg=False):
        assert "entry named 'zinf'" in message and "Nothing was written" in message


# --- a missing checkpoint is a FileNotFoundError ------------------------------------------------------
def _not_found(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    ddp = _fabric("ddp")
    model = _mlp(ddp)
    model, optimizer = ddp.setup(model, _adamw(model))
    with pytest.raises(FileNotFoundError):
        ddp.load(folder / "missing", {"model": model, "optimizer": optimizer})  # the reference: DDP's type

    fabric = _fabric("zero_infinity")
    model = _mlp(fabric)
    model, optimizer = fabric.setup(model, _adamw(model))
    fabric.save(folder / "ckpt", {"model": model, "optimizer": optimizer})
    if rank == 0:
        (folder / "empty").mkdir()
    fabric.barrier()
    inner = next((folder / "ckpt").glob("save-*"))
    cases = {"missing": folder / "missing", "empty": folder / "empty", "inner": inner,
             "shard": inner / "rank_00001.safetensors", "meta": folder / "ckpt" / "meta.pt"}
    messages = {}
    for case, path in cases.items():
        with pytest.raises(FileNotFoundError) as error:
            fabric.load(path, {"model": model, "optimizer": optimizer})
        assert isinstance(error.value, CheckpointError)
        messages[case] = str(error.value)
    with pytest.raises(FileNotFoundError) as error:
        fabric.load_raw(inner / "rank_00000.safetensors", model)
    messages["load_raw shard"] = str(error.value)
    with pytest.raises(FileNotFoundError) as error:
        consolidate(inner, folder / f"out{rank}.pt")
    messages["consolidate inner"] = str(error.value)

    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(4))
    trainer.save_checkpoint(folder / "trainer.ckpt")
    shard = next((folder / "trainer.ckpt").glob("save-*/rank_00000.safetensors"))
    for case, path in {"trainer missing": folder / "nothing.ckpt", "trainer shard": shard}.items():
        with pytest.raises(FileNotFoundError) as error:
            L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False).fit(Lit(4), ckpt_path=path)
        messages[case] = str(error.value)
    return {k: v.replace(str(folder), "<tmp>") for k, v in messages.items()}


def test_a_missing_checkpoint_is_a_file_not_found_error_naming_the_folder_to_pass(tmp_path: Path) -> None:
    """``fabric.load``, ``fabric.load_raw``, ``trainer.fit(ckpt_path=...)`` and ``consolidate`` of a
    path that does not exist, an empty folder, or a part of a checkpoint (its ``save-<id>/`` folder,
    a shard file, its ``meta.pt``) raise ``FileNotFoundError`` on every rank, as DDP and DeepSpeed do;
    given a part, the message names the checkpoint folder to pass instead. (They raised
    ``CheckpointError``, a ``ValueError``; a shard file gave ``KeyError: 'model'`` in Fabric and an
    optimizer-count error in the Trainer.)"""
    for messages in run_distributed(_not_found, 2, str(tmp_path), init_pg=False):
        assert messages["missing"] == "Checkpoint not found: <tmp>/missing does not exist."
        assert "<tmp>/empty is not a lightning_zinf checkpoint: the folder holds no meta.pt" in messages["empty"]
        for case in ("inner", "shard", "meta", "load_raw shard", "consolidate inner"):
            assert "is a part of the sharded checkpoint <tmp>/ckpt" in messages[case], case
            assert messages[case].endswith("Load <tmp>/ckpt instead."), case
        assert messages["trainer missing"] == "Checkpoint not found: <tmp>/nothing.ckpt does not exist."
        assert messages["trainer shard"].endswith("Load <tmp>/trainer.ckpt instead.")


# --- a folder saved under a file's name says so ------------------------------------------------------
def _file_names(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    out = {}
    for kind in ("sharded", "full"):
        trainer = L.Trainer(strategy=ZeroInfinityStrategy(state_dict_type=kind), accelerator="cpu", devices=world,
                            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Lit(4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.save_checkpoint(folder / f"{kind}.pt")
            trainer.save_checkpoint(folder / f"{kind}-again.pt")
        out[kind] = {"said": [str(w.message) for w in caught if "written as a folder" in str(w.message)],
                     "is_file": (folder / f"{kind}.pt").is_file()}
    return out


def test_a_sharded_save_to_a_file_name_says_it_wrote_a_folder(tmp_path: Path) -> None:
    """``trainer.save_checkpoint("model.pt")`` writes a folder and warns once, on rank 0 (as
    Lightning's DeepSpeed strategy warns for a ZeRO-3 checkpoint); with ``state_dict_type="full"``
    it writes the file, without the warning. (The folder was written without a word.)"""
    ranks = run_distributed(_file_names, 2, str(tmp_path), init_pg=False)
    assert len(ranks[0]["sharded"]["said"]) == 1 and ranks[1]["sharded"]["said"] == []
    said = ranks[0]["sharded"]["said"][0]
    assert "zinf-consolidate" in said and "state_dict_type='full'" in said
    assert not ranks[0]["sharded"]["is_file"]
    assert ranks[0]["full"] == {"said": [], "is_file": True}


# --- fabric.load_raw before setup ---------------------------------------------------------------------
def _pretrained(folder: Path) -> None:
    """A plain single-process run's weights and AdamW state after two steps, as ``torch.save`` files."""
    torch.manual_seed(5)
    model = models.MLP(buffer=True)
    model.shift.mul_(2.0)  # a buffer unlike the fresh model's
    optimizer = _adamw(model)
    for step in range(2):
        x, y = models.make_batch("mlp", 100 + step, 8)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), folder / "weights.pt")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")


def _raw_before_setup(rank: int, world: int, folder: str, strategy: str, meta: bool) -> dict:
    fabric = _fabric(strategy)
    model = _mlp(fabric, meta)
    optimizer = _adamw(model)
    fabric.load_raw(f"{folder}/weights.pt", model)
    fabric.load_raw(f"{folder}/optimizer.pt", optimizer)
    model, optimizer = fabric.setup(model, optimizer)
    losses = _steps(fabric, model, optimizer, range(3))
    other = _mlp(fabric, meta, hidden=32)
    with pytest.raises(RuntimeError) as error:
        fabric.load_raw(f"{folder}/weights.pt", other)  # strict: torch's own message, at the call
    return {"losses": losses, "mismatch": "size mismatch for fc1.weight" in str(error.value)}


@pytest.mark.parametrize("meta", [True, False], ids=["init_module", "real"])
def test_load_raw_before_setup_works_as_under_ddp(tmp_path: Path, meta: bool) -> None:
    """``fabric.load_raw`` of a ``torch.save`` state dict into a model and its optimizer before
    ``fabric.setup`` (the usual way to bring pretrained weights in), built inside
    ``fabric.init_module()`` (on the meta device) or not: training continues as under DDP doing the
    same; a state dict of another shape is torch's ``RuntimeError`` at the call, as under DDP. (It
    raised ``ValueError``: the model was not set up.)"""
    _pretrained(tmp_path)
    want = run_distributed(_raw_before_setup, 2, str(tmp_path), "ddp", meta, init_pg=False)[0]
    got = run_distributed(_raw_before_setup, 2, str(tmp_path), "zero_infinity", meta, init_pg=False)[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=0)
    assert got["mismatch"] and want["mismatch"]


# --- the Trainer strategy's state dicts and exception types, as FSDP's --------------------------------
def _state_dicts(rank: int, world: int, folder: str, strategy) -> dict:
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    lit = Lit(4)
    trainer.fit(lit)
    optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
    module = trainer.strategy.lightning_module_state_dict()
    out = {"optimizer": optimizer, "module": module}
    if isinstance(strategy, ZeroInfinityStrategy) and strategy.options.state_dict_type == "sharded":
        out["module"] = {k: (type(v).__name__, tuple(v.shape), v.full_tensor() if isinstance(v, DTensor) else v)
                         for k, v in module.items()}
        trainer.save_checkpoint(Path(folder) / "sharded")
    if isinstance(strategy, ZeroInfinityStrategy) and strategy.options.state_dict_type == "full":
        (Path(folder) / "plain").mkdir(exist_ok=True)
        with pytest.raises(IsADirectoryError):
            trainer.save_checkpoint(Path(folder) / "plain")
    return out


def test_trainer_state_dicts_are_fsdps(tmp_path: Path) -> None:
    """As Lightning's ``FSDPStrategy``: with ``state_dict_type="full"``, ``optimizer_state()`` and
    ``lightning_module_state_dict()`` are the plain state dicts on rank 0 (DDP's values) and ``{}``
    on the other ranks (the optimizer's was returned on every rank); with ``"sharded"``,
    ``lightning_module_state_dict()`` holds every parameter as a ``DTensor`` sharded over the ranks
    (whole: DDP's values) and the buffers (it returned the buffers alone, ``{}`` for this model),
    while a checkpoint's ``meta.pt`` still holds no parameter. A full save over a folder that is not
    a checkpoint is ``IsADirectoryError`` (it was ``FileExistsError``)."""
    ddp = run_distributed(_state_dicts, 2, str(tmp_path), "ddp", init_pg=False)
    full = run_distributed(_state_dicts, 2, str(tmp_path), ZeroInfinityStrategy(state_dict_type="full"), init_pg=False)
    sharded = run_distributed(_state_dicts, 2, str(tmp_path), ZeroInfinityStrategy(), init_pg=False)
    want_module, want_optimizer = ddp[0]["module"], ddp[0]["optimizer"]
    assert full[1]["optimizer"] == {} and full[1]["module"] == {}
    assert list(full[0]["module"]) == list(want_module)
    for name, value in want_module.items():
        torch.testing.assert_close(full[0]["module"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert full[0]["optimizer"]["param_groups"][0]["params"] == want_optimizer["param_groups"][0]["params"]
    for index, entry in want_optimizer["state"].items():
        torch.testing.assert_close(full[0]["optimizer"]["state"][index]["exp_avg"], entry["exp_avg"],
                                   rtol=1e-4, atol=1e-6)
    for rank in sharded:
        assert list(rank["module"]) == list(want_module)
        for name, (kind, shape, value) in rank["module"].items():
            assert kind == "DTensor" and shape == tuple(want_module[name].shape), name
            torch.testing.assert_close(value, want_module[name], rtol=1e-5, atol=1e-6, msg=name)
    meta = torch.load(tmp_path / "sharded" / "meta.pt", weights_only=True)
    assert meta["state_dict"] == {}  # the GPT has no buffer; the parameters are in the shard files


def _two_optimizers_into_one(rank: int, world: int, folder: str) -> list[str]:
    messages = []
    for kind in ("sharded", "full"):
        path = Path(folder) / f"two-{kind}.ckpt"
        trainer = L.Trainer(strategy=ZeroInfinityStrategy(state_dict_type=kind), accelerator="cpu", devices=world,
                            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Lit(4, optimizers=2))
        trainer.save_checkpoint(path)
        with pytest.raises(RuntimeError) as error:
            L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=world, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False).fit(Lit(4), ckpt_path=path)
        assert isinstance(error.value, CheckpointError)
        messages.append(str(error.value))
    return messages


def test_another_number_of_optimizers_is_a_runtime_error(tmp_path: Path) -> None:
    """Resuming a checkpoint of two optimizers with one raises ``RuntimeError``, as Lightning's
    ``FSDPStrategy`` does (and still a ``CheckpointError``), for both checkpoint types. (It was a
    ``ValueError``.)"""
    for message in run_distributed(_two_optimizers_into_one, 2, str(tmp_path), init_pg=False)[0]:
        assert "holds the state of 2 optimizer(s) but configure_optimizers returns 1" in message


# --- zinf-consolidate of a fabric.save checkpoint ----------------------------------------------------
def _consolidated_fabric(rank: int, world: int, folder: str, strategy: str) -> dict:
    fabric = _fabric(strategy)
    model = _mlp(fabric)
    model, optimizer = fabric.setup(model, _adamw(model))
    first = _steps(fabric, model, optimizer, range(2))
    if strategy == "zero_infinity":
        teacher = fabric.setup(_mlp(fabric, frozen=True))
        fabric.save(f"{folder}/sharded", {"model": model, "optimizer": optimizer, "step": 2, "state_dict": "mine"})
        fabric.save(f"{folder}/pair", {"student": model, "teacher": teacher, "optimizer": optimizer, "step": 2})
        if rank == 0:
            consolidate(f"{folder}/sharded", f"{folder}/one.pt")
            consolidate(f"{folder}/pair", f"{folder}/pair.pt")
        fabric.barrier()
        with fabric.strategy.gathered_parameters():
            return {"first": first, "student": {k: v.clone() for k, v in model.module.state_dict().items()},
                    "teacher": {k: v.clone() for k, v in teacher.module.state_dict().items()}}
    # DDP resumes the consolidated file (fabric.load of fabric.save's DDP layout), and runs on.
    ddp_model = _mlp(fabric)
    ddp_model, ddp_optimizer = fabric.setup(ddp_model, _adamw(ddp_model))
    state = {"model": ddp_model, "optimizer": ddp_optimizer, "step": 0, "state_dict": None}
    remainder = fabric.load(f"{folder}/one.pt", state)
    return {"first": first, "rest": _steps(fabric, model, optimizer, range(2, 4)),
            "resumed": _steps(fabric, ddp_model, ddp_optimizer, range(2, 4)),
            "step": state["step"], "entry": state["state_dict"], "remainder": remainder}


def test_a_fabric_checkpoint_consolidates_into_fabric_saves_layout(tmp_path: Path) -> None:
    """``zinf-consolidate`` of a sharded ``fabric.save`` checkpoint writes, by default, what
    ``fabric.save`` writes under DDP for the same state (as Lightning's consolidation of an FSDP
    Fabric checkpoint does): DDP's ``fabric.load`` of it resumes model, AdamW state and entries, and
    continues as the uninterrupted run; a checkpoint of two models gives each model's full state
    dict under its key. (It wrote the model's state dict alone: ``KeyError: 'model'``; a checkpoint
    of several models failed with ``KeyError: 'zinf'``.)"""
    zinf = run_distributed(_consolidated_fabric, 2, str(tmp_path), "zero_infinity", init_pg=False)[0]
    ddp = run_distributed(_consolidated_fabric, 2, str(tmp_path), "ddp", init_pg=False)[0]
    torch.testing.assert_close(torch.tensor(zinf["first"]), torch.tensor(ddp["first"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(ddp["resumed"]), torch.tensor(ddp["rest"]), rtol=1e-5, atol=0)
    assert ddp["step"] == 2 and ddp["entry"] == "mine" and ddp["remainder"] == {}
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(one) == ["model", "optimizer", "state_dict", "step"]
    pair = torch.load(tmp_path / "pair.pt", weights_only=True)
    assert sorted(pair) == ["optimizer", "step", "student", "teacher"]
    for key in ("student", "teacher"):
        assert sorted(pair[key]) == sorted(zinf[key])
        for name, value in zinf[key].items():
            assert torch.equal(pair[key][name], value), (key, name)
    assert sorted(pair["optimizer"]["state"]) == list(range(6))  # the student's six parameters
