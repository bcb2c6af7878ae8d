"""Parameter and optimizer offload (cpu, nvme) reproduce the non-offloaded engine bit for bit, W=2,
fp32 AdamW, and NVMe-resident state saves and resumes bit-exactly under a real Trainer.

The reference is the engine without offload, itself checked against single-process PyTorch in
test_parity.py; offload moves state between tiers and steps it in sub-groups, which must not
change one bit of arithmetic (same elementwise updates, same order of the gradient-norm sum).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine, ZeroInfinityStrategy
from tests import models
from tests.harness import run_distributed

STEPS = 5
BATCH = 8


def _train(rank: int, world: int, offload: dict, accumulate: int, clip: float | None) -> dict:
    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(
        model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0), offload=OffloadConfig(**offload)
    )
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, tiers = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = models.make_batch("gpt", step * accumulate + micro, BATCH)
            per_rank = BATCH // world
            loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            engine.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        engine.release_all()  # writes behind the step complete: their memory is freed
        tiers.append(engine.resident_bytes())
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    staging = {"peak": engine.space.pool.peak, "held": engine.space.pool.held} if engine.space is not None else {}
    stepped_on_device = [g.optimizer_on_device for g in engine.groups]
    return {"losses": losses, "weights": weights, "tiers": tiers, "staging": staging,
            "on_device": stepped_on_device, "ledger": {k: now for k, (now, _) in engine.memory().items()}}


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return {
        (acc, clip): run_distributed(_train, 2, {}, acc, clip) for acc, clip in ((1, None), (2, 0.5))
    }


TIERS = ("none", "cpu", "nvme")
GRID = [{"param": p, "optimizer": o} for p in TIERS for o in TIERS if (p, o) != ("none", "none")]


#: The groups of models.GPT() on two ranks hold 1024, 256, 6352, 6352 and 32 shard elements: 16 bytes
#: each for the first three fit, the fourth does not (nor then the fifth, which would alone).
SPLIT = 16 * (1024 + 256 + 6352) + 1000


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.5)], ids=["plain", "accumulate-clip"])
@pytest.mark.parametrize(
    "offload",
    [*GRID, {"param": "nvme", "optimizer": "nvme", "overlap": False, "read_ahead": 0},
     {"param": "none", "optimizer": "cpu", "device_bytes": SPLIT}],
    ids=[f"param-{c['param']}-optimizer-{c['optimizer']}" for c in GRID] + ["nvme-no-overlap", "zero-offload-split"],
)
def test_offload_is_bit_exact(reference: dict, tmp_path: Path, offload: dict, accumulate: int, clip) -> None:
    """Every combination of parameter and optimizer tiers gives the losses and weights of no
    offload, bit for bit (small sub-groups, so an offloaded step runs in several); so does
    ZeRO-Offload with the first groups' optimizer state kept and stepped on the device
    (``device_bytes``), where the memory ledger holds those groups' state apart."""
    nvme = "nvme" in (offload["param"], offload["optimizer"])
    if nvme:
        offload = {**offload, "nvme_path": str(tmp_path)}
    if offload["optimizer"] != "none":
        offload = {**offload, "sub_group_size": 20_000}
    ranks = run_distributed(_train, 2, offload, accumulate, clip)
    expected = reference[(accumulate, clip)]
    for got, want in zip(ranks, expected):
        assert got["losses"] == want["losses"]
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
    tiers = ranks[0]["tiers"][-1]
    for r in ranks:
        assert r["on_device"] == ([True] * 3 + [False] * 2 if offload.get("device_bytes") else [False] * 5)
        assert (r["ledger"]["optimizer_device"] > 0) == bool(offload.get("device_bytes"))
    if not nvme:
        assert tiers["cpu"] > 0 and tiers["nvme"] == 0
    else:
        assert tiers["nvme"] > 0
        if offload["optimizer"] == "nvme" and offload["param"] == "nvme":
            # Between steps nothing but the optimizer's scalar step counters (4 bytes per
            # parameter) stays in CPU memory: shards, masters, gradients and states are on disk.
            assert tiers["cpu"] <= 4 * sum(1 for _ in models.GPT().parameters()), tiers
        assert list(tmp_path.iterdir()) == []  # each rank's swap folder is gone after the run


