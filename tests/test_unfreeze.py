"""Freezing and unfreezing during training: ``requires_grad`` changes between steps, as fine-tuning
recipes make it (gradual unfreezing, PEFT adapter switches, DeepSpeed's unbalanced-gradients test),
and parameter groups added to a sharded optimizer with ``add_param_group``.

Each run is compared with an independent reference: plain single-process PyTorch doing the same
arithmetic by hand (the ranks' slices of the global batch, their gradients averaged), or the same
Lightning Trainer run on one device with the whole global batch (not DDP, which never reduces the
gradients of parameters unfrozen after it wrapped the model).
"""

from __future__ import annotations

import copy

import lightning.fabric as LF
import lightning.pytorch as L
import peft
import pytest
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch.callbacks import BackboneFinetuning
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_zinf import (MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine, ZeroInfinityStrategy,
                            ZeroPPConfig)
from lightning_zinf.checkpoint import full_optimizer_state_dict, load_sharded, save_sharded
from tests import models
from tests.harness import run_distributed

WORLD = 2
BATCH = 8
STEPS = 6


def _slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


class Residual(torch.nn.Module):
    """A pre-norm residual MLP block: one unit of the engine (``block_classes``), whose flat groups
    mix weights and biases, norms and projections."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _residual_mlp() -> torch.nn.Module:
    """Every parameter has a real gradient here (a GPT's attention key bias has one of pure rounding
    noise, which AdamW's normalisation turns into unit steps in whatever direction the noise has)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), *(Residual(32) for _ in range(3)), torch.nn.Linear(32, 8))


def _toggle(model: torch.nn.Module, step: int) -> None:
    """DeepSpeed's unbalanced-gradients test, as a shape: a different half of the parameters
    requires a gradient at each step (drawn from the step number alone, the same on every rank):
    inside one unit some flat groups turn off, others on, and groups are split."""
    named = list(model.named_parameters())
    chosen = set(torch.randperm(len(named), generator=torch.Generator().manual_seed(step))[: len(named) // 2].tolist())
    for k, (_, p) in enumerate(named):
        p.requires_grad_(k in chosen)


def _toggled_reference(_rank: int, _world: int, dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch by hand: fp32 master weights; each step a ``dtype`` copy computes forward and
    backward on each rank's slice (autocast for bf16), the gradients are summed in fp32 and halved
    (as the reduce-scatter averages them), clipped to norm 1.0 over the parameters that have one, and AdamW
    steps the masters that got one (plain torch skips the others: no decay, no moment update)."""
    master = _residual_mlp()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        _toggle(master, step)
        compute = copy.deepcopy(master).to(dtype)
        x, y = models.make_batch("mlp", step, BATCH)
        grads: dict[str, torch.Tensor] = {}
        total = 0.0
        for rank in range(WORLD):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = models.loss_fn(compute, _slice(x, rank, WORLD), _slice(y, rank, WORLD))
            loss.backward()
            total += loss.item() / WORLD
            for n, p in compute.named_parameters():
                if p.grad is not None:
                    grads[n] = grads.get(n, 0) + p.grad.float()
            compute.zero_grad()
        for n, p in master.named_parameters():
            p.grad = grads[n] / WORLD if n in grads else None
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _toggled_zero(rank: int, world: int, dtype: torch.dtype,
                  offload: dict) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    model = _residual_mlp()
    _toggle(model, 0)  # the flags the model is partitioned with: half its flat groups are built frozen
    policy = MixedPrecisionConfig(param_dtype=dtype) if dtype != torch.float32 else MixedPrecisionConfig()
    engine = ZeroEngine(model, block_classes=(Residual,), mixed_precision=policy, offload=OffloadConfig(**offload))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, trainable_groups = [], []
    for step in range(STEPS):
        _toggle(model, step)
        x, y = models.make_batch("mlp", step, BATCH)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = models.loss_fn(model, _slice(x, rank, world), _slice(y, rank, world))
        loss.backward()
        trainable_groups.append(sum(g.trainable for g in engine.groups))
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, trainable_groups


def _distance(got: tuple, want: tuple) -> float:
    worst = max(abs(a - b) / abs(b) for a, b in zip(got[0], want[0]))
    for name, ref in want[1].items():
        worst = max(worst, ((got[1][name] - ref).norm() / ref.norm()).item())
    return worst


@pytest.mark.parametrize("dtype, offload", [
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.bfloat16, {"param": "cpu", "optimizer": "cpu"}),
    (torch.float32, {"param": "nvme", "optimizer": "cpu"}),
], ids=["fp32", "bf16", "bf16-cpu-offload", "fp32-nvme-params-cpu-optimizer"])
def test_toggling_half_the_parameters_each_step_matches_plain_torch(dtype: torch.dtype, offload: dict,
                                                                    tmp_path) -> None:
    """A random half of a residual MLP's parameters trains at each of 6 AdamW steps (with
    clipping), on 2 ranks, fp32 and under a bf16 policy, with the shards and the optimizer on the
    device, in CPU memory or on NVMe: groups built frozen get their masters (on the optimizer's
    tier) when first unfrozen, groups turned off get no gradient and are not stepped (no weight
    decay either), and the losses and weights match plain torch's (which skips parameters without
    gradient)."""
    if "nvme" in offload.values():
        offload = {**offload, "nvme_path": str(tmp_path)}
    got = run_distributed(_toggled_zero, WORLD, dtype, offload)
    want = run_distributed(_toggled_reference, 1, dtype, init_pg=False)[0]
    assert _distance(got[0], want) <= 1e-5, _distance(got[0], want)
    assert _distance(got[1], got[0][:2]) == 0.0
    counts = got[0][2]
    assert len(set(counts)) > 1  # the set of trainable groups really changed from step to step


# --- Lightning's BackboneFinetuning, end to end ------------------------------------------------------
EPOCHS = 3
UNFREEZE_AT = 1


class Transfer(L.LightningModule):
    """A pretrained backbone and a new head: ``BackboneFinetuning`` freezes the backbone at setup
    and unfreezes it into a param group of its own at epoch ``UNFREEZE_AT``, with a learning rate
    it raises every epoch after."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                            torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 4)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.head(self.backbone(x)), y)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(data, range(rank, len(data), world)), batch_size=BATCH // world)


def _times_1_5(epoch: int) -> float:
    return 1.5


def _finetune(rank: int, world: int, strategy: str) -> dict:
    lit = Transfer()
    # No persistent units: between uses every parameter is an empty tensor (BaseFinetuning compares
    # the param groups' tensors with the backbone's by value, torch.equal).
    zero = ZeroInfinityStrategy(prefetch=PrefetchConfig(persistence_threshold=0))
    trainer = L.Trainer(strategy=zero if strategy == "zero_infinity" else strategy,
                        accelerator="cpu", devices=world, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE_AT, lambda_func=_times_1_5)])
    trainer.fit(lit)
    optimizer = trainer.optimizers[0]
    return {"losses": lit.losses, "weights": {k: v.clone() for k, v in lit.state_dict().items()},
            "lrs": [g["lr"] for g in optimizer.param_groups], "groups": len(optimizer.param_groups)}


