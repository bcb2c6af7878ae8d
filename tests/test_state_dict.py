"""``model.state_dict()`` and ``model.load_state_dict()`` on a partitioned model behave as on the
plain model, through torch's own traversal (each module's ``_load_from_state_dict`` and hooks).

The reference is the same model unpartitioned in the same process: its ``state_dict()``, its
``load_state_dict()`` result (missing and unexpected keys, error messages) and an SGD step after it.
Memory is observed from outside the engine too: hooks of the test's own on every module add up the
bytes of parameter values attached to the model at each module's turn.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroEngine
from lightning_zinf import state_dict_options
from tests import models
from tests.harness import run_distributed

BF16 = MixedPrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

CASES = {
    # name: (model kind, engine options)
    "modules": ("gpt", {"prefetch": PrefetchConfig(persistence_threshold=0)}),
    "blocks": ("gpt", {"block_classes": ["Block"], "prefetch": PrefetchConfig(persistence_threshold=0)}),
    "persistent": ("gpt", {"prefetch": PrefetchConfig(persistence_threshold=10**9)}),
    "bf16": ("gpt", {"block_classes": ["Block"], "mixed_precision": BF16}),
    "tiled": ("mlp", {"tiling": TilingConfig(tile_numel=512), "prefetch": PrefetchConfig(persistence_threshold=0)}),
    "cpu-offload": ("gpt", {"offload": OffloadConfig(param="cpu", optimizer="cpu"),
                            "prefetch": PrefetchConfig(persistence_threshold=0)}),
    "nvme": ("gpt", {"offload": OffloadConfig(param="nvme", optimizer="nvme", nvme_path=tempfile.gettempdir()),
                     "block_classes": ["Block"]}),
}


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return models.GPT(layers=3) if kind == "gpt" else models.MLP()


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].device.type == "cpu" and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def _sgd_step(model: nn.Module, kind: str) -> None:
    x, y = models.make_batch(kind, 0, 4)
    models.loss_fn(model, x, y).backward()


def _roundtrip(rank: int, world: int, case: str) -> None:
    kind, options = CASES[case]
    plain = _model(kind, 0)
    model = copy.deepcopy(plain)
    engine = ZeroEngine(model, **options)
    first = model.state_dict()
    _assert_same(first, plain.state_dict())
    if kind == "gpt":  # tied, as in the plain model's: one tensor's storage under both names, gathered once
        assert first["head.weight"].data_ptr() == first["wte.weight"].data_ptr()
    # Released again afterwards: the values were copies, the parameters are back to their shards.
    assert all(p.numel() == 0 for u in engine.units if not u.persistent for g in u.groups for p in g.params)

    # Load another model's values: the result is torch's, and the values outlive the next step.
    other = _model(kind, 1).state_dict()
    assert model.load_state_dict(other) == plain.load_state_dict(other)
    _assert_same(model.state_dict(), other)
    lr = 0.0 if case == "bf16" else 0.1  # bf16 compute differs from the fp32 reference by design
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
    reference = torch.optim.SGD(plain.parameters(), lr=lr)
    for net, opt in ((model, optimizer), (plain, reference)):
        _sgd_step(net, kind)
        opt.step()
        opt.zero_grad()
    want = plain.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    if case == "bf16":
        _assert_same(got, other)  # the fp32 masters took the loaded values exactly


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_and_load_state_dict_match_the_plain_model(case: str) -> None:
    """Every key and value of ``state_dict()`` is the plain model's, on the CPU, full size (blocks,
    persistent units, a bf16 policy's exact fp32 values, tiles merged back into ``weight``);
    ``load_state_dict`` of another model's values returns torch's result, and those values are
    what the next training step starts from (they were once lost at the next step)."""
    run_distributed(_roundtrip, 2, case)


class _Remapped(nn.Module):
    """LitGPT's LoRA pattern: the layer keeps its weight in ``self.linear`` and maps a plain
    checkpoint's ``weight``/``bias`` there in its own ``_load_from_state_dict``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _remapping(rank: int, world: int) -> None:
    torch.manual_seed(0)
    plain = models.MLP()
    source = {k: v.clone() for k, v in plain.state_dict().items()}
    torch.manual_seed(1)
    model = models.MLP()
    model.fc2 = _Remapped(48, 48)
    ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    result = model.load_state_dict(source)
    assert result.missing_keys == [] and result.unexpected_keys == []
    got = model.state_dict()
    assert torch.equal(got["fc2.linear.weight"], source["fc2.weight"])
    assert torch.equal(got["fc1.weight"], source["fc1.weight"])
    x = torch.randn(4, 16)
    torch.testing.assert_close(model(x), plain(x))