def _fit_nvme(rank: int, world: int, nvme: str, root: str, ckpt: str | None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_checkpoint import EPOCH_STEPS, LitEpochs
    from tests.test_trainer import GLOBAL_BATCH, _trainer

    lit = LitEpochs(GLOBAL_BATCH // world)
    strategy = ZeroInfinityStrategy(
        offload={"param": "nvme", "optimizer": "nvme", "nvme_path": nvme, "sub_group_size": 30_000}
    )
    callback = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(strategy, world, max_steps=-1, max_epochs=2, limit_val_batches=0,
                       enable_checkpointing=True, callbacks=[callback], default_root_dir=root)
    trainer.fit(lit, ckpt_path=ckpt)
    with trainer.strategy.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in lit.named_parameters()}
    nvme_bytes = trainer.strategy.engine.resident_bytes()["nvme"]
    return {"losses": lit.train_losses, "weights": weights, "steps": EPOCH_STEPS, "nvme_bytes": nvme_bytes}


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_state_saves_and_resumes_bit_exactly(tmp_path: Path, world: int) -> None:
    """A real Trainer (gradient clipping, LR schedule) with the optimizer on NVMe: resuming from the
    step-5 checkpoint reproduces steps 6-10 of the uninterrupted run bit for bit."""
    (tmp_path / "nvme").mkdir()
    full = run_distributed(_fit_nvme, world, str(tmp_path / "nvme"), str(tmp_path / "full"), None, init_pg=False)[0]
    step5 = tmp_path / "full" / "epoch=0-step=5.ckpt"
    resumed = run_distributed(_fit_nvme, world, str(tmp_path / "nvme"), str(tmp_path / "resumed"), str(step5), init_pg=False)[0]
    steps = full["steps"]
    assert full["nvme_bytes"] > 0 and resumed["nvme_bytes"] > 0
    assert len(full["losses"]) == 2 * steps and resumed["losses"] == full["losses"][steps:]
    for name, value in full["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    assert list((tmp_path / "nvme").iterdir()) == []


def _capped(rank: int, world: int, nvme_path: str, cap: int) -> dict:
    """NVMe offload with ``staging_bytes=cap``: the training result, the staging pool's peak and
    what it holds, or the error."""
    try:
        result = _train(rank, world, {"param": "nvme", "optimizer": "nvme", "nvme_path": nvme_path,
                                      "sub_group_size": 5_000, "staging_bytes": cap}, 1, None)
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(error).__name__}: {error}"}
    return {**result, **result["staging"], "error": None}


def test_staging_cap_bounds_host_memory_without_changing_results(reference: dict, tmp_path: Path) -> None:
    """With 5K-element sub-groups, NVMe offload stages at most 272 KiB per rank when uncapped; the
    largest group alone needs 108 KiB (its fp32 master, gradient and two AdamW moments). A cap of
    140 KB in between still trains bit for bit like no offload: writes in flight are completed and
    reads ahead given up to free buffers. A cap too small for one record stops with an error
    naming the option to raise."""
    cap = 140_000
    ranks = run_distributed(_capped, 2, str(tmp_path), cap)
    for got, want in zip(ranks, reference[(1, None)]):
        assert got["error"] is None, got["error"]
        assert got["losses"] == want["losses"]
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
        assert 0 < got["peak"] <= cap and got["held"] <= cap
    small = run_distributed(_capped, 2, str(tmp_path), 16_384)
    assert all("SwapError" in r["error"] and "OffloadConfig.staging_bytes" in r["error"] for r in small), small


def _trainer_losses(rank: int, world: int, strategy) -> list[float]:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    chosen = strategy if isinstance(strategy, str) else ZeroInfinityStrategy(offload=strategy)
    lit = LitGPT(GLOBAL_BATCH // world)
    trainer = _trainer(chosen, world)
    trainer.fit(lit)
    return {"losses": lit.train_losses, "offload": trainer.strategy.options.offload}


def test_presets_and_activation_offload_under_the_trainer() -> None:
    """``"zero_infinity_offload"`` (cpu), ``"zero_infinity_nvme"`` and saved activations kept on
    the CPU train exactly as ``"zero_infinity"`` (fit with clipping, LR schedule, validation)."""
    base = run_distributed(_trainer_losses, 2, "zero_infinity", init_pg=False)[0]
    for strategy, expected in (
        ("zero_infinity_offload", ("cpu", "cpu")),
        ("zero_infinity_nvme", ("nvme", "nvme")),
        ({"activations": True}, ("none", "none")),
    ):
        got = run_distributed(_trainer_losses, 2, strategy, init_pg=False)[0]
        assert (got["offload"].param, got["offload"].optimizer) == expected
        assert got["losses"] == base["losses"], strategy


def test_bad_offload_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="OffloadConfig.param='gpu' is invalid"):
        OffloadConfig(param="gpu")
    with pytest.raises(ValueError, match="optimizer='nvme' needs nvme_path"):
        OffloadConfig(optimizer="nvme")
    with pytest.raises(ValueError, match="sub_group_size"):
        OffloadConfig(sub_group_size=0)
    with pytest.raises(ValueError, match="staging_bytes"):
        OffloadConfig(staging_bytes=0)
    with pytest.raises(ValueError, match="device_bytes=1000 .* needs optimizer='cpu' and param='none'"):
        OffloadConfig(optimizer="cpu", param="cpu", device_bytes=1000)
    with pytest.raises(ValueError, match="device_bytes=-1 is invalid"):
        OffloadConfig(optimizer="cpu", device_bytes=-1)


def test_pinning_without_an_accelerator_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
        ZeroEngine(models.MLP(), offload=OffloadConfig(param="nvme", nvme_path=str(tmp_path), pin_memory=True))
    assert list(tmp_path.iterdir()) == []  # refused before any swap folder was made


def _engine_on(rank: int, world: int, nvme_path: str) -> str:
    try:
        ZeroEngine(models.MLP(), offload=OffloadConfig(param="nvme", nvme_path=nvme_path))
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_missing_nvme_path_is_a_clear_error(tmp_path: Path) -> None:
    message = run_distributed(_engine_on, 1, str(tmp_path / "absent"))[0]
    assert message.startswith("SwapError") and str(tmp_path / "absent") in message, message


def _fill_the_disk(rank: int, world: int, small: str, large: str) -> dict:
    """Rank 0 swaps to a disk that fills up during training; it stops at its error, as a failed
    process would. Rank 1 must then fail in its next collective instead of waiting forever."""
    import time

    torch.manual_seed(0)
    # 275K parameters: per rank 550 KB of fp32 for each of parameter shards, masters, gradients,
    # and twice that for AdamW's state. The 1.5 MB disk takes the shards and masters, then fills.
    model = models.MLP(hidden=512)
    start = time.monotonic()
    try:
        engine = ZeroEngine(model, offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=small if rank == 0 else large))
        opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        for step in range(5):
            x, y = models.make_batch("mlp", step, 8)
            models.loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_full_disk_stops_every_rank_with_a_clear_error(tmp_path: Path) -> None:
    from tests.test_swapper import _mount

    with _mount(tmp_path, "tmpfs", "size=1500k,mode=0700") as small:
        (tmp_path / "large").mkdir()
        ranks = run_distributed(_fill_the_disk, 2, str(small), str(tmp_path / "large"), timeout=240)
    assert ranks[0]["error"] is not None and "SwapError" in ranks[0]["error"] and "full" in ranks[0]["error"], ranks[0]
    # The other rank learns of it from its collective (the peer's connection closed), long before
    # the 30-minute collective timeout.
    assert ranks[1]["error"] is not None and ranks[1]["seconds"] < 120, ranks[1]


