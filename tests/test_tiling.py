"""Memory-centric tiling: TiledLinear against nn.Linear, the tiling transform, and tiled layers under
the engine (training, one tile gathered at a time, checkpoints that move between tilings)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zinf import OffloadConfig, PrefetchConfig, TiledLinear, TilingConfig, ZeroEngine, load_full_state_dict, tile_linear_layers
from lightning_zinf.checkpoint import save_sharded
from lightning_zinf.consolidate import consolidate
from lightning_zinf.tiling import tile_splits
from tests.harness import run_distributed

IN, OUT = 19, 23  # primes: no split count divides them


def _grads(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    weight = layer.weight.grad if isinstance(layer, nn.Linear) else torch.cat(
        [torch.cat([t.weight.grad for t in layer.tiles[i * layer.in_splits:(i + 1) * layer.in_splits]], 1)
         for i in range(layer.out_splits)])
    bias = layer.bias.grad if layer.bias is not None else torch.zeros(())
    return y, x.grad, weight, bias


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (1, 3), (4, 1), (3, 5), (7, 2), (IN, OUT)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, IN), (2, 3, IN)], ids=["2d", "3d"])
def test_forward_backward_match_linear_float64(in_splits: int, out_splits: int, bias: bool, shape: tuple) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT, bias=bias, dtype=torch.float64)
    tiled = TiledLinear.from_linear(linear, in_splits=in_splits, out_splits=out_splits)
    x = torch.randn(shape, dtype=torch.float64)
    for got, want in zip(_grads(tiled, x), _grads(linear, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert all(t.weight.numel() == (t.rows[1] - t.rows[0]) * (t.cols[1] - t.cols[0]) for t in tiled.tiles)
    assert sum(t.weight.numel() for t in tiled.tiles) == IN * OUT


@pytest.mark.parametrize("in_splits, out_splits", [(1, 4), (3, 2), (5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_same_initialisation_as_linear(in_splits: int, out_splits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    linear = nn.Linear(IN, OUT, dtype=dtype)
    after_linear = torch.rand(4)
    torch.manual_seed(7)
    tiled = TiledLinear(IN, OUT, in_splits=in_splits, out_splits=out_splits, dtype=dtype)
    after_tiled = torch.rand(4)
    assert torch.equal(tiled.full_weight(), linear.weight.detach())
    assert torch.equal(tiled.bias.detach(), linear.bias.detach())
    assert torch.equal(after_tiled, after_linear)  # the random stream continues where nn.Linear leaves it
    torch.manual_seed(7)
    tiled.reset_parameters()
    assert torch.equal(tiled.full_weight(), linear.weight.detach())


def test_state_dict_round_trip_tiled_and_untiled() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT)
    tiled = TiledLinear(IN, OUT, in_splits=3, out_splits=4)
    assert list(tiled.state_dict()) == ["weight", "bias"]
    tiled.load_state_dict(linear.state_dict())  # untiled -> tiled, strict
    x = torch.randn(6, IN)
    assert torch.equal(tiled.full_weight(), linear.weight.detach())
    back = nn.Linear(IN, OUT)
    back.load_state_dict(tiled.state_dict())  # tiled -> untiled, strict
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias)
    other = TiledLinear(IN, OUT, in_splits=1, out_splits=2)
    other.load_state_dict(tiled.state_dict())  # one tiling -> another
    torch.testing.assert_close(other(x), linear(x), rtol=1e-6, atol=1e-6)
    nested = nn.Sequential(nn.Linear(IN, IN), TiledLinear(IN, OUT, bias=False, out_splits=3))
    flat = nn.Sequential(nn.Linear(IN, IN), nn.Linear(IN, OUT, bias=False))
    assert list(nested.state_dict()) == list(flat.state_dict())
    nested.load_state_dict(flat.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch"):
        tiled.load_state_dict(nn.Linear(IN, OUT + 1).state_dict())


def test_bad_splits_are_rejected() -> None:
    with pytest.raises(ValueError, match="in_splits=0 is invalid"):
        TiledLinear(IN, OUT, in_splits=0)
    with pytest.raises(ValueError, match=r"out_splits=24 is invalid.*\(23\)"):
        TiledLinear(IN, OUT, out_splits=24)
    with pytest.raises(ValueError, match="tile_numel=0 is invalid"):
        TilingConfig(tile_numel=0)


@pytest.mark.parametrize("in_features, out_features, budget", [(64, 100, 640), (64, 100, 1000), (300, 7, 100), (5, 5, 25)])
def test_tile_splits_respect_the_budget(in_features: int, out_features: int, budget: int) -> None:
    in_splits, out_splits = tile_splits(in_features, out_features, budget)
    layer = TiledLinear(in_features, out_features, in_splits=in_splits, out_splits=out_splits, device="meta")
    assert max(t.weight.numel() for t in layer.tiles) <= budget
    if in_features <= budget:  # whole rows, and one row block fewer would not fit
        assert in_splits == 1
        assert out_splits == 1 or -(-out_features // (out_splits - 1)) * in_features > budget
    else:
        assert out_splits == out_features


class _Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.big = nn.Linear(32, 40)
        self.attn = nn.MultiheadAttention(32, 2)  # its out_proj is a Linear subclass it reads directly
        self.emb = nn.Embedding(40, 32)
        self.head = nn.Linear(32, 40, bias=False)
        self.head.weight = self.emb.weight
        self.again = self.big  # the same layer registered twice


def test_transform_replaces_large_linears_only() -> None:
    torch.manual_seed(0)
    model = _Zoo()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="'head' shares a parameter"):
        replaced = tile_linear_layers(model, TilingConfig(tile_numel=300))
    assert replaced == ["big"]
    assert isinstance(model.big, TiledLinear) and model.again is model.big
    assert type(model.small) is nn.Linear and type(model.head) is nn.Linear
    assert max(t.weight.numel() for t in model.big.tiles) <= 300
    after = model.state_dict()  # the same names and values: the tiles are the layer, cut up
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tile_linear_layers(nn.Sequential(nn.Linear(8, 8)), TilingConfig(tile_numel=10, min_numel=100)) == []
    with pytest.raises(ValueError, match="wrap it"):
        tile_linear_layers(nn.Linear(8, 8), TilingConfig(tile_numel=10))


def test_an_absurd_tiling_is_refused_with_the_numbers() -> None:
    """``tile_numel=1`` cut each weight element into a tile of its own (12,288 units for a small
    model, and minutes of setup without a word): refused before any layer is replaced, naming the
    layer, its shape, the tiles it would get, the bound and the smallest tile_numel within it."""
    model = nn.Sequential(nn.Linear(1024, 12), nn.Linear(64, 64))
    with pytest.raises(ValueError) as refused:
        tile_linear_layers(model, TilingConfig(tile_numel=1, min_numel=0))
    message = str(refused.value)
    assert "TilingConfig(tile_numel=1, min_numel=0) would cut layer '0' (nn.Linear(1024, 12): weight (12, 1024), " \
           "12,288 elements) into 12,288 tiles of at most 1 element; a layer may have at most 1024 tiles" in message
    assert "(1 more layer also exceeds it)" in message  # '1': 4096 tiles
    # 13 is the smallest tile that cuts the layer into at most 1024 tiles: 12 rows x ceil(1024 / 13) = 948.
    assert "Set tile_numel to at least 13" in message and "min_numel to at least 12_288" in message
    assert tile_splits(1024, 12, 13)[0] * 12 <= 1024 < tile_splits(1024, 12, 12)[0] * 12
    assert all(type(layer) is nn.Linear for layer in model)  # nothing replaced
    # In total: 80 layers of 1024 tiles each (each within the per-layer bound).
    many = nn.Sequential(*[nn.Linear(256, 256, device="meta") for _ in range(80)])
    with pytest.raises(ValueError, match=r"would cut 80 layers into 81,920 tiles in all .* at most 65,536 tiles.*"
                                         r"Set tile_numel to at least 86"):
        tile_linear_layers(many, TilingConfig(tile_numel=64))
    tiles = {t: 80 * tile_splits(256, 256, t)[0] * 256 for t in (85, 86)}
    assert tiles[85] > 65_536 >= tiles[86]  # the smallest within the bound


def test_an_absurd_tiling_is_refused_by_the_engine_at_once() -> None:
    model = nn.Sequential(nn.Linear(1024, 12), nn.Tanh(), nn.Linear(12, 4))
    start = time.monotonic()
    with pytest.raises(ValueError, match="would cut layer '0'.*into 12,288 tiles"):
        ZeroEngine(model, tiling=TilingConfig(tile_numel=1, min_numel=0))
    assert time.monotonic() - start < 5


def test_transform_on_meta_draws_nothing() -> None:
    model = nn.Sequential(nn.Linear(16, 16, device="meta"), nn.Linear(16, 32, device="meta"))
    state = torch.get_rng_state()
    tile_linear_layers(model, TilingConfig(tile_numel=100))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.is_meta for p in model.parameters()) and isinstance(model[1], TiledLinear)


# --- under the engine -----------------------------------------------------------------------------
class Net(nn.Module):
    """Two large layers and an output layer; ``tiled=True`` builds the output layer as a TiledLinear
    with column splits (the other two are tiled by the engine's ``tiling`` option)."""

    def __init__(self, tiled: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mid = nn.Linear(64, 64)
        self.out = TiledLinear(64, 8, in_splits=3, out_splits=2) if tiled else nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


TILING = TilingConfig(tile_numel=300, min_numel=500)  # inp (1024) -> 4 tiles, mid (4096) -> 16 tiles
STEPS, BATCH = 5, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = (t[rank::world] for t in _batch(step))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net(tiled=False)
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 0, 1)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _tiled_rank(rank: int, world: int, prefetch: bool, nvme: str | None, ckpt: str) -> dict:
    torch.manual_seed(0)
    offload = OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme) if nvme else OffloadConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in Net is tied: no layer may be skipped
        model = Net(tiled=True)
        engine = ZeroEngine(model, tiling=TILING, offload=offload,
                            prefetch=PrefetchConfig(enabled=prefetch, persistence_threshold=0, bucket_size=1))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = _train(model, opt, rank, world)
    peak = engine.peak_gathered_bytes  # forward and backward of every step
    units = sorted((sum(g.padded_numel * g.full.element_size() for g in u.groups) for u in engine.units), reverse=True)
    save_sharded(engine, [opt], ckpt, {})
    with engine.gathered():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "peak": peak, "largest_units": units[:2], "tiled": engine.tiled_layers,
            "units": [u.name for u in engine.units]}


