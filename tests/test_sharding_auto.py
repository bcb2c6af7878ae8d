"""``sharding="auto"`` (issue 41 item 4): the mode and ZeRO++'s switches chosen at setup from the
measured links (:mod:`lightning_zinf.planning.sharding`).

The cost model's bytes are held against the engine's own counts of a real step on 4 ranks in two
simulated nodes, in each candidate; the choice against hand-made rates (a fast link hides the
collectives, a slow one does not, memory that does not fit rules hybrid out); and ``auto`` under
a real Trainer, where every rank must choose alike and then train as the fixed mode it chose.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.options import ZeroOptions
from lightning_zinf.planning import Inventory
from lightning_zinf.planning.sharding import Links, choose_sharding, step_bytes
from tests import models
from tests.harness import run_distributed

GPT = dict(d=64, layers=4, vocab=64, heads=2)
CANDIDATE_OPTIONS = {"full": {}, "hybrid": {"sharding": "hybrid"},
                     "zero_pp": {"zero_pp": ZeroPPConfig(ranks_per_node=2, hpz=True, qwz=True, qgz=True)},
                   "hybrid_qgz8": {"sharding": "hybrid", "zero_pp": ZeroPPConfig(ranks_per_node=2, qgz=True, qgz_bits=8)},
                   "hybrid_qgz": {"sharding": "hybrid", "zero_pp": ZeroPPConfig(ranks_per_node=2, qgz=True)}}


def _counted(rank: int, world: int, candidate: str) -> tuple[int, int]:
    """This rank's intra- and inter-node bytes over one step after a first one (the steady step:
    hpZ's secondaries and the trace in place)."""
    torch.manual_seed(0)
    model = models.GPT(**GPT)
    options = {"zero_pp": ZeroPPConfig(ranks_per_node=2), **CANDIDATE_OPTIONS[candidate]}
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0), **options)
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    for step in range(2):
        engine.comm.bytes.reset()
        x, y = models.make_batch("gpt", step, 4)
        models.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return engine.comm.bytes.intra_node, engine.comm.bytes.inter_node


@pytest.mark.parametrize("candidate", ["full", "hybrid", "zero_pp", "hybrid_qgz8", "hybrid_qgz"])
def test_the_cost_model_counts_the_bytes_the_engine_moves(candidate: str) -> None:
    """:func:`step_bytes` against the engine's own count of a steady step (4 ranks, two nodes of
    two): a rank's intra-node bytes and its node's inter-node bytes within 2% (the quantized
    candidates: 10%, whose rows carry padding to whole blocks and alignment, and ZeRO++'s backward
    gathers of persistent units are exact)."""
    counted = run_distributed(_counted, 4, candidate)
    inventory = Inventory.of(models.GPT(**GPT), world=4, block_classes=["Block"], persistence_threshold=0)
    intra, inter = step_bytes(inventory, 4, 2, candidate)
    tolerance = 0.1 if candidate in ("zero_pp", "hybrid_qgz8", "hybrid_qgz") else 0.02
    assert counted[0][0] == pytest.approx(intra, rel=tolerance)
    assert counted[0][1] + counted[1][1] == pytest.approx(inter, rel=tolerance)


def _inventory() -> Inventory:
    return Inventory.of(models.GPT(d=256, layers=4, vocab=256, heads=4), world=4, block_classes=["Block"],
                        persistence_threshold=0)