def _two_optimizers(rank: int, world: int, offload: dict) -> dict:
    """Matrices and vectors in two AdamW optimizers, global-norm clipping, a discarded batch
    (``zero_grad(set_to_none=False)`` between backward and step), then normal steps."""
    torch.manual_seed(0)
    model = models.GPT()
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # before partitioning empties them
    vectors = [p for p in model.parameters() if p.dim() < 2]
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(**offload))
    first = engine.shard_optimizer(torch.optim.AdamW(matrices, lr=1e-2, weight_decay=0.1))
    second = engine.shard_optimizer(torch.optim.AdamW(vectors, lr=1e-2, weight_decay=0.0))
    per_rank = BATCH // world
    losses = []
    for step in range(4):
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        losses.append(loss.item())
        if step == 1:  # this batch is thrown away
            first.zero_grad(set_to_none=False)
            second.zero_grad(set_to_none=False)
            continue
        engine.clip_grad_norm_(0.05)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights}


def test_two_optimizers_clipping_and_a_discarded_batch(tmp_path: Path) -> None:
    """Found by review: with NVMe optimizer offload, clipping reached only the first optimizer,
    and zeroing gradients that were on disk crashed. Both tiers now match no offload bit for bit."""
    want = run_distributed(_two_optimizers, 2, {})
    for offload in ({"optimizer": "cpu"}, {"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path), "sub_group_size": 20_000}):
        got = run_distributed(_two_optimizers, 2, offload)
        for g, w in zip(got, want):
            assert g["losses"] == w["losses"], offload
            for name, value in w["weights"].items():
                assert torch.equal(g["weights"][name], value), (offload, name)


def test_scale_benchmark_runs_and_overlap_changes_no_result(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """examples/benchmarks/scale.py end to end on a tiny GPT (a smoke test; no speed is checked):
    the NVMe run reports 16 bytes of training state per parameter on disk (under bf16-mixed too: the
    tiny model's rewritten compute copies are held in staging memory, not on disk), and training
    with every overlap off gives the same losses as with it on."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    try:
        import scale
    finally:
        sys.path.pop(0)
    tiny = ["--layers", "2", "--d-model", "128", "--steps", "2", "--nvme-root", str(tmp_path)]
    assert scale.main(["zinf", *tiny, "--bandwidth-mib", "16"]) == 0
    assert "= 16.0 B/parameter" in capsys.readouterr().out
    assert scale.main(["zinf", *tiny, "--bandwidth-mib", "16", "--precision", "bf16-mixed"]) == 0
    assert "= 16.0 B/parameter" in capsys.readouterr().out
    assert scale.main(["overlap", *tiny]) == 0
    assert "losses equal with overlap on and off: True" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _bf16_with_an_edit(rank: int, world: int, offload: dict) -> dict:
    """bf16 parameters (fp32 masters: a record of their own on NVMe), 3 AdamW steps, then an edit
    of the full weights written back into the shards and masters, then 2 more steps."""
    torch.manual_seed(0)
    model = models.GPT().to(torch.bfloat16)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(**offload))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses = []
    for step in range(5):
        if step == 3:
            with engine.gathered(write_back=True), torch.no_grad():
                model.wte.weight.mul_(0.5)
        losses.append(_step(model, opt, step, rank, world))
    return {"losses": losses, "weights": _weights(engine, model)}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One training step on this rank's slice of the global batch of ``step``; its loss."""
    per_rank = BATCH // world
    x, y = models.make_batch("gpt", step, BATCH)
    loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _weights(engine: ZeroEngine, model: torch.nn.Module) -> dict:
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_bf16_parameters_and_an_edit_on_nvme_match_no_offload(tmp_path: Path) -> None:
    """With bf16 parameters the fp32 master is not the parameter shard: both are swapped as records
    of their own; an edit inside ``gathered(write_back=True)`` reaches both. Bit for bit as no
    offload."""
    want = run_distributed(_bf16_with_an_edit, 2, {})
    got = run_distributed(_bf16_with_an_edit, 2, {"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path),
                                                  "sub_group_size": 5_000})
    for g, w in zip(got, want):
        assert g["losses"] == w["losses"]
        for name, value in w["weights"].items():
            assert torch.equal(g["weights"][name], value), name
    assert list(tmp_path.iterdir()) == []


def _bf16_gathers(rank: int, world: int, offload: dict, ckpt: str) -> dict:
    """fp32 parameters gathered in bf16 (``param_dtype``): 2 AdamW steps, an edit of the exact
    weights written back, a step, a load of the state dict saved before the edit, a step, a sharded
    checkpoint saved and loaded back, a step. Also the swap-file bytes one forward reads."""
    from lightning_zinf.checkpoint import load_sharded, save_sharded

    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(**offload), mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    io = _log_copy_io(engine)
    losses, forward_reads, saved = [], [], None
    for step in range(7):
        if step == 2:
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            with engine.gathered(write_back=True), torch.no_grad():
                model.wte.weight.mul_(0.5)
        if step == 4:
            model.load_state_dict(saved)
        if step == 6:
            save_sharded(engine, [opt], ckpt, {})
            load_sharded(engine, [opt], ckpt)
        read = len(io["read"])
        forward = engine.module.register_forward_hook(  # the compute copies' bytes read until the forward ends
            lambda *_: forward_reads.append(sum(n for _, n in io["read"][read:])))
        losses.append(_step(model, opt, step, rank, world))
        forward.remove()
    shard_bytes = sum(g.shard_numel * g.shard.element_size() for g in engine.groups)
    return {"losses": losses, "weights": _weights(engine, model), "forward_reads": forward_reads,
            "copies_written": sum(n for _, n in io["written"]), "shard_bytes": shard_bytes,
            "memory": engine.accounting.state_bytes()}


# Staging for one sub-group's records at a time and a few held ones (held records get half):
# the held gradients leave too little of that half for every compute copy (450 KB: too small for a step).
TIGHT_CAP = 550_000


def _log_copy_io(engine: ZeroEngine) -> dict[str, list[tuple[str, int]]]:
    """From now on, every read and write the swapper is asked for of a compute copy's swap file
    (key ``*.copy``): ``(key, bytes)`` in order (an observer of the I/O requests, outside the engine)."""
    io: dict[str, list[tuple[str, int]]] = {"read": [], "written": []}
    if engine.swapper is None:
        return io
    swapper = engine.swapper
    for verb, kind in (("read", "read"), ("write", "written")):
        def logged(key, tensor, _call=getattr(swapper, verb), _kind=kind):
            if key.endswith(".copy"):
                io[_kind].append((key, tensor.numel() * tensor.element_size()))
            return _call(key, tensor)
        setattr(swapper, verb, logged)
    return io


@pytest.mark.parametrize("param, optimizer", [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme"),
                                             ("cpu", "none"), ("cpu", "cpu"), ("cpu", "nvme"), ("none", "cpu"),
                                             ("none", "nvme")])
def test_bf16_gathers_read_16_bit_copies(tmp_path: Path, param: str, optimizer: str) -> None:
    """fp32 parameters offloaded under ``param_dtype=bf16``: gathers read the shards' 16-bit compute
    copies; on NVMe a forward reads half the fp32 shards' bytes (ZeRO-Infinity's 2 bytes per
    parameter), and after a step only from staging memory (the rewritten copies are held). The run (edit, load_state_dict, sharded checkpoint round trip) matches no offload
    bit for bit: a copy not refreshed after any of them would change a loss. Reads stay exact fp32.
    On the ``cpu`` tier with the optimizer there too, the fp32 shard is the master (the host keeps
    4 + 2 bytes per parameter, not 4 + 4 + 2). With only the optimizer on the ``cpu`` tier
    (ZeRO-Offload), the device keeps the 2-byte copies and the host the fp32 shards as masters."""
    want = run_distributed(_bf16_gathers, 2, {}, str(tmp_path / "want"))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    got = run_distributed(_bf16_gathers, 2, {"param": param, "optimizer": optimizer, "nvme_path": str(nvme),
                                             **({"sub_group_size": 20_000} if optimizer != "none" else {})},
                          str(tmp_path / "got"))
    for g, w in zip(got, want):
        assert g["losses"] == w["losses"]
        for name, value in w["weights"].items():
            assert value.dtype == torch.float32 and torch.equal(g["weights"][name], value), name
        if param == "nvme":
            # The first forward reads every group's copy (records are padded to whole 4096-byte
            # blocks); the copies that steps, the edit and the loads rewrite are held in staging
            # memory (it has room): no later forward reads one, and none is written again.
            groups = len(models.GPT(d=64).state_dict())
            assert g["shard_bytes"] / 2 <= g["forward_reads"][0] <= g["shard_bytes"] / 2 + 4096 * groups, g
            assert g["forward_reads"][1:] == [0] * 6 and g["copies_written"] == 0, g
        elif param == "none":
            assert g["memory"]["shards_device"] == g["shard_bytes"] // 2, g["memory"]
            assert g["memory"]["shards_cpu"] == g["shard_bytes"], g["memory"]
        if optimizer == "cpu" and param != "nvme":
            if param == "cpu":
                assert g["memory"]["shards_cpu"] == g["shard_bytes"] * 6 // 4, g["memory"]
            # The two moments and the step counts: no separate master.
            assert 2 * g["shard_bytes"] <= g["memory"]["optimizer"] < 2 * g["shard_bytes"] + 4096, g["memory"]
    assert list(nvme.iterdir()) == []


def test_held_compute_copies_are_written_and_read_back_under_staging_pressure(tmp_path: Path) -> None:
    """The same run with parameters and optimizer on NVMe under a staging cap too small to hold
    every rewritten compute copy beside the held gradients: the copies staging needs room for are
    written, and read back by the forwards that gather them (the I/O log shows both), and the run
    is still bit for bit the one without offload (a copy dropped unwritten, or read stale, would
    change a loss)."""
    want = run_distributed(_bf16_gathers, 2, {}, str(tmp_path / "want"))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    got = run_distributed(_bf16_gathers, 2, {"param": "nvme", "optimizer": "nvme", "nvme_path": str(nvme),
                                             "sub_group_size": 20_000, "staging_bytes": TIGHT_CAP},
                          str(tmp_path / "got"))
    for g, w in zip(got, want):
        assert g["losses"] == w["losses"]
        for name, value in w["weights"].items():
            assert torch.equal(g["weights"][name], value), name
        assert g["copies_written"] > 0 and sum(g["forward_reads"][1:]) > 0, g
    assert list(nvme.iterdir()) == []


def test_cpu_tier_keeps_copies_only_where_gathers_read_them() -> None:
    """A LoRA GPT on the ``cpu`` tier under bf16 gathers with its frozen base stored as INT8 codes:
    host memory holds each trainable fp32 shard and its bf16 copy (6 bytes per element) and the
    frozen codes and scales, and no copy of a frozen shard (the gathers send its codes)."""
    from lightning_zinf import ZeroPPConfig

    torch.manual_seed(0)
    engine = ZeroEngine(models.GPT(d=64, lora_rank=4), block_classes=["Block"], offload=OffloadConfig(param="cpu"),
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16"), zero_pp=ZeroPPConfig(frozen_bits=8))
    trainable = sum(g.shard_numel for g in engine.groups if g.trainable)
    codes = sum(t.untyped_storage().nbytes() for g in engine.groups if g.codes is not None for t in (g.codes, g.scales))
    assert trainable and codes
    assert engine.accounting.state_bytes()["shards_cpu"] == 6 * trainable + codes


def _checkpoint_peak(rank: int, world: int, nvme_path: str, ckpt: str) -> dict:
    from lightning_zinf.checkpoint import load_full_state_dict, load_sharded, save_sharded

    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path,
                                              sub_group_size=5_000, staging_bytes=140_000))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    per_rank = BATCH // world
    for step in range(2):
        x, y = models.make_batch("gpt", step, BATCH)
        models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]).backward()
        opt.step()
        opt.zero_grad()
    engine.release_all()
    on_disk = engine.resident_bytes()["nvme"]
    pool = engine.space.pool
    pool.peak = pool.in_use
    save_sharded(engine, [opt], ckpt, {})
    save_peak, pool.peak = pool.peak, pool.in_use
    load_sharded(engine, [opt], ckpt)
    load_peak, pool.peak = pool.peak, pool.in_use
    torch.manual_seed(1)
    pretrained = models.GPT().state_dict()
    load_full_state_dict(engine, pretrained)
    with engine.gathered():
        loaded = all(torch.equal(v, pretrained[k]) for k, v in model.state_dict().items())
    return {"on_disk": on_disk, "save_peak": save_peak, "load_peak": load_peak, "full_peak": pool.peak, "loaded": loaded}


