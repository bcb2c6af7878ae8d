"""The precision policy (MixedPrecisionConfig): bf16 gathers and compute, fp32 masters and reductions.

The reference is written out by hand in plain PyTorch, as FSDP2's and DeepSpeed's bf16 modes define
the arithmetic: an fp32 master model; each step a bf16 copy of it computes forward and backward on
each rank's slice of the batch (under autocast); the bf16 gradients are cast to the reduce dtype,
averaged over the slices and stepped by AdamW on the fp32 masters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_zinf import MixedPrecisionConfig, PrefetchConfig, ZeroEngine, ZeroPPConfig
from tests import models
from tests.harness import run_distributed

STEPS = 6
BATCH = 8
BF16 = MixedPrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(models, name)(**kwargs)


def _slice(step: int, data: str, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = models.make_batch(data, step, BATCH)
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _reference(_rank: int, _world: int, name: str, kwargs: dict, world: int, reduce_dtype: torch.dtype,
               dtype: torch.dtype = torch.bfloat16) -> tuple:
    """One process (run like the ranks, with one thread: bf16 GEMMs round by their blocking)."""
    data = "gpt" if name == "GPT" else "mlp"
    master = _build(name, **kwargs)
    opt = torch.optim.AdamW([p for p in master.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        compute = copy.deepcopy(master).to(dtype)
        grads: dict[str, torch.Tensor] = {}
        total = 0.0
        for rank in range(world):
            x, y = _slice(step, data, rank, world)
            x = x.to(dtype) if x.is_floating_point() else x
            compute.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = models.loss_fn(compute, x, y)
            loss.backward()
            total += loss.item() / world
            for n, p in compute.named_parameters():
                if p.grad is not None:
                    g = p.grad.to(reduce_dtype)
                    grads[n] = g if n not in grads else grads[n] + g
        for n, p in master.named_parameters():
            if n in grads:
                p.grad = (grads[n] / world).float()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _zero(rank: int, world: int, name: str, kwargs: dict, policy: MixedPrecisionConfig, zero_pp: dict,
          engine_kwargs: dict | None = None) -> tuple:
    data = "gpt" if name == "GPT" else "mlp"
    model = _build(name, **kwargs)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0), mixed_precision=policy,
                        zero_pp=ZeroPPConfig(**zero_pp), **(engine_kwargs or {}))
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                                   weight_decay=0.1))
    losses, dtypes = [], set()
    for step in range(STEPS):
        x, y = _slice(step, data, rank, world)
        handles = [m.register_forward_pre_hook(lambda m, a: dtypes.update(p.dtype for p in m.parameters(recurse=False)))
                   for m in model.modules()]
        with torch.autocast("cpu", dtype=policy.param_dtype):
            loss = models.loss_fn(model, x, y)
        for h in handles:
            h.remove()
        loss.backward()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
        opt.step()
        opt.zero_grad()
    with engine.gathered():  # by state-dict names: a tiled layer's too
        weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
        gathered_dtypes = {p.dtype for p in model.parameters()}
    return losses, weights, dtypes, gathered_dtypes


def _distance(a: tuple, b: tuple) -> float:
    worst = max(abs(x - y) / max(abs(y), 1e-8) for x, y in zip(a[0], b[0]))
    for name, ref in b[1].items():
        worst = max(worst, ((a[1][name] - ref).norm() / ref.norm().clamp_min(1e-12)).item())
    return worst


@pytest.mark.parametrize(
    "name, kwargs, dtype, reduce_dtype",
    [("GPT", {}, torch.bfloat16, torch.float32), ("MLP", {"frozen": True}, torch.bfloat16, torch.float32),
     ("TwiceMLP", {}, torch.bfloat16, torch.bfloat16), ("GPT", {}, torch.float16, torch.float32)],
)
def test_policy_matches_hand_written_reference(name: str, kwargs: dict, dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Forward and backward see bf16 (fp16) weights (observed in every module's pre-hook), the
    masters stay fp32 (what ``gathered()`` shows), and 6 AdamW steps land where the hand-written
    policy does: the same low-precision arithmetic on the same slices, so to float tolerance."""
    policy = MixedPrecisionConfig(param_dtype=dtype, reduce_dtype=reduce_dtype)
    got = run_distributed(_zero, 2, name, kwargs, policy, {})
    want = run_distributed(_reference, 1, name, kwargs, 2, reduce_dtype, dtype, init_pg=False)[0]
    losses, weights, dtypes, gathered_dtypes = got[0]
    assert dtypes == {dtype}
    assert gathered_dtypes == {torch.float32}
    assert _distance(got[0], want) <= 1e-5, _distance(got[0], want)
    assert _distance(got[1], got[0]) == 0.0


