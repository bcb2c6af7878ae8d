"""Lightning Fabric with ``strategy="zero_infinity"`` on CPU/gloo, against Fabric's own DDP.

Each run is a real Fabric loop on two processes: the model built inside ``fabric.init_module()``,
gradient accumulation under ``fabric.no_backward_sync``, global-norm clipping with
``fabric.clip_gradients``, AdamW. DDP with the same seed and data is the reference; checkpoints
written by ``fabric.save`` must resume exactly, and move between Fabric and the Trainer.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as L
import nbformat
import pytest
import torch
from lightning.fabric import Fabric
from nbclient import NotebookClient

import lightning_zinf  # noqa: F401  (registers "zero_infinity" for Fabric and the Trainer)
from lightning_zinf import CheckpointError, ZeroInfinityFabricStrategy
from tests import models
from tests.harness import run_distributed
from tests.test_trainer import LitGPT, _tokens

ROOT = Path(__file__).resolve().parents[1]
ACCUMULATE = 2
MICRO_BATCH = 2  # per rank


class FabricLit(LitGPT):
    """The Trainer tests' LightningModule, with the forward a Fabric loop calls."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def _exp_avg(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p]["exp_avg"].clone() for g in optimizer.param_groups for p in g["params"]
            if p in optimizer.state]


def _fabric(strategy) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _build(fabric: Fabric, separate: bool = False):
    """The test GPT and AdamW, set up jointly (``fabric.setup``) or one after the other."""
    torch.manual_seed(0)
    with fabric.init_module():
        model = models.GPT()
    if separate:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _train(fabric: Fabric, model, optimizer, steps: range) -> tuple[list[float], list[float]]:
    """Accumulate ``ACCUMULATE`` micro-batches per step, clip to a norm the gradients exceed;
    returns the losses and the gradient norms (both mean over ranks)."""
    losses, norms = [], []
    for step in steps:
        x, y = models.make_batch("gpt", step, 2 * MICRO_BATCH * ACCUMULATE)
        rank = fabric.global_rank
        total = 0.0
        for micro in range(ACCUMULATE):
            lo = (micro * 2 + rank) * MICRO_BATCH
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = models.loss_fn(model, x[lo:lo + MICRO_BATCH], y[lo:lo + MICRO_BATCH]) / ACCUMULATE
                fabric.backward(loss)
            total += loss.detach()
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(total).item())
    return losses, norms


def _full_parameters(fabric: Fabric, model) -> dict[str, torch.Tensor]:
    module = model.module if hasattr(model, "module") else model
    strategy = fabric.strategy
    context = strategy.gathered_parameters() if isinstance(strategy, ZeroInfinityFabricStrategy) else torch.no_grad()
    with context:
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _fabric_run(rank: int, world: int, strategy: str, separate: bool) -> dict:
    fabric = _fabric(strategy)
    model, optimizer = _build(fabric, separate)
    losses, norms = _train(fabric, model, optimizer, range(4))
    with torch.no_grad():
        model.eval()
        eval_loss = models.loss_fn(model, *models.make_batch("gpt", 99, 4)).item()
    offload = getattr(getattr(fabric.strategy, "engine", None), "_activation_offload", None)
    return {"losses": losses, "norms": norms, "eval": eval_loss, "params": _full_parameters(fabric, model),
            "offloaded_bytes": None if offload is None else offload.copied_bytes}