def test_the_choice_follows_the_links() -> None:
    """With hand-made rates (4 ranks in two nodes; the step's compute given unless said):

    - one node: full sharding, nothing weighed;
    - on an accelerator whose step's compute hides the collectives on every candidate: full
      sharding, no quantization (neither would save anything);
    - on a CPU device, a link between nodes as fast as within them: hybrid sharding (fewer bytes
      on both links), ZeRO++'s quantization left off where it costs more than it saves;
    - a slow link between nodes (100 Mbit/s): hybrid with qgZ's INT4 codes (the fewest bytes
      across), or, where hybrid's state does not fit, ZeRO++;
    - a link of 1 Gbit/s: hybrid with INT8 codes, since INT4 would save less than 10% of its step;
    - a link as fast as within the node but with hybrid's state too large for the free memory:
      never hybrid;
    - host memory too small for hybrid's offloaded state: not hybrid;
    - without the step's compute: never ZeRO++ (on an accelerator or a CPU)."""
    inventory = _inventory()
    states = {"full": 100, "hybrid": 200, "zero_pp": 120}
    one = choose_sharding(inventory, 2, 2, Links(1e9, None), state_bytes=states, free_bytes=10**6)
    assert (one.sharding, one.zero_pp.qgz, one.steps) == ("full", False, {})
    hidden = choose_sharding(inventory, 4, 2, Links(10e9, 10e9), state_bytes=states, free_bytes=10**6, compute=1.0,
                             quantization=1e-9, accelerator=True)
    assert (hidden.sharding, hidden.zero_pp.qgz) == ("full", False), hidden.describe()
    fast = choose_sharding(inventory, 4, 2, Links(1e9, 1e9), state_bytes=states, free_bytes=10**6, compute=0.1,
                           quantization=1e-8)
    assert (fast.sharding, fast.zero_pp.qgz) == ("hybrid", False), fast.describe()
    slow = choose_sharding(inventory, 4, 2, Links(1e9, 12.5e6), state_bytes=states, free_bytes=10**6, compute=0.1,
                           quantization=1e-8)
    assert (slow.sharding, slow.zero_pp) == ("hybrid", ZeroPPConfig(qgz=True)), slow.describe()
    assert "hybrid with qgZ (the all-reduce across nodes as INT4 codes)" in slow.describe()
    assert slow.steps["hybrid_qgz"] < 0.9 * slow.steps["hybrid_qgz8"] < slow.steps["zero_pp"]
    medium = choose_sharding(inventory, 4, 2, Links(1e9, 125e6), state_bytes=states, free_bytes=10**6, compute=0.1,
                             quantization=1e-8)
    assert (medium.sharding, medium.zero_pp) == ("hybrid", ZeroPPConfig(qgz=True, qgz_bits=8)), medium.describe()
    assert 0.9 * medium.steps["hybrid_qgz8"] < medium.steps["hybrid_qgz"] < medium.steps["hybrid_qgz8"]
    crowded = choose_sharding(inventory, 4, 2, Links(1e9, 12.5e6), state_bytes=states, free_bytes=250, compute=0.1,
                              quantization=1e-8)
    assert (crowded.sharding, crowded.zero_pp) == ("full", ZeroPPConfig(hpz=True, qwz=True, qgz=True)), \
        crowded.describe()
    assert not crowded.fits["hybrid_qgz"] and not crowded.fits["hybrid_qgz8"]
    tight = choose_sharding(inventory, 4, 2, Links(1e9, 1e9), state_bytes=states, free_bytes=250, compute=0.1,
                            quantization=1e-8)
    assert tight.sharding == "full" and not tight.fits["hybrid"] and "does not fit" in tight.describe()
    # On an accelerator whose offloaded state lives in host memory, the host must hold hybrid's too.
    host = choose_sharding(inventory, 4, 2, Links(1e9, 12.5e6), state_bytes=states, free_bytes=10**6, compute=0.1,
                           quantization=1e-8, accelerator=True, host_bytes={"full": 100, "hybrid": 900}, free_host=1000)
    assert not host.fits["hybrid"] and not host.fits["hybrid_qgz"] and host.fits["zero_pp"]
    assert (host.sharding, host.zero_pp.hpz) == ("full", True), host.describe()
    # Without the step's compute an accelerator may hide the collectives: no quantization then.
    unknown = choose_sharding(inventory, 4, 2, Links(1e9, 12.5e6), state_bytes=states, free_bytes=10**6,
                              quantization=1e-8, accelerator=True)
    assert not unknown.zero_pp.qgz and "example_input_array" in unknown.describe()
    # Nor on a CPU device, where the collectives alone would let probe noise clear the bar.
    cpu = choose_sharding(inventory, 4, 2, Links(1e9, 12.5e6), state_bytes=states, free_bytes=10**6,
                          quantization=1e-8)
    assert not cpu.zero_pp.qgz and cpu.sharding == "hybrid"
    # NCCL's rings cross a node's link once per collective over every rank: fewer bytes for
    # full sharding than each rank sending each peer its part, as many for hybrid's all-reduce.
    for candidate, fewer in (("full", True), ("hybrid", False)):
        direct, ring = step_bytes(inventory, 16, 8, candidate)[1], step_bytes(inventory, 16, 8, candidate, ring=True)[1]
        assert (ring < direct) == fewer and ring <= direct


def _probe_failing_on_rank_1(rank: int, world: int) -> tuple:
    import lightning_zinf.planning.sharding as sharding
    from lightning_zinf.comm.topology import Topology

    original = sharding._probe_buffers

    def buffers(size, device, nbytes):
        if rank == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(size, device, nbytes)

    sharding._probe_buffers = buffers
    return sharding.measure_links(Topology(world, rank, 2), torch.device("cpu"), nbytes=1 << 16)


def test_a_probe_that_fails_on_one_rank_is_known_to_all() -> None:
    """The probes' buffers cannot be allocated on rank 1 only (out of memory): no rank waits for
    it in a probe, and every rank gets the rates as unknown (``auto`` then keeps ``full``)."""
    links = run_distributed(_probe_failing_on_rank_1, 4, timeout=120)
    assert all(link.inter is None and link.intra is None for link in links), links