def test_nvme_checkpoints_stream_one_group_at_a_time(tmp_path: Path) -> None:
    """Saving and loading NVMe-resident state brings one flat group's records into memory at a
    time, not the whole state (which may exceed RAM: the 3.3B model of scale.py has 53 GB)."""
    (tmp_path / "nvme").mkdir()
    ranks = run_distributed(_checkpoint_peak, 2, str(tmp_path / "nvme"), str(tmp_path / "ckpt"))
    for got in ranks:
        # The whole state would be all of ``on_disk``. The largest group (a block) is about 0.4 of it;
        # a load also holds that group's newly loaded moments while their record is rebuilt.
        assert 0 < got["save_peak"] <= 0.45 * got["on_disk"], got
        assert 0 < got["load_peak"] <= 0.65 * got["on_disk"], got
        assert 0 < got["full_peak"] <= 0.45 * got["on_disk"], got  # load_full_state_dict
        assert got["loaded"]


@pytest.mark.parametrize("checkpointing", [False, "reentrant"])
def test_activation_offload_moves_activations_only(checkpointing) -> None:
    """``OffloadConfig(activations=True)`` copies every activation autograd saves and no weight:
    saved views of gathered parameters are left to backward's re-gather (torch's ``save_on_cpu``
    would copy each weight out and back every step). Counted against plain PyTorch's saved
    tensors; the gradients are bit-equal to the engine's without offload. With reentrant
    activation checkpointing the saved tensors are the blocks' inputs (checkpoints)."""
    batch = models.make_batch("gpt", 0, BATCH)
    torch.manual_seed(0)
    reference = models.GPT(checkpointing=checkpointing)
    want_bytes, want_weights = models.saved_by_autograd(reference, batch)
    assert want_bytes > 0 and want_weights > 0
    grads = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = models.GPT(checkpointing=checkpointing)
        engine = ZeroEngine(model, block_classes=[models.Block], prefetch=PrefetchConfig(persistence_threshold=0))
        if offload:
            with engine.offload_activations():
                loss = models.loss_fn(model, *batch)
            counted = engine._activation_offload
            assert counted.copied_bytes == want_bytes
            assert counted.kept == want_weights
        else:
            loss = models.loss_fn(model, *batch)
        loss.backward()
        grads.append([g.grad_shard.clone() for g in engine.groups if g.grad_shard is not None])
    assert len(grads[1]) == len(grads[0]) > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _clip_by_value(rank: int, world: int, nvme: str) -> dict:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    strategy = ZeroInfinityStrategy(offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme))
    trainer = _trainer(strategy, world, gradient_clip_algorithm="value")
    lit = LitGPT(GLOBAL_BATCH // world)
    with pytest.raises(ValueError) as error:
        trainer.fit(lit)
    return {"message": str(error.value), "steps": len(lit.train_losses),
            "lightning_type": isinstance(error.value, MisconfigurationException)}


def test_clipping_by_value_with_gradients_on_disk_is_refused(tmp_path: Path) -> None:
    """The gradients are in swap files until the step: a clamp would find none and do nothing. The
    fit is refused at setup, before any step, with a ``MisconfigurationException`` as Lightning's
    DeepSpeed strategy refuses clipping by value (and a ``ValueError``, as before)."""
    result = run_distributed(_clip_by_value, 1, str(tmp_path), init_pg=False)[0]
    assert "gradient_clip_algorithm='value' needs the gradients in memory" in result["message"]
    assert result["lightning_type"]
    assert result["steps"] == 0


def test_profiler_ranges_name_the_engines_phases(tmp_path: Path) -> None:
    """In a profiler trace every gather and reduce-scatter the engine issues sits in a range of its
    own (zinf.gather, zinf.reduce_scatter: as many as the collectives it counted), and releases,
    NVMe swaps and the step's two ends are named too (FSDP2 names its phases the same way)."""
    from collections import Counter

    from torch.profiler import profile

    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(model, block_classes=[models.Block], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=str(tmp_path)))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    before = engine.collectives_issued
    with profile() as prof:
        for step in range(2):
            models.loss_fn(model, *models.make_batch("gpt", step, BATCH)).backward()
            opt.step()
            opt.zero_grad()
    seen = Counter(e.name for e in prof.events() if e.name.startswith("zinf."))
    assert seen["zinf.gather"] + seen["zinf.reduce_scatter"] == engine.collectives_issued - before > 0
    assert seen["zinf.reduce_scatter"] > 0 and seen["zinf.release"] > 0
    assert seen["zinf.swap_in"] > 0 and seen["zinf.swap_out"] > 0
    assert seen["zinf.before_step"] == seen["zinf.after_step"] == 2
    engine.swapper.close()