def test_backbone_finetuning_under_the_trainer_matches_one_device() -> None:
    """Lightning's ``BackboneFinetuning`` run by the Trainer on 2 ranks: the backbone, frozen when
    the model is partitioned, is unfrozen at epoch 1 into a new param group of the sharded
    optimizer (``unfreeze_and_add_param_group``), whose learning rate the callback then raises.
    Every step's loss and the final weights (backbone and head) match the same Trainer run on one
    device with the whole global batch, and the backbone really trained.

    Not DDP: it reduces only the gradients of the parameters that required one when it wrapped
    the model, so under ``strategy="ddp"`` each rank trains the unfrozen backbone on its own slice
    and the ranks' backbones part (by about 2e-2 after two epochs here)."""
    got = run_distributed(_finetune, WORLD, "zero_infinity", init_pg=False)
    want = run_distributed(_finetune, 1, "auto", init_pg=False)[0]
    initial = Transfer().state_dict()
    for mine in got:
        assert mine["groups"] == want["groups"] == 2
        assert mine["lrs"] == pytest.approx(want["lrs"])
        assert mine["losses"] == pytest.approx(want["losses"], rel=1e-5)
        for name, ref in want["weights"].items():
            torch.testing.assert_close(mine["weights"][name], ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want["weights"]["backbone.0.weight"], initial["backbone.0.weight"])


# --- a PEFT model whose active adapter is switched ---------------------------------------------------
ADAPTERS = ["a", "a", "b", "b", "b", "a", "a"]  # the adapter trained at each step


def _peft_model() -> peft.PeftModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    base = transformers.LlamaForCausalLM(config)
    lora = dict(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(**lora))
    model.set_adapter("a")
    return model