def test_bf16_policy_with_zero_pp_stays_in_its_bands() -> None:
    """hpZ (bit-exact), qwZ (INT8 weights) and qgZ (INT8 gradients) under the bf16 policy at 4
    ranks as 2 nodes: the losses stay within 2% of the reference, whose arithmetic has no
    quantization."""
    zpp = {"ranks_per_node": 2, "hpz": True, "qwz": True, "qgz": True, "qgz_bits": 8}
    got = run_distributed(_zero, 4, "GPT", {}, BF16, zpp)
    want = run_distributed(_reference, 1, "GPT", {}, 4, torch.float32, init_pg=False)[0]
    for a, b in zip(got[0][0], want[0]):
        assert abs(a - b) / b < 0.02, (got[0][0], want[0])
    hpz_only = run_distributed(_zero, 4, "GPT", {}, BF16, {"ranks_per_node": 2, "hpz": True})
    assert _distance(hpz_only[0], want) <= 1e-5


def test_bf16_policy_with_offload_tiling_and_frozen_codes(tmp_path) -> None:
    """Parameters and optimizer state in CPU memory, or on NVMe, change no bit of the bf16
    policy's training; tiling changes only the blocking of the bf16 matmuls (losses within 1%);
    frozen weights stored as INT8 codes stay within 2% of the loss."""
    from lightning_zinf import OffloadConfig, TilingConfig

    plain = run_distributed(_zero, 2, "GPT", {}, BF16, {})[0]
    for offload in ({"param": "cpu", "optimizer": "cpu"},
                    {"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}):
        got = run_distributed(_zero, 2, "GPT", {}, BF16, {}, {"offload": OffloadConfig(**offload)})[0]
        assert _distance(got, plain) == 0.0, offload
    tiled = run_distributed(_zero, 2, "GPT", {}, BF16, {}, {"tiling": TilingConfig(tile_numel=1024)})[0]
    assert max(abs(a - b) / b for a, b in zip(tiled[0], plain[0])) < 1e-2
    frozen = run_distributed(_zero, 2, "MLP", {"frozen": True}, BF16, {"frozen_bits": 8})[0]
    exact = run_distributed(_zero, 2, "MLP", {"frozen": True}, BF16, {})[0]
    for a, b in zip(frozen[0], exact[0]):
        assert abs(a - b) / b < 0.02


def _frozen_storage(rank: int, world: int, frozen_dtype: str | None, ckpt: str, save: bool) -> dict:
    """A rank-4 LoRA GPT under the bf16 policy, 4 steps; with ``save`` a sharded checkpoint after 2
    steps, else it is loaded there (by a freshly built model) and the run goes on from it."""
    from lightning_zinf.checkpoint import CheckpointError, load_sharded, save_sharded

    model = _build("GPT", lora_rank=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    policy = MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="fp32", frozen_dtype=frozen_dtype)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        mixed_precision=policy)
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    shard_bytes = engine.memory()["shards_device"][0]
    losses, error = [], ""
    for step in range(4):
        if step == 2 and save:
            save_sharded(engine, [opt], ckpt, {})
        elif step == 2:
            load_sharded(engine, [opt], ckpt)
        x, y = _slice(step, "gpt", rank, world)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.loss_fn(model, x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = ZeroEngine(_build("GPT", lora_rank=4), block_classes=["Block"], mixed_precision=BF16)
    try:  # stored in fp32 there: a layout the checkpoint does not have, named as such
        load_sharded(other, [], ckpt, load_optimizer=False)
    except CheckpointError as e:
        error = str(e)
    return {"losses": losses, "weights": weights, "frozen": frozen, "shard_bytes": shard_bytes, "error": error,
            "frozen_numel": sum(t.numel() for t in frozen.values())}


def test_frozen_dtype_halves_the_frozen_shards_and_changes_no_computed_value(tmp_path) -> None:
    """``frozen_dtype="bf16"`` under the bf16 policy: the frozen base's shards take half the bytes,
    training is bit-identical (those weights are gathered in bf16 either way), the frozen weights
    read back are the fp32 ones rounded to bf16, and a sharded checkpoint resumes exactly; loading
    it into a model that stores them in fp32 is refused by name."""
    exact = run_distributed(_frozen_storage, 2, None, str(tmp_path / "fp32"), True)[0]
    halved = run_distributed(_frozen_storage, 2, "bf16", str(tmp_path / "bf16"), True)[0]
    resumed = run_distributed(_frozen_storage, 2, "bf16", str(tmp_path / "bf16"), False)[0]
    # 2 ranks: each holds half the frozen elements, at 2 bytes instead of 4 (up to alignment padding).
    saved = exact["shard_bytes"] - halved["shard_bytes"]
    assert abs(saved - exact["frozen_numel"]) <= 2 * 16 * len(exact["frozen"]), (saved, exact["frozen_numel"])
    assert halved["losses"] == exact["losses"]
    for name, value in exact["weights"].items():
        if name in exact["frozen"]:
            assert halved["weights"][name].dtype == torch.bfloat16
            assert torch.equal(halved["weights"][name], exact["frozen"][name].to(torch.bfloat16)), name
        else:
            assert torch.equal(halved["weights"][name], value), name
    assert resumed["losses"] == halved["losses"]
    assert all(torch.equal(resumed["weights"][n], w) for n, w in halved["weights"].items())
    assert "frozen_dtype" in halved["error"] and "bfloat16" in halved["error"], halved["error"]


def _nested(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=400), mixed_precision=BF16)  # fc3 persistent
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _slice(0, "mlp", rank, world)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        models.loss_fn(model, x, y).backward()
    opt.step()
    with engine.gathered(write_back=True):
        with engine.gathered():
            pass
        dtypes = {p.dtype for p in model.parameters()}
        with torch.no_grad():
            model.fc3.bias.add_(0.125)
            edited = model.fc3.bias.detach().clone()
    with engine.gathered():
        after = model.fc3.bias.detach().clone()
    return {"dtypes": dtypes, "edited": edited, "after": after,
            "compute": {p.dtype for p in model.fc3.parameters()}}


def test_nested_gathered_blocks_keep_exact_values() -> None:
    """An inner ``gathered()`` does not switch the outer block's persistent units back to bf16:
    the outer block still reads and edits fp32, and its edit reaches the shards exactly."""
    got = run_distributed(_nested, 2)[0]
    assert got["dtypes"] == {torch.float32}
    assert torch.equal(got["after"], got["edited"])
    assert got["compute"] == {torch.bfloat16}  # persistent units back in the compute dtype after


def _bytes(rank: int, world: int, policy: MixedPrecisionConfig) -> dict:
    model = _build("GPT", layers=3, d=64)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0), mixed_precision=policy)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        engine.comm.bytes.reset()
        x, y = _slice(step, "gpt", rank, world)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy.param_dtype is not None):
            loss = models.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"gathered": engine.comm.bytes.gathered, "reduced": engine.comm.bytes.reduce_scattered,
            "peak": engine.peak_gathered_bytes}