def _optimizer_state_dicts(rank: int, world: int, offload: dict) -> dict:
    """AdamW over 6 steps: the optimizer's own ``state_dict()`` after steps 2, 4 and 5, the one
    after step 2 loaded back with the optimizer's own ``load_state_dict()`` before step 5."""
    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=100),
                        offload=OffloadConfig(**offload), mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    read, losses = [], []
    for step in range(6):
        if step == 5:
            opt.load_state_dict(copy.deepcopy(read[0]))  # the moments after step 2 (the weights are step 4's)
        losses.append(_step(model, opt, step, rank, world))
        if step in (2, 4, 5):
            read.append(copy.deepcopy(opt.state_dict()))
    return {"read": read, "losses": losses, "weights": _weights(engine, model)}


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_the_optimizer_state_dict_of_an_nvme_offloaded_optimizer_holds_its_states(tmp_path: Path, param: str) -> None:
    """An optimizer whose states live on NVMe: its own ``state_dict()`` (what a user's callback or
    loop reads; the Trainer's checkpoints take another route) holds every state's values, not the
    empty tensors the swap records leave between steps, and its own ``load_state_dict()`` reaches the
    swap files: bit for bit the run without offload."""
    want = run_distributed(_optimizer_state_dicts, 2, {})
    got = run_distributed(_optimizer_state_dicts, 2, {"param": param, "optimizer": "nvme", "nvme_path": str(tmp_path),
                                                      "sub_group_size": 3_000})
    for g, w in zip(got, want):
        assert g["losses"] == w["losses"]
        for name, value in w["weights"].items():
            assert torch.equal(g["weights"][name], value), name
        for got_read, want_read in zip(g["read"], w["read"]):
            assert got_read["state"].keys() == want_read["state"].keys()
            for index, state in want_read["state"].items():
                for name, value in state.items():
                    assert torch.equal(got_read["state"][index][name], value), (index, name)