def test_load_state_dict_goes_through_the_modules_own_key_remapping() -> None:
    """A module that renames keys in its own ``_load_from_state_dict`` (LitGPT's LoRA layers)
    receives the plain checkpoint's values: nothing is dropped, the forward is the source model's."""
    run_distributed(_remapping, 2)


def _errors(rank: int, world: int) -> None:
    plain = _model("mlp", 0)
    model = copy.deepcopy(plain)
    ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    partial = {k: v for k, v in _model("mlp", 1).state_dict().items() if not k.startswith("fc3")}
    partial["extra.weight"] = torch.zeros(2)
    assert model.load_state_dict(partial, strict=False) == plain.load_state_dict(partial, strict=False)
    _assert_same(model.state_dict(), plain.state_dict())
    messages = []
    for net in (model, plain):
        with pytest.raises(RuntimeError) as error:
            net.load_state_dict(partial)
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "Missing key(s)" in messages[0]
    wrong = dict(plain.state_dict(), **{"fc1.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match=r"size mismatch for fc1.weight: .*torch.Size\(\[3, 3\]\).*"
                                           r"torch.Size\(\[48, 16\]\)"):
        model.load_state_dict(wrong)
    with pytest.raises(RuntimeError, match="assign=True"):
        model.load_state_dict(plain.state_dict(), assign=True)
    _assert_same(model.state_dict(), plain.state_dict())
    with state_dict_options(model, rank0_only=True):
        only = model.state_dict()
    assert list(only) == (list(plain.state_dict()) if rank == 0 else [])
    keep = model.state_dict(keep_vars=True)
    assert all(v.numel() > 0 for v in keep.values())
    # What a sharded checkpoint keeps beside its shard files gathers nothing.
    engine = model._zinf_engine
    before = engine.collectives_issued
    with state_dict_options(model, parameters=False):
        assert list(model.state_dict()) == []
    assert engine.collectives_issued == before


def test_strict_errors_partial_loads_and_options_are_torchs() -> None:
    """``strict=False`` returns the plain model's missing and unexpected keys and loads the rest;
    ``strict=True`` raises torch's message; a wrong shape names the full shapes (never
    ``torch.Size([0])``); ``assign=True`` is refused; with ``rank0_only`` the other ranks get no
    parameters; ``keep_vars=True`` returns full values; ``parameters=False`` gathers nothing."""
    run_distributed(_errors, 2)


def _memory(rank: int, world: int) -> dict[str, int]:
    model = models.GPT(layers=4, d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0))
    seen = {"save": 0, "load": 0}

    def attached() -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        return sum(storages.values())

    def on_save(*_: object) -> None:
        seen["save"] = max(seen["save"], attached())

    def on_load(*_: object) -> None:
        seen["load"] = max(seen["load"], attached())

    for module in model.modules():  # after the engine's hooks: they see its gathers
        module.register_state_dict_pre_hook(on_save)
        module.register_load_state_dict_pre_hook(on_load)
        module.register_load_state_dict_post_hook(on_load)
    engine.reset_memory_peaks()
    state = model.state_dict()
    save_peak = engine.memory()["gathered"][1]
    engine.reset_memory_peaks()
    model.load_state_dict(state)
    load_peak = engine.memory()["gathered"][1]
    largest = max(sum(g.padded_numel * 4 for g in u.groups) for u in engine.units)
    return {"save": seen["save"], "load": seen["load"], "save_peak": save_peak, "load_peak": load_peak,
            "largest": largest, "model": sum(v.numel() * 4 for v in state.values())}