@pytest.mark.parametrize("separate, strategy", [
    (False, "zero_infinity"),
    (True, "zero_infinity"),
    (False, ZeroInfinityFabricStrategy(offload={"param": "cpu", "optimizer": "cpu", "activations": True})),
], ids=["setup", "setup_module+setup_optimizers", "offload-with-activations"])
def test_fabric_loop_matches_fabric_ddp(separate: bool, strategy) -> None:
    zinf = run_distributed(_fabric_run, 2, strategy, separate, init_pg=False)
    ddp = run_distributed(_fabric_run, 2, "ddp", False, init_pg=False)
    assert zinf[0]["norms"][0] > 0.5  # clipping acted
    assert zinf[0]["losses"] == pytest.approx(ddp[0]["losses"], abs=1e-5)
    assert zinf[0]["norms"] == pytest.approx(ddp[0]["norms"], rel=1e-5)
    assert zinf[0]["eval"] == pytest.approx(ddp[0]["eval"], abs=1e-5)
    assert zinf[0]["losses"][-1] < zinf[0]["losses"][0]
    if strategy != "zero_infinity":  # the training forwards' saved activations went to host memory
        assert zinf[0]["offloaded_bytes"] > 0
    for name, value in ddp[0]["params"].items():
        for rank in zinf:
            mine = rank["params"][name].clone()
            if name.endswith("qkv.bias"):
                # The key bias's exact gradient is zero (softmax ignores a constant added to every
                # score of a query), so its float gradient is rounding noise, which AdamW turns into
                # steps of up to lr: compared against that bound, the rest tightly.
                keys = slice(value.numel() // 3, 2 * value.numel() // 3)
                assert (mine[keys] - value[keys]).abs().max() <= 4 * 1e-2
                mine[keys] = value[keys]
            torch.testing.assert_close(mine, value, atol=1e-6, rtol=1e-5, msg=name)


def _resume_run(rank: int, world: int, folder: str) -> dict:
    fabric = _fabric("zero_infinity")
    model, optimizer = _build(fabric)
    first, _ = _train(fabric, model, optimizer, range(2))
    fabric.save(folder, {"model": model, "optimizer": optimizer, "step": 2, "note": "kept"})
    straight, _ = _train(fabric, model, optimizer, range(2, 4))

    # A new model, optimizer and strategy in the same processes: everything comes from the files.
    fabric = _fabric(ZeroInfinityFabricStrategy())
    model, optimizer = _build(fabric)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(folder, state)
    resumed, _ = _train(fabric, model, optimizer, range(state["step"], 4))
    return {"first": first, "straight": straight, "resumed": resumed, "remainder": remainder}


def test_fabric_save_load_resumes_exactly(tmp_path: Path) -> None:
    out = run_distributed(_resume_run, 2, str(tmp_path / "ckpt"), init_pg=False)
    assert out[0]["resumed"] == out[0]["straight"]  # bit for bit: weights, masters and AdamW state
    assert out[0]["remainder"] == {"note": "kept"}
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*") if p.is_file()) == [
        "meta.pt", "rank_00000.safetensors", "rank_00001.safetensors"]


def _trainer_then_fabric(rank: int, world: int, folder: str) -> dict:
    """The Trainer trains LitGPT and saves; Fabric loads that checkpoint into a LitGPT of its own."""
    lit = FabricLit(batch_size=4)
    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(lit, torch.utils.data.DataLoader(_tokens(64, 0), batch_size=4))
    trainer.save_checkpoint(folder)
    with trainer.strategy.gathered_parameters():
        saved = {n: p.detach().clone() for n, p in lit.named_parameters()}
    saved_state = _exp_avg(trainer.optimizers[0])

    fabric = _fabric("zero_infinity")
    with fabric.init_module():
        other = FabricLit(batch_size=4)
        other.configure_model()
    other, optimizer = fabric.setup(other, torch.optim.AdamW(other.parameters(), lr=0.5))
    remainder = fabric.load(folder, {"model": other, "optimizer": optimizer})
    loaded = _full_parameters(fabric, other)
    loaded_state = _exp_avg(optimizer.optimizer)
    alone = _fabric("zero_infinity")
    bare, _ = _build(alone)  # the GPT alone: its parameter names lack the "model." prefix
    with pytest.raises(CheckpointError) as prefix_error:
        alone.load(folder, {"model": bare})
    return {"saved": saved, "loaded": loaded, "saved_state": saved_state, "loaded_state": loaded_state,
            "lr": optimizer.param_groups[0]["lr"], "global_step": remainder.get("global_step"),
            "prefix_error": str(prefix_error.value)}


def test_trainer_checkpoint_loads_in_fabric(tmp_path: Path) -> None:
    out = run_distributed(_trainer_then_fabric, 2, str(tmp_path / "trainer.ckpt"), init_pg=False)
    for rank in out:
        assert rank["saved"].keys() == rank["loaded"].keys()
        for name, value in rank["saved"].items():
            assert torch.equal(rank["loaded"][name], value), name
        assert len(rank["loaded_state"]) == len(rank["saved_state"]) > 0
        for a, b in zip(rank["loaded_state"], rank["saved_state"]):
            assert torch.equal(a, b)
        assert rank["lr"] == pytest.approx(1e-2)  # LitGPT's own, not the 0.5 Fabric's optimizer was built with
        assert rank["global_step"] == 3
        assert "another prefix ('model.wte.weight' in the checkpoint, 'wte.weight' in the model)" in rank["prefix_error"]


