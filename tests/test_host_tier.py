"""NVMe-tier state kept in host memory (``OffloadConfig.host_bytes``): what the user pays for is the
disk traffic it saves and the host memory it costs, at no change of a single bit.

Observers outside the engine: the swap files in each rank's swap folder (what is on the disk), a
wrapper around the swapper's ``read``/``write`` (every I/O request, by file) and the process's own
storage counters (``/proc/self/io``). The reference is the same run with everything on NVMe
(``host_bytes=0``), itself checked against no offload in test_offload.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine
from tests import models
from tests.harness import run_distributed

BATCH = 8
STEPS = 6
WARMUP = 2  # steps before the I/O is counted: the first creates the optimizer's states
SAVED = 1  # the step after which a run saves a sharded checkpoint (before the I/O is counted)
ALL = 1 << 40


def _storage_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _silence_output() -> list[int]:
    """Point this process's stdout and stderr at ``/dev/null`` and return the saved descriptors: a
    line on either (a library's warning, gloo's C++ log) lands in pytest's capture file on the disk
    and counts among ``/proc/self/io``'s written bytes (a page for the first byte)."""
    saved = [os.dup(fd) for fd in (1, 2)]
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)
    return saved


def _restore_output(saved: list[int]) -> None:
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


def _log_requests(engine: ZeroEngine) -> list[tuple[str, str, int]]:
    """From now on, every read and write the swapper is asked for: ``(verb, key, bytes)``."""
    log: list[tuple[str, str, int]] = []
    swapper = engine.swapper
    for verb in ("read", "write"):
        def logged(key, tensor, _call=getattr(swapper, verb), _verb=verb):
            log.append((_verb, key, tensor.numel() * tensor.element_size()))
            return _call(key, tensor)
        setattr(swapper, verb, logged)
    return log


def _files(engine: ZeroEngine) -> dict[str, int]:
    """The swap files in this rank's swap folder, by key (``k-`` + the quoted key + ``.swp``; the
    folder's lock and probe files start with a dot): bytes."""
    return {unquote(p.name[2:-4]): p.stat().st_size for p in engine.swapper.folder.iterdir()
            if p.name.startswith("k-") and p.name.endswith(".swp")}


def _train(rank: int, world: int, offload: dict, bf16: bool, ckpt: str, load: bool) -> dict:
    from lightning_zinf.checkpoint import load_sharded, save_sharded

    torch.manual_seed(1 if load else 0)  # a run that loads differs until it does
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(**offload, sub_group_size=3_000),
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16") if bf16 else MixedPrecisionConfig())
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    per_rank = BATCH // world
    losses, requests, storage = [], [], (0, 0)
    for step in range(STEPS):
        if step == WARMUP:
            engine.release_all()  # (writes behind the last step complete before counting)
            quiet = _silence_output()
            requests, storage = _log_requests(engine), _storage_bytes()
            files = _files(engine)
        if step == SAVED + 1 and load:
            load_sharded(engine, [opt], ckpt)  # saved by a run with another placement
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        losses.append(loss.item())
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step == SAVED and not load:
            save_sharded(engine, [opt], ckpt, {})
    engine.release_all()
    read, written = (now - then for now, then in zip(_storage_bytes(), storage))
    _restore_output(quiet)
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    memory = {k: now for k, (now, _) in engine.memory().items()}
    states = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
              if isinstance(v, torch.Tensor)}
    return {"losses": losses, "weights": weights, "states": states, "requests": requests, "storage": (read, written),
            "files": files, "memory": memory, "written_in_all": engine.swapper.bytes_written}


def _runs(tmp_path: Path, tier: dict, budgets: list[int], bf16: bool) -> dict[int, list[dict]]:
    out = {}
    for budget in budgets:
        folder = tmp_path / f"nvme{budget}"
        folder.mkdir()
        out[budget] = run_distributed(_train, 2, {**tier, "nvme_path": str(folder), "host_bytes": budget}, bf16,
                                      str(tmp_path / f"ckpt{budget}"), False)
    return out