def _adapter_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def _tokens(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of step ``step``'s global batch of token ids."""
    return _slice(torch.randint(1, 64, (BATCH, 9), generator=torch.Generator().manual_seed(100 + step)), rank, WORLD)


def _adapter_step(model, opt, step: int, rank: int) -> float:
    model.set_adapter(ADAPTERS[step])  # flips requires_grad: the other adapter is frozen
    ids = _tokens(step, rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _adapters_reference(_rank: int, _world: int) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """The same run in plain PyTorch: each step's gradient is the mean over the ranks' slices."""
    model = _peft_model()
    opt = torch.optim.AdamW(_adapter_params(model), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(len(ADAPTERS)):
        model.set_adapter(ADAPTERS[step])
        grads: dict[str, torch.Tensor] = {}
        total = 0.0
        for rank in range(WORLD):
            ids = _tokens(step, rank)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            total += loss.item() / WORLD
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] = grads.get(n, 0) + p.grad
            model.zero_grad()
        for n, p in model.named_parameters():
            p.grad = grads[n] / WORLD if n in grads else None
        opt.step()
        opt.zero_grad()
        losses.append(total)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}, trainable


def _adapters_zero(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    model = _peft_model()
    engine = ZeroEngine(model)
    opt = engine.shard_optimizer(torch.optim.AdamW(_adapter_params(model), lr=1e-2, weight_decay=0.1))
    losses = []
    for step in range(len(ADAPTERS)):
        loss = torch.tensor(_adapter_step(model, opt, step, rank))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    return losses, weights, trainable


def test_switching_peft_adapters_matches_the_run_without_the_strategy() -> None:
    """A tiny Llama with two LoRA adapters, trained by one AdamW over both: ``set_adapter``
    switches which one trains (a, then b, then a again). Adapter b, frozen when the model is
    partitioned, is stepped once it trains, adapter a keeps its optimizer state while b trains, and
    the losses and adapter weights match plain PyTorch's."""
    got = run_distributed(_adapters_zero, WORLD)
    want = run_distributed(_adapters_reference, 1, init_pg=False)[0]
    before = {n: p.detach() for n, p in _peft_model().named_parameters() if ".lora_" in n}
    for mine in got:
        assert mine[2] == want[2]
        assert mine[0] == pytest.approx(want[0], rel=1e-5)
        for name, ref in want[1].items():
            torch.testing.assert_close(mine[1][name], ref, rtol=1e-5, atol=1e-6)
    for adapter in "ab":  # both adapters trained
        changed = [n for n in before if f".{adapter}." in n and not torch.equal(before[n], want[1][n])]
        assert changed, adapter


# --- memory -------------------------------------------------------------------------------------------
def _mlp_step(model, opt, step: int, rank: int, world: int) -> None:
    x, y = models.make_batch("mlp", step, BATCH)
    models.loss_fn(model, _slice(x, rank, world), _slice(y, rank, world)).backward()
    opt.step()


def _memory(rank: int, world: int) -> dict:
    model = models.MLP(frozen=True)  # fc1 frozen when partitioned: no master, no gradient shard
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=0))  # a group per layer, as sized by hand
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    fc1, fc2 = (next(g for g in engine.groups if g.names[0] == f"{m}.weight") for m in ("fc1", "fc2"))
    seen = {}

    def measure(label: str) -> None:
        memory = engine.memory()
        seen[label] = {"grads": memory["grad_shards"][0], "optimizer": memory["optimizer"][0]}

    _mlp_step(model, opt, 0, rank, world)
    measure("fc2 and fc3 train")
    opt.zero_grad()
    model.fc2.requires_grad_(False)  # frozen again
    moments = [{k: v.clone() for k, v in opt.state[f].items()} for f in fc2.fragments]
    _mlp_step(model, opt, 1, rank, world)
    measure("fc3 trains")
    seen["fc2 holds a gradient shard"] = fc2.grad_shard is not None
    seen["fc2 state kept"] = all(torch.equal(before[k], opt.state[f][k]) for f, before in zip(fc2.fragments, moments)
                                 for k in before)
    opt.zero_grad()
    model.fc1.requires_grad_(True)  # unfrozen into a param group of its own, as BaseFinetuning does
    opt.add_param_group({"params": list(model.fc1.parameters()), "lr": 1e-3})
    _mlp_step(model, opt, 2, rank, world)
    measure("fc1 and fc3 train")
    seen["fc1 owned"] = sum(f.numel() for f in fc1.fragments)
    return seen