def _fabric_then_trainer(rank: int, world: int, folder: str) -> dict:
    """Fabric trains a LitGPT and saves; the Trainer validates from that checkpoint."""
    fabric = _fabric("zero_infinity")
    torch.manual_seed(0)
    with fabric.init_module():
        lit = FabricLit(batch_size=4)
        lit.configure_model()
    model, optimizer = fabric.setup(lit, torch.optim.AdamW(lit.parameters(), lr=1e-2))
    _train(fabric, model, optimizer, range(2))
    x, y = _tokens(8, 5).tensors
    with torch.no_grad():
        model.eval()
        fabric_loss = models.loss_fn(lit.model, x, y).item()
    fabric.save(folder, {"model": model, "optimizer": optimizer})

    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(FabricLit(batch_size=4), torch.utils.data.DataLoader(_tokens(8, 5), batch_size=4),
                               ckpt_path=folder, verbose=False)
    return {"fabric": fabric_loss, "trainer": metrics[0]["val_loss"]}


def test_fabric_checkpoint_loads_in_the_trainer(tmp_path: Path) -> None:
    out = run_distributed(_fabric_then_trainer, 2, str(tmp_path / "fabric.ckpt"), init_pg=False)
    assert out[0]["trainer"] == pytest.approx(out[0]["fabric"], abs=1e-5)


def _bad_state(rank: int, world: int, folder: str) -> list[str]:
    fabric = _fabric("zero_infinity")
    model, optimizer = _build(fabric)
    errors = []
    for call in (lambda: fabric.load(folder),
                 lambda: fabric.save(folder, {"model": model, "other": torch.nn.Linear(2, 2)}),
                 lambda: fabric.save(folder, {"model": model}, filter={"model": lambda k, v: True})):
        with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
            call()
        errors.append(str(info.value))
    fabric.save(folder + "-weights", {"model": model})  # no optimizer state in it
    with pytest.raises(KeyError, match=r"optimizer\(s\) \['optimizer'\] .* holds the state of 0"):
        fabric.load(folder + "-weights", {"model": model, "optimizer": optimizer})
    fabric.load(folder + "-weights", {"model": model, "optimizer": optimizer}, strict=False)  # the weights alone
    return errors


def test_fabric_refuses_what_a_sharded_checkpoint_cannot_do(tmp_path: Path) -> None:
    errors = run_distributed(_bad_state, 2, str(tmp_path / "x"), init_pg=False)[0]
    assert "consolidate" in errors[0]
    assert "not set up with it (['other'])" in errors[1]
    assert "filter" in errors[2]