@pytest.mark.parametrize("prefetch, nvme", [(False, False), (True, False), (True, True)],
                         ids=["on-demand", "prefetch", "prefetch-nvme-offload"])
def test_tiled_model_trains_like_the_untiled_one(tmp_path: Path, prefetch: bool, nvme: bool) -> None:
    ref_losses, ref_state = _reference()
    ranks = run_distributed(_tiled_rank, 2, prefetch, str(tmp_path) if nvme else None, str(tmp_path / "ckpt"))
    got = ranks[0]
    assert got["tiled"] == ["inp", "mid"]
    assert len([n for n in got["units"] if ".tiles." in n]) == 4 + 16 + 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert list(got["state"]) == list(ref_state)  # same names as the untiled model: weight, bias
    for name, value in ref_state.items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-4, atol=1e-5)
    # Working memory holds one tile (on demand), or it and the next one in flight (prefetch).
    largest, second = got["largest_units"]
    if prefetch:
        assert largest < got["peak"] <= largest + second
    else:
        assert got["peak"] == largest

    # The sharded checkpoint consolidates into the untiled model's state dict...
    out = consolidate(tmp_path / "ckpt", tmp_path / "full.safetensors")
    from safetensors.torch import load_file
    plain = Net(tiled=False)
    plain.load_state_dict(load_file(out))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, got["state"][name]), name
    # ...which loads back into a tiled model under the engine, at another world size and tiling.
    loaded = run_distributed(_load_into_tiled, 1, str(out))[0]
    for name, value in plain.state_dict().items():
        assert torch.equal(loaded[name], value), name


def _load_into_tiled(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model = Net(tiled=True)
    engine = ZeroEngine(model, tiling=TilingConfig(tile_numel=700, min_numel=500), prefetch=PrefetchConfig(persistence_threshold=0))
    load_full_state_dict(engine, path)
    with engine.gathered():
        return {k: v.clone() for k, v in model.state_dict().items()}


def test_state_dict_outside_gathered_is_the_untiled_layers() -> None:
    """Outside ``gathered()`` too, a tiled layer saves as ``nn.Linear`` does: one full ``weight``
    (the tiles gathered one at a time), equal to the untiled model's."""
    torch.manual_seed(0)
    plain = Net(tiled=False)
    torch.manual_seed(0)
    model = Net(tiled=True)
    ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    state = model.state_dict()
    assert "out.tiles.0.weight" not in state and list(state) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name