def test_bf16_gathers_move_and_hold_half_the_bytes() -> None:
    """Shards are cast before the all-gather: a bf16 step receives exactly half the bytes of an
    fp32 step and holds half the gathered bytes at its peak; gradients are reduce-scattered in fp32
    (the reduce dtype), the same bytes as before; bf16 reductions halve those too."""
    fp32 = run_distributed(_bytes, 2, MixedPrecisionConfig())[0]
    bf16 = run_distributed(_bytes, 2, BF16)[0]
    bf16_reduce = run_distributed(_bytes, 2, MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="bf16"))[0]
    assert bf16["gathered"] * 2 == fp32["gathered"]
    assert bf16["peak"] * 2 == fp32["peak"]
    assert bf16["reduced"] == fp32["reduced"]
    assert bf16_reduce["reduced"] * 2 == fp32["reduced"]


def test_config_validation_and_names() -> None:
    assert MixedPrecisionConfig(param_dtype="bf16").param_dtype is torch.bfloat16
    assert MixedPrecisionConfig(param_dtype="torch.float16", reduce_dtype="float32").reduce_dtype is torch.float32
    assert MixedPrecisionConfig().gradient_reduce_dtype is torch.float32
    assert MixedPrecisionConfig(param_dtype="bf16").compute_dtype(torch.int64) is torch.int64
    with pytest.raises(ValueError, match="param_dtype='int8' is invalid.*bf16"):
        MixedPrecisionConfig(param_dtype="int8")
    with pytest.raises(ValueError, match="reduce_dtype=torch.float64 is invalid"):
        MixedPrecisionConfig(reduce_dtype=torch.float64)
    policy = MixedPrecisionConfig(param_dtype="bf16", frozen_dtype="bf16")
    assert policy.storage_dtype(torch.float32, trainable=False) is torch.bfloat16
    assert policy.storage_dtype(torch.float32, trainable=True) is torch.float32
    assert policy.storage_dtype(torch.int64, trainable=False) is torch.int64