def test_frozen_again_drops_gradients_and_unfreezing_adds_only_its_state() -> None:
    """Counted by the engine's ledger on each of 2 ranks: a group frozen again (fc2) holds no
    gradient shard from its next step on, and keeps its AdamW moments untouched, as torch keeps a
    frozen parameter's state; a group frozen since partitioning (fc1) that is unfrozen and added
    with ``add_param_group`` adds exactly its gradient shard and its AdamW moments, nothing else
    (in fp32 its master is its shard).
    Sizes by hand: fc1 is 16*48+48 = 816 elements, a shard of 416 (408 rounded up to 16) per rank;
    fc2 is 48*48+48 = 2352 elements, 1184 per rank."""
    for rank, seen in enumerate(run_distributed(_memory, WORLD)):
        both, fc3, fc1_fc3 = seen["fc2 and fc3 train"], seen["fc3 trains"], seen["fc1 and fc3 train"]
        assert both["grads"] - fc3["grads"] == 1184 * 4
        assert not seen["fc2 holds a gradient shard"]
        assert seen["fc2 state kept"] and fc3["optimizer"] == both["optimizer"]
        assert seen["fc1 owned"] == [416, 400][rank]
        assert fc1_fc3["grads"] - fc3["grads"] == 416 * 4
        # exp_avg and exp_avg_sq of its owned elements, and AdamW's fp32 step count per parameter
        assert fc1_fc3["optimizer"] - fc3["optimizer"] == 2 * seen["fc1 owned"] * 4 + 2 * 4


# --- errors ---------------------------------------------------------------------------------------
def _diverging(rank: int, world: int, case: str, path: str) -> str:
    # "... late": the change comes after three steps, when the pass start's checks travel with its
    # meeting in one exchange (the first steps record the trace and write the pass's script).
    warm = 3 if case.endswith(" late") else 1
    case = case.removesuffix(" late")
    model = models.MLP(frozen=True)
    offload = OffloadConfig(optimizer="nvme", nvme_path=path) if case.startswith("nvme") else OffloadConfig()
    engine = ZeroEngine(model, zero_pp=ZeroPPConfig(frozen_bits=8 if case == "codes" else None), offload=offload)
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    for step in range(warm):
        _mlp_step(model, opt, step, rank, world)
        opt.zero_grad()
    if case == "flags" and rank == 1:
        model.fc2.weight.requires_grad_(False)
    elif case in ("codes", "nvme"):
        model.fc1.requires_grad_(True)
    elif case == "nvme adding":
        try:
            opt.add_param_group({"params": [model.fc1.weight]})
        except RuntimeError as error:
            return str(error)
    elif case == "groups" and rank == 0:
        opt.add_param_group({"params": [model.fc1.weight]})
    elif case == "foreign":
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        except ValueError as error:
            return str(error)
    try:
        _mlp_step(model, opt, warm, rank, world)
    except RuntimeError as error:
        message = str(error)
    else:
        return "no error"
    if case in ("codes", "nvme"):  # nothing was changed: frozen again, training goes on
        model.fc1.requires_grad_(False)
        opt.zero_grad()
        _mlp_step(model, opt, warm, rank, world)
    return message


@pytest.mark.parametrize("case, expected", [
    ("flags", "parameter 'fc2.weight' requires a gradient on rank(s) [0] but not on rank(s) [1]"),
    ("flags late", "parameter 'fc2.weight' requires a gradient on rank(s) [0] but not on rank(s) [1]"),
    ("groups", "their sharded optimizers hold different param groups"),
    ("groups late", "their sharded optimizers hold different param groups"),
    ("codes", "Parameter 'fc1.weight' was frozen when the model was partitioned and cannot be unfrozen: its group "
              "is stored as INT8 codes (ZeroPPConfig.frozen_bits)"),
    ("foreign", "holds a tensor of shape (3,) that is not a parameter of the partitioned model"),
    ("nvme", "Parameter 'fc1.weight' was frozen when the model was partitioned and cannot be unfrozen: the NVMe "
             "optimizer offload planned its swap files"),
    ("nvme adding", "AdamW.add_param_group on a sharded optimizer: not supported with OffloadConfig(optimizer='nvme')"),
])
def test_unsupported_or_diverging_changes_raise_on_every_rank(case: str, expected: str, tmp_path) -> None:
    """Ranks that change ``requires_grad`` differently, or add different param groups, end with an
    error naming the first difference on every rank, at the next pass (before any collective
    depends on it), not a hang or wrong data; unfreezing weights stored as INT8 codes is refused on
    every rank, naming the parameter and the fix, and changes nothing (re-frozen, training goes
    on); so is unfreezing one that was frozen when partitioned under NVMe optimizer offload, and
    ``add_param_group`` there; ``add_param_group`` refuses a tensor that is not the model's."""
    for message in run_distributed(_diverging, WORLD, case, str(tmp_path), timeout=120.0):
        assert expected in message, message