def test_fabric_example_script_launches_its_own_processes(tmp_path: Path) -> None:
    """``python -m examples.fabric_pretrain``: Fabric's script launcher starts the second rank."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.fabric_pretrain", "--steps", "3", "--d-model", "32", "--layers", "1",
         "--seq-len", "32", "--accumulate", "2", "--checkpoint", str(tmp_path / "ckpt")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Starting with 2 processes" in done.stderr + done.stdout
    assert "step    3  loss" in done.stdout
    assert list((tmp_path / "ckpt").glob("save-*/rank_00001.safetensors"))


def test_fabric_in_a_notebook_forks_its_workers(tmp_path: Path) -> None:
    """In Jupyter Fabric cannot re-run a script: the strategy forks, as Fabric's notebook strategies do."""
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        import torch, lightning_zinf
        from lightning.fabric import Fabric
        from tests import models

        def train(fabric):
            torch.manual_seed(0)
            with fabric.init_module():
                model = models.GPT()
            model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
            losses = []
            for step in range(3):
                x, y = models.make_batch("gpt", step, 4)
                loss = models.loss_fn(model, x[2 * fabric.global_rank:][:2], y[2 * fabric.global_rank:][:2])
                fabric.backward(loss)
                opt.step(); opt.zero_grad()
                losses.append(fabric.all_reduce(loss.detach()).item())
            return losses

        fabric = Fabric(accelerator="cpu", devices=2, strategy="zero_infinity")
        print("losses", fabric.launch(train))
        """
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    losses = [float(v) for v in text.split("losses [")[1].split("]")[0].split(",")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_fabric_fp16_loss_scaling_uses_a_scaler_every_rank_agrees_with() -> None:
    """Fabric's fp16 plugin gets a ``ShardedGradScaler`` (its found-inf flag is all-reduced, so one
    rank's overflow in its own shard makes every rank skip the step), with the user's settings."""
    from lightning.fabric.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256, growth_interval=7))
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero_infinity", plugins=[plugin])
    scaler = fabric.strategy.precision.scaler
    assert type(scaler) is ShardedGradScaler
    assert scaler.get_scale() == 256 and scaler.get_growth_interval() == 7
    with pytest.raises(TypeError, match="64-true"):
        Fabric(accelerator="cpu", devices=1, strategy="zero_infinity", precision="64-true")


def _load_raw(rank: int, world: int, file: str) -> dict:
    fabric = _fabric("zero_infinity")
    model, _ = _build(fabric)
    fabric.load_raw(file, model)
    return _full_parameters(fabric, model)


def test_fabric_load_raw_reads_a_full_state_dict_into_the_shards(tmp_path: Path) -> None:
    torch.manual_seed(7)
    reference = models.GPT()
    torch.save(reference.state_dict(), tmp_path / "full.pt")
    for rank in run_distributed(_load_raw, 2, str(tmp_path / "full.pt"), init_pg=False):
        for name, value in reference.named_parameters():
            assert torch.equal(rank[name], value.detach()), name


def _compiled_run(rank: int, world: int, strategy) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fabric = _fabric(strategy)
    torch.manual_seed(0)
    with fabric.init_module():
        model = models.GPT()
    for block in model.blocks:
        block.compile()  # the per-block pattern docs/compile.md recommends
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, _ = _train(fabric, model, optimizer, range(2))
    graphs = counters["stats"]["unique_graphs"]
    more, _ = _train(fabric, model, optimizer, range(2, 4))
    return {"losses": losses + more, "graphs_after_2": graphs,
            "graphs_after_4": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}


def test_fabric_trains_compiled_blocks_without_recompiling() -> None:
    # Blocks as units, as with the Trainer (docs/compile.md): the hooks sit on the compiled modules themselves.
    zinf = run_distributed(_compiled_run, 2, ZeroInfinityFabricStrategy(block_classes=["Block"]), init_pg=False)[0]
    eager = run_distributed(_fabric_run, 2, "ddp", False, init_pg=False)[0]
    assert zinf["breaks"] == {}
    assert zinf["graphs_after_4"] == zinf["graphs_after_2"] > 0  # nothing compiled after the first steps
    assert zinf["losses"] == pytest.approx(eager["losses"], abs=1e-4)


def _moved_fabric(rank: int, world: int, folder: str) -> dict:
    """DDP for two steps, saved by fabric.save; zero_infinity (full) resumes, two steps, saves;
    DDP resumes, two steps; a LoRA-style filtered save keeps what the filter keeps."""
    losses = []
    for steps, strategy, resume, save in ((range(0, 2), "ddp", None, "ddp.ckpt"),
                                          (range(2, 4), ZeroInfinityFabricStrategy(state_dict_type="full"), "ddp.ckpt",
                                           "zinf.ckpt"),
                                          (range(4, 6), "ddp", "zinf.ckpt", None)):
        fabric = _fabric(strategy)
        model, optimizer = _build(fabric)
        if resume is not None:
            remainder = fabric.load(f"{folder}/{resume}", {"model": model, "optimizer": optimizer, "step": 0})
            assert remainder == {}
        losses += _train(fabric, model, optimizer, steps)[0]
        if save is not None:
            fabric.save(f"{folder}/{save}", {"model": model, "optimizer": optimizer, "step": steps.stop})
        if resume == "ddp.ckpt":
            fabric.save(f"{folder}/blocks.ckpt", {"model": model}, filter={"model": lambda k, v: k.startswith("blocks.0")})
    return {"losses": losses}


def _continued_ddp(rank: int, world: int) -> list[float]:
    fabric = _fabric("ddp")
    model, optimizer = _build(fabric)
    return _train(fabric, model, optimizer, range(6))[0]


def test_fabric_full_checkpoints_move_a_run_between_ddp_and_zero_infinity(tmp_path: Path) -> None:
    """``fabric.save``/``fabric.load`` of one-file checkpoints, both ways: the run moved DDP ->
    zero_infinity -> DDP has the uninterrupted DDP run's losses at every step; the full checkpoint
    holds plain entries; a filtered save holds exactly the kept keys, full size."""
    want = run_distributed(_continued_ddp, 2, init_pg=False)[0]
    got = run_distributed(_moved_fabric, 2, str(tmp_path), init_pg=False)[0]["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    saved = torch.load(tmp_path / "zinf.ckpt", weights_only=True)
    assert saved["step"] == 4 and set(saved) == {"model", "optimizer", "step"}
    blocks = torch.load(tmp_path / "blocks.ckpt", weights_only=True)["model"]
    assert blocks and all(k.startswith("blocks.0") and v.numel() > 0 for k, v in blocks.items())


def _by_key(rank: int, world: int, folder: str) -> bool:
    fabric = _fabric("zero_infinity")

    def build():
        torch.manual_seed(0)
        with fabric.init_module():
            model = models.GPT()
        blocks = set(map(id, model.blocks.parameters()))
        opt_a = torch.optim.AdamW(model.blocks.parameters(), lr=1e-2)
        opt_b = torch.optim.AdamW([p for p in model.parameters() if id(p) not in blocks], lr=1e-3)
        return fabric.setup(model, opt_a, opt_b)

    model, opt_a, opt_b = build()
    x, y = models.make_batch("gpt", 0, 4)
    fabric.backward(models.loss_fn(model, x, y))
    opt_a.step()
    opt_b.step()
    saved = _exp_avg(opt_b)
    fabric.save(folder, {"model": model, "opt_a": opt_a, "opt_b": opt_b})
    model, opt_a, opt_b = build()
    assert fabric.load(folder, {"model": model, "opt_b": opt_b}) == {}
    return all(torch.equal(a, b) for a, b in zip(_exp_avg(opt_b), saved)) and len(saved) > 0 and _exp_avg(opt_a) == []


def test_fabric_load_takes_each_optimizer_by_its_key(tmp_path: Path) -> None:
    """Two optimizers saved, the second alone asked for: it gets its own state (by key), not the
    first one's (by position, as it once did)."""
    assert run_distributed(_by_key, 2, str(tmp_path / "ckpt"), init_pg=False) == [True, True]