def _same_training(got: list[dict], want: list[dict], since: int = 0) -> None:
    for g, w in zip(got, want):
        assert g["losses"][since:] == w["losses"][since:]
        for name, value in w["weights"].items():
            assert torch.equal(g["weights"][name], value), name
        assert g["states"].keys() == w["states"].keys()
        assert all(torch.equal(g["states"][k], v) for k, v in w["states"].items())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_state_kept_in_host_memory_leaves_the_disk_and_changes_no_bit(tmp_path: Path, bf16: bool) -> None:
    """Parameters and optimizer on NVMe, 2 ranks, AdamW with clipping, a sharded checkpoint: with
    everything kept in host memory the steps make no I/O request and read and write no byte of
    storage; with a budget for part of it, the files of the first groups (shards, compute copies,
    masters, moments) are gone from the disk, whole groups only, no more bytes than the budget,
    and no request names them, while the rest moves as before; every run trains like the one with
    everything on NVMe, bit for bit."""
    runs = _runs(tmp_path, {"param": "nvme", "optimizer": "nvme"}, [0, 250_000, ALL], bf16)
    for budget in (250_000, ALL):
        _same_training(runs[budget], runs[0])
    on_disk = runs[0][0]["files"]
    kept_all = runs[ALL][0]
    # Everything: no file but the gradient shards' (held in staging memory, never written here).
    assert set(kept_all["files"]) <= {name for name in on_disk if name.endswith(".grad")}, kept_all["files"]
    for rank in runs[ALL]:
        assert rank["requests"] == [] and rank["storage"] == (0, 0), (rank["requests"][:4], rank["storage"])
    # Part of it: the first groups' files are gone, whole groups, within the budget.
    part = runs[250_000][0]
    gone = {name: size for name, size in on_disk.items() if name not in part["files"]}
    groups_gone = sorted({int(name[1:].split(".")[0]) for name in gone if name.startswith("g")})
    assert groups_gone and groups_gone == list(range(len(groups_gone))), sorted(gone)
    # (parameter shards are named by creation order, which is the engine's order here)
    assert sorted({int(name[1:].split(".")[0]) for name in gone if name.startswith("p")}) == groups_gone
    assert not any(name.endswith(".grad") for name in gone)
    assert 0 < sum(gone.values()) <= 250_000, gone
    for rank, nvme in zip(runs[250_000], runs[0]):
        named = {key for _, key, _ in rank["requests"]}
        assert named and not named & set(gone), sorted(named & set(gone))
        # Every other file moves as before. (Counted by file, not by request: how many times the
        # read-ahead asks for a file depends on the timing of the I/O threads.)
        assert named == {key for _, key, _ in nvme["requests"]} - set(gone), \
            sorted(named ^ ({key for _, key, _ in nvme["requests"]} - set(gone)))
        # The ledger counts what stays in host memory: at most the budget (plus Adam's step counters).
        host = rank["memory"]["shards_cpu"] + rank["memory"]["optimizer"] - nvme["memory"]["shards_cpu"] - nvme["memory"]["optimizer"]
        assert 0 < host <= 250_000, rank["memory"]


def test_a_checkpoint_moves_between_placements(tmp_path: Path) -> None:
    """Placement is not part of a checkpoint's meaning: a sharded checkpoint saved after step 2 by a
    run with everything on NVMe, loaded by a run with everything in host memory that started from
    other weights (and the other way round), continues exactly as the run that saved it."""
    runs = _runs(tmp_path, {"param": "nvme", "optimizer": "nvme"}, [0, ALL], bf16=True)
    for saved, loaded in ((0, ALL), (ALL, 0)):
        folder = tmp_path / f"load{loaded}"
        folder.mkdir()
        got = run_distributed(_train, 2, {"param": "nvme", "optimizer": "nvme", "nvme_path": str(folder),
                                          "host_bytes": loaded}, True, str(tmp_path / f"ckpt{saved}"), True)
        assert got[0]["losses"][: SAVED + 1] != runs[saved][0]["losses"][: SAVED + 1]  # the load matters
        _same_training(got, runs[saved], since=SAVED + 1)


@pytest.mark.parametrize("param, optimizer", [("nvme", "cpu"), ("cpu", "nvme"), ("none", "nvme")])
def test_one_tier_on_nvme_kept_in_host_memory(tmp_path: Path, param: str, optimizer: str) -> None:
    """Only the parameters on NVMe (the optimizer on the ``cpu`` tier: kept shards and compute
    copies, never written, not even when the model is partitioned), or only the optimizer (masters that are records of their own, beside host or device
    shards): everything kept makes no I/O request; the run is the one with all of that tier on
    NVMe, bit for bit."""
    runs = _runs(tmp_path, {"param": param, "optimizer": optimizer}, [0, ALL], bf16=True)
    _same_training(runs[ALL], runs[0])
    if optimizer != "nvme":  # shards kept as they are made: not written even once at construction
        assert all(r["written_in_all"] == 0 for r in runs[ALL]), [r["written_in_all"] for r in runs[ALL]]
    assert all(r["requests"] == [] and r["storage"] == (0, 0) for r in runs[ALL])
    assert all(r["requests"] for r in runs[0])


