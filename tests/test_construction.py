"""Partitioned construction keeps every value ``__init__`` gives (issue 38, deliverable 1).

A model built inside ``meta_parameters()`` (what ``fabric.init_module()`` and ``configure_model``
enter) ends with exactly the values the same model built eagerly gets from the same seed, however
its ``__init__`` sets them; on several ranks, rank 0's values (what DDP broadcasts), whatever each
rank's own seed. The references are plain PyTorch: the eager model, its generator state, and
single-process training. The model shapes are those of DeepSpeed's ZeRO-3 construction tests
(``zero.Init``): a parent that initialises its children with ``self.apply``, parameters filled in
place in modules without ``reset_parameters()``, ``.data`` edits along a class hierarchy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_zinf import PrefetchConfig, TilingConfig, ZeroEngine, meta_parameters
from lightning_zinf.engine.construction import NotReproducible
from tests.harness import run_distributed

#: Built before construction, as a pretrained tensor a model copies in.
PRETRAINED = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7


class GrandPa(nn.Module):
    """DeepSpeed's class-hierarchy test: each level edits its own and its ancestors' parameters
    through ``.data`` after ``super().__init__()``."""

    def __init__(self) -> None:
        super().__init__()
        self.param_grandpa = nn.Parameter(torch.ones(5))
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Pa(GrandPa):
    def __init__(self) -> None:
        super().__init__()
        self.param_pa = nn.Parameter(torch.ones(5))
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Son(Pa):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(5))
        self.param.data = (self.param.data + 1).data
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class NoReset(nn.Module):
    """Values set in ``__init__`` only: no ``reset_parameters()``; a random buffer between them."""

    def __init__(self) -> None:
        super().__init__()
        self.filled = nn.Parameter(torch.empty(3, 4))
        self.filled.data.fill_(2.0)
        self.register_buffer("noise", torch.randn(4))
        self.drawn = nn.Parameter(torch.empty(4, 4))
        nn.init.normal_(self.drawn, std=0.5)
        self.scaled = nn.Parameter(torch.randn(4, 4) * 0.02)
        self.copied = nn.Parameter(torch.empty(3, 4))
        with torch.no_grad():
            self.copied.copy_(PRETRAINED)
            self.copied[0].zero_()


class DeepSpeedStyle(nn.Module):
    """A parent that builds its children, then initialises every Linear itself
    (DeepSpeed's ``TestZero3InitForParentWeightInitialization``), with an orthogonal init, an
    embedding's padding row, tied weights and the modules above."""

    def __init__(self, depth: int = 2, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width, padding_idx=0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.gate = nn.Linear(width, width, bias=False)
        nn.init.orthogonal_(self.gate.weight)
        self.extra = NoReset()
        self.son = Son()
        self.head = nn.Linear(width, 16, bias=False)
        self.head.weight = self.embed.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module is not self.gate and module is not self.head:
            nn.init.trunc_normal_(module.weight, std=0.1)
            nn.init.constant_(module.bias, 0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
        h = self.gate(h) * self.son.param.sum() + self.extra.filled.sum() + self.extra.drawn.sum()
        h = h + (self.extra.scaled.sum() + self.extra.copied.sum() + self.son.param_pa.sum() + self.son.param_grandpa.sum())
        return self.head(h)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_values_and_random_stream_are_eagers() -> None:
    """Every parameter equals the eager model's bit for bit, the random buffer too, and the
    generator is where eager construction leaves it, after construction and after setup."""
    torch.manual_seed(0)
    eager = DeepSpeedStyle()
    stream = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_parameters():
        model = DeepSpeedStyle()
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), stream)
    assert torch.equal(model.extra.noise, eager.extra.noise)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    assert torch.equal(torch.get_rng_state(), stream)
    assert model.head.weight is model.embed.weight
    with engine.gathered():
        got = _values(model)
    want = _values(eager)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert torch.equal(got["son.param_grandpa"], torch.full((5,), 4.0))  # DeepSpeed's expected value


class DataAssignments(nn.Module):
    """``.data`` given tensors made in ``__init__`` (a literal, ``torch.eye``, numpy), parameters
    mixed with ordinary tensors out of place, and a real tensor written from a parameter: the
    patterns a new user's model tried (construction once failed on them with torch's device or
    tensor-type errors)."""

    def __init__(self) -> None:
        super().__init__()
        self.filled = nn.Parameter(torch.ones(4))
        self.filled.data = torch.full((4,), 1.5)
        self.shifted = nn.Parameter(torch.randn(4))
        self.shifted.data = self.shifted.data + torch.arange(4.0)
        self.masked = nn.Parameter(torch.randn(4))
        self.masked.data = torch.where(torch.tensor([True, False, True, False]), self.masked.data, 0.0)
        self.eye = nn.Parameter(torch.empty(8, 8))
        self.eye.data = torch.eye(8)
        self.from_numpy = nn.Parameter(torch.zeros(3))
        self.from_numpy.data = torch.from_numpy(np.arange(3, dtype=np.float32))
        self.register_buffer("doubled", torch.zeros(4))
        self.doubled.copy_(self.shifted.data * 2)  # a real buffer written from a recorded parameter
        self.from_buffer = nn.Parameter(self.doubled.clone())


def test_data_assignments_and_mixed_operands_are_eagers() -> None:
    torch.manual_seed(2)
    eager = DataAssignments()
    torch.manual_seed(2)
    with meta_parameters():
        model = DataAssignments()
    assert torch.equal(model.doubled, eager.doubled)
    engine = ZeroEngine(model)
    with engine.gathered():
        got = _values(model)
    for name, value in _values(eager).items():
        assert torch.equal(got[name], value), name


def test_initialisation_after_construction_before_setup_is_kept() -> None:
    """An init applied after the context, before setup, on the meta parameters (FSDP's meta-device
    recipe: build, then ``reset_parameters()``; LitGPT's pretraining does so) is recorded too."""

    def reinit(model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                module.reset_parameters = lambda m=module: nn.init.normal_(m.weight, std=0.3)  # type: ignore[method-assign]
        model.layers[0].reset_parameters()

    torch.manual_seed(3)
    eager = DeepSpeedStyle()
    reinit(eager)
    torch.manual_seed(3)
    with meta_parameters():
        model = DeepSpeedStyle()
    reinit(model)
    engine = ZeroEngine(model)
    with engine.gathered():
        got = _values(model)
    for name, value in _values(eager).items():
        assert torch.equal(got[name], value), name


def test_tiled_layer_gets_its_slices_of_the_recorded_values() -> None:
    """A Linear built with a model's own init and tiled at setup: each tile is its slice of the
    weight eager construction gives (tiles once got a fresh kaiming init instead)."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 48)
            nn.init.normal_(self.proj.weight, std=0.02)
            self.out = nn.Linear(48, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.proj(x))

    torch.manual_seed(5)
    eager = Wide()
    torch.manual_seed(5)
    with meta_parameters():
        model = Wide()
    engine = ZeroEngine(model, tiling=TilingConfig(tile_numel=300, min_numel=1000))
    assert engine.tiled_layers == ["proj"]
    with engine.gathered():
        weight, bias = model.proj.full_weight(), model.proj.tile_bias.bias.detach().clone()
        out_weight = model.out.weight.detach().clone()
    assert torch.equal(weight, eager.proj.weight.detach())
    assert torch.equal(bias, eager.proj.bias.detach())
    assert torch.equal(out_weight, eager.out.weight.detach())


def test_tensor_changed_after_a_parameter_was_built_from_it_is_refused_by_name() -> None:
    """A tensor from outside construction read into a parameter, then changed in place before
    setup: the value eager construction saw is gone, so setup refuses, naming the parameter."""
    source = torch.ones(4)

    class Copies(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))
            with torch.no_grad():
                self.w.copy_(source)

    with meta_parameters():
        model = Copies()
    source.add_(1)
    with pytest.raises(NotReproducible, match=r"Parameter 'w': it was built from a tensor made outside construction"):
        ZeroEngine(model)


def _fabric_train(rank: int, world: int, steps: int) -> dict:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy="zero_infinity")
    fabric.launch()
    torch.manual_seed(100 + rank)  # every rank its own seed: rank 0's construction is what counts
    with fabric.init_module():
        model = DeepSpeedStyle()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    with fabric.strategy.gathered_parameters():
        initial = _values(model.module)
    for step in range(steps):
        tokens = _tokens(step)[rank::world]
        loss = model(tokens).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    with fabric.strategy.gathered_parameters():
        final = _values(model.module)
    return {"initial": initial, "final": final}


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step))


def test_fabric_init_module_on_two_ranks_builds_rank0s_model_and_trains_as_plain_torch() -> None:
    """Inside ``fabric.init_module()`` on two ranks seeded differently: both hold rank 0's eager
    model, and three Adam steps on the two ranks' halves of each batch give single-process
    PyTorch's parameters on the whole batch (DeepSpeed's construction tests, then training)."""
    ranks = run_distributed(_fabric_train, 2, 3, init_pg=False)
    torch.manual_seed(100)
    eager = DeepSpeedStyle()
    want_initial = _values(eager)
    optimizer = torch.optim.Adam(eager.parameters(), lr=1e-2)
    for step in range(3):
        tokens = _tokens(step)
        # The mean over ranks of each rank's mean over its half: the whole batch's mean here.
        loss = torch.stack([eager(tokens[r::2]).square().mean() for r in range(2)]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in ranks:
        for name, value in want_initial.items():
            assert torch.equal(result["initial"][name], value), name
        for name, value in _values(eager).items():
            torch.testing.assert_close(result["final"][name], value, rtol=1e-5, atol=1e-6, msg=name)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    from lightning_zinf import ZeroEngine, meta_parameters

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    def peak_since_reset():
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(512, 1024)
            self.b = nn.Linear(1024, 512)
            nn.init.normal_(self.a.weight, std=0.02)

    class Deep(nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)

    depth, eager = int(sys.argv[1]), sys.argv[2] == "eager"
    torch.manual_seed(0)
    with meta_parameters():
        Deep(1)  # the first construction's one-off costs out of the way
    before = resident()
    reset_peak()
    if eager:
        model = Deep(depth)
    else:
        with meta_parameters():
            model = Deep(depth)
    construction = peak_since_reset() - before
    reset_peak()
    engine = ZeroEngine(model, block_classes=["Block"])
    setup = peak_since_reset() - before - engine.resident_bytes()["device"]
    print(json.dumps({"construction": construction, "setup_over_shards": setup}))
""")