def _lora_fabric(rank: int, world: int, folder: str, resume: bool) -> dict:
    """A LoRA GPT (frozen base) under zero_infinity with full checkpoints of the trainable state:
    2 steps and a save, then (``resume``) a fresh model and optimizer loaded from it for 2 more."""
    strategy = ZeroInfinityFabricStrategy(state_dict_type="full", exclude_frozen_parameters=True)
    fabric = _fabric(strategy)

    def build():
        torch.manual_seed(0)
        with fabric.init_module():
            model = models.GPT(lora_rank=4)
        return fabric.setup(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))

    model, optimizer = build()
    losses = _train(fabric, model, optimizer, range(2))[0]
    if not resume:
        return {"losses": losses + _train(fabric, model, optimizer, range(2, 4))[0]}
    fabric.save(f"{folder}/lora.ckpt", {"model": model, "optimizer": optimizer})
    model, optimizer = build()
    assert fabric.load(f"{folder}/lora.ckpt", {"model": model, "optimizer": optimizer}) == {}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {"losses": losses + _train(fabric, model, optimizer, range(2, 4))[0],
            "trainable": [n.removeprefix("_forward_module.") for n in trainable]}


def test_fabric_full_checkpoint_without_frozen_weights_resumes_exactly(tmp_path: Path) -> None:
    """``exclude_frozen_parameters=True`` with one-file checkpoints in Fabric: the file holds the
    adapters alone (the frozen base is neither written nor gathered), and a fresh model built as
    before resumes from it with the uninterrupted run's losses."""
    want = run_distributed(_lora_fabric, 2, str(tmp_path), False, init_pg=False)[0]["losses"]
    got = run_distributed(_lora_fabric, 2, str(tmp_path), True, init_pg=False)[0]
    assert got["losses"] == want
    saved = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    assert sorted(saved["model"]) == got["trainable"]
    assert len(saved["optimizer"]["state"]) == len(got["trainable"])