def test_state_dict_and_load_hold_one_unit_at_a_time() -> None:
    """While saving or loading, a rank holds at most one gathered unit beyond its shards: the
    engine's ledger peak of gathered bytes is the largest unit's, and the parameter values attached
    to the model at any module's turn (observed by the test's own hooks) never exceed it."""
    for result in run_distributed(_memory, 2):
        assert result["save_peak"] == result["load_peak"] == result["largest"]
        assert 0 < result["save"] <= result["largest"] < result["model"] / 3
        assert 0 < result["load"] <= result["largest"]


def _dcp(rank: int, world: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    model = _model("gpt", 0)
    ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0))
    with state_dict_options(model, sharded=True):
        sharded = model.state_dict()
    params = dict(_model("gpt", 0).named_parameters())
    shapes = {k: v.shape for k, v in sharded.items() if isinstance(v, DTensor)}
    locals_ = {k: v.to_local().shape for k, v in sharded.items() if isinstance(v, DTensor)}
    dcp.save(sharded, checkpoint_id=folder)
    fresh = _model("gpt", 1)
    ZeroEngine(fresh, prefetch=PrefetchConfig(persistence_threshold=0))  # another unit layout
    with state_dict_options(fresh, sharded=True):
        target = fresh.state_dict()
    dcp.load(target, checkpoint_id=folder)
    fresh.load_state_dict(target)
    return {"shapes": shapes, "locals": locals_, "params": {k: tuple(p.shape) for k, p in params.items()},
            "loaded": fresh.state_dict()}


def test_sharded_state_dict_is_dtensors_that_dcp_saves_and_loads(tmp_path) -> None:
    """``sharded=True``: each parameter is a ``DTensor`` of the full shape whose local part is this
    rank's dim-0 chunk; ``torch.distributed.checkpoint`` saves them and loads them into a model
    partitioned another way, whose full state dict is then the saved model's."""
    results = run_distributed(_dcp, 2, str(tmp_path / "dcp"))
    want = _model("gpt", 0).state_dict()
    for rank, result in enumerate(results):
        for key, shape in result["shapes"].items():
            assert tuple(shape) == tuple(want[key].shape), key
            rows = torch.chunk(torch.empty(shape[0]), 2)[rank].numel() if len(shape) else None
            if rows is not None:
                assert result["locals"][key][0] == rows, key
        _assert_same(result["loaded"], want)


def _full_file_remapped(rank: int, world: int, path: str) -> dict:
    from lightning_zinf import load_full_state_dict

    torch.manual_seed(1)
    model = models.MLP()
    model.fc2 = _Remapped(48, 48)
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    left = load_full_state_dict(engine, path, strict=False)
    return {"left": left, "state": model.state_dict()}


def test_load_full_state_dict_takes_the_modules_route_too(tmp_path) -> None:
    """``load_full_state_dict`` (``load_full_weights``, ``fabric.load_raw`` of a safetensors file)
    goes through the model's ``load_state_dict``: a module's own key remapping receives the file's
    ``fc2.weight`` (memory-mapped); nothing is left over."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    plain = models.MLP()
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, tmp_path / "plain.safetensors")
    for result in run_distributed(_full_file_remapped, 2, str(tmp_path / "plain.safetensors")):
        assert result["left"] == []
        assert torch.equal(result["state"]["fc2.linear.weight"], plain.fc2.weight)
        assert torch.equal(result["state"]["fc1.weight"], plain.fc1.weight)


def _one_rank_reads(rank: int, world: int) -> str:
    model = _model("mlp", 0)
    ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    with pytest.raises(RuntimeError, match="Ranks diverged") as error:
        if rank == 0:
            model.state_dict()  # rank 0 alone, while rank 1 starts a forward pass
        else:
            model(torch.randn(2, 16))
    return str(error.value)


def test_a_state_dict_on_one_rank_is_named_on_every_rank() -> None:
    """``state_dict()`` on rank 0 while rank 1 runs a forward: their agreement checks meet, and
    each rank raises naming where every rank was (it once failed with a TypeError inside the
    divergence report, the two checks' payloads mixed up)."""
    for message in run_distributed(_one_rank_reads, 2):
        assert "rank 0 was at about to issue a gather of unit 'fc1..fc3'" in message, message  # the MLP's one unit
        assert "rank 1 was at the meeting of the ranks at the start of a pass" in message, message