@pytest.mark.parametrize("fields, words", [
    ({"host_bytes": -1}, ["host_bytes=-1", "integer >= 0"]),
    ({"host_bytes": True}, ["host_bytes=True"]),
    ({"host_bytes": 10, "param": "cpu", "optimizer": "cpu"}, ["neither param nor optimizer is 'nvme'", "Drop host_bytes"]),
])
def test_bad_host_bytes_name_the_fix(fields: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        OffloadConfig(**fields)
    assert all(word in str(caught.value) for word in words), caught.value


def _fit(rank: int, world: int, offload: dict) -> dict:
    import lightning.pytorch as pl

    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    class SwapFolder(pl.Callback):
        """The swap files of this rank when training ends (before the strategy removes them)."""

        files: dict = {}

        def on_train_end(self, trainer, pl_module) -> None:
            engine = trainer.strategy.engine
            SwapFolder.files = _files(engine) if engine.swapper is not None else {}

    # A unit per module: groups small enough for some to fit the host part.
    strategy = ZeroInfinityStrategy(offload=offload, prefetch={"unit_size": 0})
    lit = LitGPT(GLOBAL_BATCH // world)
    trainer = _trainer(strategy, world, callbacks=[SwapFolder()])
    trainer.fit(lit)
    return {"losses": lit.train_losses, "offload": trainer.strategy.options.offload, "files": SwapFolder.files}


def test_the_trainer_takes_host_bytes_from_a_mapping(tmp_path: Path) -> None:
    """``ZeroInfinityStrategy(offload={...})`` as a LightningCLI YAML gives it: a fit (clipping, LR
    schedule, validation) with part of the NVMe tier in host memory trains as without offload, and
    leaves fewer swap files than the same fit with everything on NVMe. (The reference has the
    same units: other units sum the clipping's norm in another order.)"""
    base = run_distributed(_fit, 2, {}, init_pg=False)[0]
    offload = {"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path), "host_bytes": 100_000}
    got = run_distributed(_fit, 2, offload, init_pg=False)[0]
    assert got["offload"].host_bytes == 100_000
    assert got["losses"] == base["losses"]
    nvme = run_distributed(_fit, 2, {**offload, "host_bytes": 0}, init_pg=False)[0]
    assert nvme["losses"] == base["losses"]
    assert 0 < len(got["files"]) < len(nvme["files"]), (got["files"], nvme["files"])


def _two_optimizers(rank: int, world: int, nvme: str, budget: int) -> dict:
    torch.manual_seed(0)
    model = models.GPT(d=64)
    is_matrix = {n: p.dim() >= 2 for n, p in model.named_parameters()}  # (partitioning flattens them)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme, host_bytes=budget))
    matrices = [p for n, p in model.named_parameters() if is_matrix[n]]
    vectors = [p for n, p in model.named_parameters() if not is_matrix[n]]
    first = engine.shard_optimizer(torch.optim.AdamW(matrices, lr=1e-2))
    second = engine.shard_optimizer(torch.optim.AdamW(vectors, lr=1e-3))
    losses = []
    for step in range(3):
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x, y)
        loss.backward()
        losses.append(loss.item())
        second.step()  # (the second optimizer steps first: its states are created first)
        first.step()
        first.zero_grad()
        second.zero_grad()
    engine.release_all()
    files = _files(engine)
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "files": files}


def test_the_budget_counts_the_states_of_the_first_optimizer_only(tmp_path: Path) -> None:
    """Two optimizers over the same groups (matrices; norms and biases), the second sharded
    stepping first: a budget of exactly the first three groups' shards and first-optimizer states
    (the third, a block, has states of both) keeps those off the disk and nothing more (the
    second optimizer's states stay on NVMe: kept too, they would exceed the budget), and training
    is the same bit for bit."""
    def run(budget: int) -> dict:
        folder = tmp_path / str(budget)
        folder.mkdir()
        return run_distributed(_two_optimizers, 1, str(folder), budget)[0]

    nvme = run(0)
    # States are named by the order optimizers first step: o1 is the first one sharded here.
    cost = [sum(n for k, n in nvme["files"].items() if k == f"p{g}" or k.startswith(f"g{g}.o1.state")) for g in (0, 1, 2)]
    assert any(k.startswith("g2.o0.state") for k in nvme["files"])  # the second optimizer's, for a kept group
    budget = sum(cost)
    kept = run(budget)
    assert kept["losses"] == nvme["losses"]
    assert all(torch.equal(kept["weights"][n], w) for n, w in nvme["weights"].items())
    gone = {k: n for k, n in nvme["files"].items() if k not in kept["files"]}
    assert sum(gone.values()) == budget and all(k.startswith(("p0", "p1", "p2", "g0.o1", "g1.o1", "g2.o1")) for k in gone), gone


def _lora(rank: int, world: int, nvme: str, budget: int) -> dict:
    torch.manual_seed(0)
    model = models.GPT(d=64, lora_rank=4)  # adapters trainable, everything else frozen
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme, host_bytes=budget),
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses, requests = [], []
    for step in range(4):
        if step == WARMUP:
            engine.release_all()
            requests = _log_requests(engine)
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    engine.release_all()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "requests": requests}


def test_a_frozen_base_kept_in_host_memory_is_read_from_memory(tmp_path: Path) -> None:
    """LoRA (adapters trainable, the base frozen) with parameters and optimizer on NVMe: the frozen
    base's shards and 16-bit copies, which every forward and backward gathers, count in the budget
    like trainable groups; everything kept, a step makes no I/O request at all (with everything on
    NVMe its gathers read the base's files), and training is the same bit for bit."""
    runs = {}
    for budget in (0, ALL):
        folder = tmp_path / str(budget)
        folder.mkdir()
        runs[budget] = run_distributed(_lora, 1, str(folder), budget)[0]
    assert runs[ALL]["losses"] == runs[0]["losses"]
    assert all(torch.equal(runs[ALL]["weights"][n], w) for n, w in runs[0]["weights"].items())
    assert any(verb == "read" and key.startswith("p") for verb, key, _ in runs[0]["requests"])
    assert runs[ALL]["requests"] == [], runs[ALL]["requests"][:4]