def test_construction_and_setup_memory_is_flat_in_depth(tmp_path: Path) -> None:
    """Peak resident memory as the kernel counts it (VmHWM, reset before each phase) in a fresh
    process: partitioned construction adds well under one 4 MiB block whatever the depth (eager
    construction adds every block), and setup holds the shards plus about two blocks (the unit
    being rebuilt and its flat copy), 4 blocks deep as 16. glibc is told to return freed large
    buffers at once (a fixed mmap threshold): by default it keeps them in its heap, which shows
    memory no one holds."""
    script = tmp_path / "memory.py"
    script.write_text(_MEMORY_SCRIPT)
    block = 4 * (2 * 512 * 1024 + 1024 + 512)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "MALLOC_MMAP_THRESHOLD_": "131072"}

    def measure(depth: int, how: str) -> dict[str, int]:
        out = subprocess.run([sys.executable, str(script), str(depth), how], capture_output=True, text=True,
                             check=True, cwd=root, env=env, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])

    shallow, deep = measure(4, "meta"), measure(16, "meta")
    assert measure(16, "eager")["construction"] > 15 * block  # the observer sees what construction holds
    for measured in (shallow, deep):
        assert measured["construction"] < block, measured
        assert measured["setup_over_shards"] < 4 * block, measured
    assert deep["setup_over_shards"] - shallow["setup_over_shards"] < block