def _held_gradients(rank: int, world: int, offload: dict, ckpt: str) -> dict:
    """4 steps of 2 micro-batches each (bf16 gathers, AdamW), a sharded checkpoint saved between the
    last backward and the step of step 1; the swap files of gradient shards that exist at the end."""
    from lightning_zinf.checkpoint import save_sharded

    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=100),
                        offload=OffloadConfig(**offload), mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    per_rank, losses = BATCH // world, []
    for step in range(4):
        for micro in range(2):
            x, y = models.make_batch("gpt", 2 * step + micro, BATCH)
            loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
            (loss / 2).backward()
            losses.append(loss.item())
        if step == 1:
            before = _grad_files(engine)
            save_sharded(engine, [opt], ckpt, {})  # the gradients held in memory go to their files
        opt.step()
        opt.zero_grad()
    written = engine.swapper.bytes_written if engine.swapper else 0
    return {"losses": losses, "weights": _weights(engine, model), "before_checkpoint": before,
            "grad_files": _grad_files(engine), "written": written}


def _grad_files(engine: ZeroEngine) -> list[str]:
    """The gradient shards' swap files in the engine's swap folder."""
    return sorted(p.name for p in engine.swapper.folder.iterdir() if p.name.endswith(".grad.swp")) if engine.swapper else []