def _auto(rank: int, world: int, sharding: str) -> dict:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    lit = LitGPT(GLOBAL_BATCH // world)
    lit.example_input_array = models.make_batch("gpt", 0, GLOBAL_BATCH // world)[0]
    strategy = ZeroInfinityStrategy(sharding=sharding, zero_pp={"ranks_per_node": 2})
    trainer = _trainer(strategy, world)
    trainer.fit(lit)
    engine = trainer.strategy.engine
    choice = engine.sharding_choice
    return {"losses": lit.train_losses, "mode": engine.comm.replicas > 1 and "hybrid" or "full",
            "bits": engine.comm.qgz_bits or engine.comm.replica_bits,  # the gradients' codes, if any
            "choice": None if choice is None else (choice.sharding, choice.zero_pp.qgz_bits if choice.zero_pp.qgz
                                                   else None, choice.describe())}


def test_auto_under_a_trainer_chooses_alike_on_every_rank_and_trains_as_its_choice() -> None:
    """``ZeroInfinityStrategy(sharding="auto")`` on 4 ranks in two simulated nodes: every rank
    makes the same choice, the engine runs it, and the losses are those of a run given that mode
    (and ZeRO++ switches, the gradients' code width included) by hand."""
    auto = run_distributed(_auto, 4, "auto", init_pg=False)
    choices = {r["choice"][:2] for r in auto}
    assert len(choices) == 1 and "sharding='auto' chose" in auto[0]["choice"][2], choices
    (mode, bits), = choices
    assert all((r["mode"], r["bits"]) == (mode, bits) for r in auto)
    if bits is None:
        fixed = run_distributed(_auto, 4, mode, init_pg=False)
        assert fixed[0]["losses"] == auto[0]["losses"]


def test_what_auto_refuses() -> None:
    """ZeRO++ switches given with ``auto`` (it chooses them), ``auto`` with ``memory_budget``,
    and ``auto`` given to the engine itself (it is the strategies' choice at setup) are refused,
    each naming the fix."""
    with pytest.raises(ValueError, match="sharding='auto' chooses ZeRO\\+\\+'s hpz, qwz and qgz"):
        ZeroOptions(sharding="auto", zero_pp={"qgz": True})
    with pytest.raises(ValueError, match="memory_budget does not plan sharding='auto'"):
        ZeroOptions(sharding="auto", memory_budget="1GiB")
    with pytest.raises(ValueError, match="is chosen at setup by ZeroInfinityStrategy"):
        ZeroEngine(models.GPT(**GPT), sharding="auto")


def _random_state_after_choosing(rank: int, world: int) -> tuple[bool, str]:
    from lightning_zinf import MixedPrecisionConfig
    from lightning_zinf.engine_setup import _auto_sharding

    model = models.GPT(**GPT)
    model.example_input_array = models.make_batch("gpt", 0, 2)[0]
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    options, choice = _auto_sharding(model, ZeroOptions(block_classes=["Block"], sharding="auto",
                                                        zero_pp={"ranks_per_node": 2}),
                                     torch.device("cpu"), MixedPrecisionConfig(), 2, None)
    return torch.equal(torch.rand(4), expected), choice.describe()


def test_choosing_leaves_the_random_state_as_it_was() -> None:
    """The probes and the example's block timing draw random values; a seeded run must train
    under ``auto`` as under the mode it chose given by hand, so the random state after choosing
    is the one before (dropout masks and later initialisations the same)."""
    for same, described in run_distributed(_random_state_after_choosing, 4):
        assert same, described


def test_the_engine_runs_the_code_width_auto_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The options ``auto`` hands the engine carry every ZeRO++ switch of its choice, the width of
    the gradients' codes included (hybrid with INT8 codes is not qgZ's default INT4)."""
    from lightning_zinf import MixedPrecisionConfig
    from lightning_zinf import engine_setup
    from lightning_zinf.planning.sharding import QUANTIZED, ShardingChoice

    for sharding, switches in QUANTIZED.values():
        chosen = ShardingChoice(sharding, switches)
        monkeypatch.setattr(engine_setup, "auto_sharding", lambda *args, **kwargs: chosen)
        options, choice = engine_setup._auto_choice(models.GPT(**GPT), ZeroOptions(sharding="auto"), torch.device("cpu"),
                                                    MixedPrecisionConfig(), 1, 1, False, None)
        assert choice is chosen and options.sharding == sharding
        assert (options.zero_pp.hpz, options.zero_pp.qwz, options.zero_pp.qgz, options.zero_pp.qgz_bits) == \
            (switches.hpz, switches.qwz, switches.qgz, switches.qgz_bits)