# --- through the Trainer --------------------------------------------------------------------------------
def _fit(rank: int, world: int, precision: str, root: str, ckpt: str | None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zinf.callbacks import ZeroMonitor
    from tests.test_checkpoint import LitEpochs
    from tests.test_trainer import GLOBAL_BATCH, _trainer

    lit = LitEpochs(GLOBAL_BATCH // world)
    metrics: list[dict] = []

    class Record(ZeroMonitor):
        def on_train_batch_end(self, trainer, *args) -> None:
            super().on_train_batch_end(trainer, *args)
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("zinf/")})

    trainer = _trainer("zero_infinity", world, precision=precision, max_steps=-1, max_epochs=2, limit_val_batches=0,
                       enable_checkpointing=True, default_root_dir=root,
                       callbacks=[Record(), ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)])
    trainer.fit(lit, ckpt_path=ckpt)
    engine = trainer.strategy.engine
    with trainer.strategy.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in lit.named_parameters()}
    return {"losses": lit.train_losses, "weights": weights, "metrics": metrics,
            "dtypes": sorted({f"{g.dtype}->{g.compute_dtype}" for g in engine.groups})}


def test_trainer_bf16_mixed_gathers_bf16_and_resumes_exactly(tmp_path) -> None:
    """``Trainer(precision="bf16-mixed")`` derives the bf16 policy: fp32 shards gathered as bf16
    (half the gathered bytes per step of ``"32-true"``, in ZeroMonitor's count), the ledger logged
    per step, the loss curve within bf16's rounding of fp32's, and a resume from the epoch-1
    checkpoint bit-exact."""
    fp32 = run_distributed(_fit, 2, "32-true", str(tmp_path / "fp32"), None, init_pg=False)[0]
    bf16 = run_distributed(_fit, 2, "bf16-mixed", str(tmp_path / "bf16"), None, init_pg=False)[0]
    assert bf16["dtypes"] == ["torch.float32->torch.bfloat16"]
    assert fp32["dtypes"] == ["torch.float32->torch.float32"]
    for a, b in zip(bf16["metrics"], fp32["metrics"]):
        assert 2 * a["zinf/gathered_bytes"] == b["zinf/gathered_bytes"]
        assert 0 < a["zinf/peak_gathered_bytes"] < b["zinf/peak_gathered_bytes"]
        assert a["zinf/peak_device_total_bytes"] >= a["zinf/peak_shards_device_bytes"] + a["zinf/peak_gathered_bytes"]
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=3e-2, atol=0)
    resumed = run_distributed(_fit, 2, "bf16-mixed", str(tmp_path / "resumed"),
                              str(tmp_path / "bf16" / "epoch=0-step=5.ckpt"), init_pg=False)[0]
    assert resumed["losses"] == bf16["losses"][5:]
    for name, value in bf16["weights"].items():
        assert value.dtype == torch.float32 and torch.equal(resumed["weights"][name], value), name