def test_gradient_shards_stay_in_staging_memory_unwritten_until_staging_needs_room(tmp_path: Path) -> None:
    """With the optimizer on NVMe, the gradient shards backward reduces are held in staging memory
    and consumed there by the step: no gradient file is written at all while staging has room
    (the folder is the observer). A checkpoint between backward and step writes them. Under a cap
    that fits one sub-group's records at a time (the step must not force two into memory: it
    failed so before) and with room enough, bit for bit the run without offload (a gradient lost
    or read stale would change a loss). test_staging tests the writes under pressure."""
    want = run_distributed(_held_gradients, 2, {}, str(tmp_path / "want"))
    runs = {}
    for name, cap in (("room", None), ("tight", 500_000)):
        folder = tmp_path / name
        folder.mkdir()
        offload = {"param": "nvme", "optimizer": "nvme", "nvme_path": str(folder), "sub_group_size": 3_000, "staging_bytes": cap}
        runs[name] = run_distributed(_held_gradients, 2, offload, str(tmp_path / f"ckpt_{name}"))
        for g, w in zip(runs[name], want):
            assert g["losses"] == w["losses"], name
            for param, value in w["weights"].items():
                assert torch.equal(g["weights"][param], value), (name, param)
    for room, tight in zip(runs["room"], runs["tight"]):
        assert room["before_checkpoint"] == [], room
        assert room["grad_files"] == tight["grad_files"]  # the checkpoint wrote every one