# --- checkpoints across freezing and unfreezing --------------------------------------------------
# fc1 is frozen when the model is built and trained at the steps listed, with a param group of its own.
FC1_TRAINS = [False, True, False, True]


def _fc1_step(model, opt, step: int, rank: int, world: int) -> float:
    """One step of a run where fc1 (in its own param group) trains at the steps of FC1_TRAINS;
    on ``world`` ranks, or by hand on one (the slices' gradients summed, then halved, as the
    reduce-scatter does)."""
    model.fc1.requires_grad_(FC1_TRAINS[step])
    x, y = models.make_batch("mlp", step, BATCH)
    slices = [rank] if world > 1 else range(WORLD)
    grads: dict[str, torch.Tensor] = {}
    total = 0.0
    for r in slices:
        loss = models.loss_fn(model, _slice(x, r, WORLD), _slice(y, r, WORLD))
        loss.backward()
        total += loss.item() / WORLD
        if world == 1:
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] = grads.get(n, 0) + p.grad
                p.grad = None
    if world == 1:
        for n, p in model.named_parameters():
            p.grad = grads[n] / WORLD if n in grads else None
    opt.step()
    opt.zero_grad()
    return total


def _fc1_optimizer(model, build) -> torch.optim.Optimizer:
    opt = build(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1))
    opt.add_param_group({"params": list(model.fc1.parameters()), "lr": 1e-3})  # frozen for now
    return opt


def _fc1_reference(_rank: int, _world: int) -> tuple[dict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = models.MLP(frozen=True)
    opt = _fc1_optimizer(model, lambda o: o)
    for step in range(3):
        _fc1_step(model, opt, step, 0, 1)
    saved = copy.deepcopy(opt.state_dict())
    _fc1_step(model, opt, 3, 0, 1)
    return saved, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fc1_resumed(rank: int, world: int, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    def run() -> tuple[torch.nn.Module, ZeroEngine, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = models.MLP(frozen=True)
        engine = ZeroEngine(model)
        return model, engine, _fc1_optimizer(model, engine.shard_optimizer)

    model, engine, opt = run()
    for step in range(3):  # fc1 trained at step 1, frozen again at step 2: it keeps its AdamW state
        _fc1_step(model, opt, step, rank, world)
    saved = full_optimizer_state_dict(engine, opt)
    save_sharded(engine, [opt], path, {})
    model, engine, opt = run()  # built again with fc1 frozen: no master, placeholders in the optimizer
    load_sharded(engine, [opt], path)
    _fc1_step(model, opt, 3, rank, world)
    with engine.gathered():
        return saved, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoints_after_unfreezing_number_and_resume_as_plain_torch(tmp_path) -> None:
    """fc1, frozen when the model is partitioned and added to the sharded AdamW with
    ``add_param_group``, trains one step and is frozen again: the full (plain) optimizer state dict
    numbers and holds its state as plain torch's ``state_dict()`` does, and a sharded checkpoint
    loaded into the model built again (fc1 frozen, without master) restores that state, so the
    step that unfreezes it again lands where plain torch does."""
    got = run_distributed(_fc1_resumed, WORLD, str(tmp_path / "ckpt"))
    want_state, want_weights = run_distributed(_fc1_reference, 1, init_pg=False)[0]
    state = got[0][0]
    assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in want_state["param_groups"]]
    assert sorted(state["state"]) == sorted(want_state["state"]) == [0, 1, 2, 3, 4, 5]
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-7)
    for _, weights in got:
        for name, ref in want_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6)


def _fc1_fabric(rank: int, world: int) -> dict[str, torch.Tensor]:
    fabric = LF.Fabric(strategy="zero_infinity", accelerator="cpu", devices=world)
    fabric.launch()
    torch.manual_seed(0)
    model = models.MLP(frozen=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    # Through Fabric's wrapper, which runs torch's own add_param_group on the sharded optimizer's groups.
    opt.add_param_group({"params": list(model.fc1.parameters()), "lr": 1e-3})
    for step in range(len(FC1_TRAINS)):
        _fc1_step(model, opt, step, rank, world)
    with model.module._zinf_engine.gathered():
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_a_param_group_added_through_fabrics_optimizer_wrapper_trains_as_plain_torch() -> None:
    """Fabric's optimizer wrapper does not reach the sharded optimizer's own ``add_param_group``:
    the param group of the model's parameters it adds is re-pointed at the next training step, and
    fc1 (frozen, then trained, frozen again, trained again) lands where plain torch's does."""
    want = run_distributed(_fc1_reference, 1, init_pg=False)[0][1]
    for weights in run_distributed(_fc1_fabric, WORLD, init_pg=False):
        for name, ref in want.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6)