STEP_WITH_INF = 4


def _fit_fp16(rank: int, world: int, strategy: str) -> dict:
    """``16-mixed`` through the Trainer. Lightning builds ``MixedPrecision("16-mixed", "cuda")``
    only with an accelerator (on the CPU it falls back to bf16), so the plugin it would build is
    passed by hand with a CPU ``GradScaler``: the strategy's own translation and policy still run."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    class LitInf(LitGPT):
        """At one step, on the last rank only, one element of ``ln_f.weight`` gets an infinite
        gradient. Under ZeRO it lands in one rank's shard only; the step must be skipped everywhere."""

        def configure_model(self) -> None:
            super().configure_model()
            self.inf_term = None
            # Registered before the engine's hooks: runs while ln_f is still gathered.
            self.model.ln_f.register_forward_hook(self._stash)

        def _stash(self, module, args, output) -> None:
            inject = self.trainer.global_step == STEP_WITH_INF and self.trainer.global_rank == world - 1
            self.inf_term = module.weight.flatten()[0] * float("inf") if inject else None

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss if self.inf_term is None else loss + self.inf_term

    scales: list[float] = []

    class RecordScale(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            scales.append(trainer.precision_plugin.scaler.get_scale())

    lit = LitInf(GLOBAL_BATCH // world)
    # A low initial scale: fp16 weights (not only autocast's matmuls) would overflow at 2**16 in
    # the first steps, which would skip different steps than DDP's autocast does.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    trainer = _trainer(strategy, world, plugins=[plugin], callbacks=[RecordScale()], val_check_interval=None,
                       limit_val_batches=0)
    trainer.fit(lit)
    engine = getattr(trainer.strategy, "engine", None)
    return {"losses": lit.train_losses, "scales": scales, "scaler": type(trainer.precision_plugin.scaler).__name__,
            "dtypes": sorted({f"{g.dtype}->{g.compute_dtype}" for g in engine.groups}) if engine else None}


def test_trainer_fp16_mixed_skips_a_step_with_one_shard_infinite_on_every_rank() -> None:
    """``16-mixed`` gathers and computes in fp16 with fp32 master shards and a ``ShardedGradScaler``.
    An infinite gradient that reaches one rank's shard only makes every rank skip that step and
    halve its scale, as DDP (whose all-reduce spreads it) does: the scales match DDP's step for
    step, and the losses track DDP's within fp16's rounding. A plain ``GradScaler`` would skip on
    one rank only and let the replicas diverge."""
    zinf = run_distributed(_fit_fp16, 2, "zero_infinity", init_pg=False)
    ddp = run_distributed(_fit_fp16, 2, "ddp", init_pg=False)
    assert zinf[0]["dtypes"] == ["torch.float32->torch.float16"]
    assert zinf[0]["scaler"] == "ShardedGradScaler"
    want = [256.0] * STEP_WITH_INF + [128.0] * (len(ddp[0]["scales"]) - STEP_WITH_INF)
    assert ddp[0]["scales"] == ddp[1]["scales"] == want
    assert zinf[0]["scales"] == zinf[1]["scales"] == want
    finite = [i for i in range(len(want)) if i != STEP_WITH_INF]
    got, ref = (torch.tensor([run[0]["losses"][i] for i in finite]) for run in (zinf, ddp))
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=0)