def _split_across_checkpoints(rank: int, world: int, folder: str, first: dict, second: dict) -> dict:
    from lightning_zinf import ZeroInfinityFabricStrategy
    from tests.test_fabric import _build, _fabric, _train

    fabric = _fabric(ZeroInfinityFabricStrategy(block_classes=["Block"], offload=first))
    model, optimizer = _build(fabric)
    _train(fabric, model, optimizer, range(2))
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    straight, norms = _train(fabric, model, optimizer, range(2, 5))
    on_device = [g.optimizer_on_device for g in fabric.strategy.engine.groups]

    fabric = _fabric(ZeroInfinityFabricStrategy(block_classes=["Block"], offload=second))
    model, optimizer = _build(fabric)
    fabric.load(folder, {"model": model, "optimizer": optimizer})
    resumed, resumed_norms = _train(fabric, model, optimizer, range(2, 5))
    return {"straight": (straight, norms), "resumed": (resumed, resumed_norms), "on_device": on_device,
            "then": [g.optimizer_on_device for g in fabric.strategy.engine.groups]}


@pytest.mark.parametrize("first, second", [
    ({"optimizer": "cpu", "device_bytes": SPLIT}, {"optimizer": "cpu"}),
    ({"optimizer": "cpu"}, {"optimizer": "cpu", "device_bytes": SPLIT}),
], ids=["split-then-host", "host-then-split"])
def test_a_device_split_is_not_part_of_a_checkpoint(tmp_path: Path, first: dict, second: dict) -> None:
    """Under Fabric with gradient accumulation and clipping: a checkpoint saved with the first
    groups' optimizer state on the device loads with all of it on the host, and the other way
    round, and training goes on with the losses and gradient norms of the run that never stopped
    (placement is not part of a checkpoint's meaning)."""
    for r in run_distributed(_split_across_checkpoints, 2, str(tmp_path / "ckpt"), first, second, init_pg=False):
        assert any(r["on_device"] + r["then"]) and not all(r["on_device"] + r["then"])
        assert r["resumed"] == r["straight"]
