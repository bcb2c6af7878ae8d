"""The gradient buffer pool's reuse rules and its ledger accounting, byte for byte; the gather
pool's moves of memory between gather buffers, its bound, and autograd's saved views through it."""

import copy
import weakref

import torch
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.engine.buffers import BufferPool, GatherPool


def test_pool_reuses_within_slack_drops_smaller_on_a_miss_and_accounts_every_byte() -> None:
    pool = BufferPool(torch.device("cpu"))
    now = pool.ledger.now
    grad = pool.take(1000, torch.bfloat16)  # 2000 bytes
    cast = pool.take(1000, torch.float32, "reduce_pending")  # 4000 bytes
    assert (grad.dtype, grad.shape, cast.dtype, cast.shape) == (torch.bfloat16, (1000,), torch.float32, (1000,))
    assert (now["grad_buffers"], now["reduce_pending"], now["pooled"]) == (2000, 4000, 0)
    pool.move(grad, "reduce_pending")
    assert (now["grad_buffers"], now["reduce_pending"]) == (0, 6000)
    pool.give(grad)
    pool.give(cast)
    assert (now["reduce_pending"], now["pooled"]) == (0, 6000)
    # 1800 bytes: served by the 2000-byte buffer (within 1.25x), the same memory, not the 4000 one.
    again = pool.take(900, torch.bfloat16)
    assert again.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert (now["grad_buffers"], now["pooled"]) == (2000, 4000)
    # 1000 bytes: no free buffer within 1.25x (4000 is too large to spend on it): a new one, nothing dropped.
    small = pool.take(250, torch.float32)
    assert small.untyped_storage().data_ptr() not in {grad.untyped_storage().data_ptr(), cast.untyped_storage().data_ptr()}
    assert now["pooled"] == 4000
    pool.give(again)
    pool.give(small)
    # 8000 bytes (a larger unit's turn): nothing serves it, so the smaller free buffers are dropped.
    big = pool.take(2000, torch.float32)
    assert (now["pooled"], now["grad_buffers"]) == (0, 8000) and pool.pooled_bytes == 0
    pool.give(big)
    pool.release_free()
    assert now["pooled"] == pool.pooled_bytes == 0 and pool.ledger.peak["pooled"] == 8000  # the big one, given back


def test_pool_without_reuse_hands_buffers_back_to_the_allocator_at_once() -> None:
    """On an accelerator the caching allocator pools (stream-safely); the pool only accounts."""
    assert BufferPool(torch.device("cpu")).reuse and not BufferPool(torch.device("cuda")).reuse
    pool = BufferPool(torch.device("cpu"), reuse=False)
    now = pool.ledger.now
    grad = pool.take(1000, torch.float32)
    buffer = weakref.ref(pool._handed[id(grad)][0])  # the uint8 buffer behind the view
    assert now["grad_buffers"] == 4000
    pool.give(grad)
    del grad
    assert buffer() is None, "the pool kept a given-back buffer alive"
    assert (now["grad_buffers"], now["pooled"], pool.pooled_bytes) == (0, 0, 0)
    again = pool.take(1000, torch.float32)
    assert now["grad_buffers"] == 4000 and pool.ledger.peak["pooled"] == 0
    pool.forget(again)
    assert now["grad_buffers"] == 0


def test_gather_pool_moves_released_memory_into_the_next_gather_within_its_bound() -> None:
    pool = GatherPool(torch.device("cpu"))
    now = pool.ledger.now
    a, b, c = (torch.empty(0).untyped_storage() for _ in range(3))
    pool.fill(a, 4000)
    memory = a.data_ptr()
    pool.empty(a)
    assert (a.nbytes(), a.data_ptr(), now["gathers_kept"]) == (0, 0, 4000)
    pool.fill(b, 4000)  # the same size: a's memory, moved (b keeps its own storage object)
    assert (b.nbytes(), b.data_ptr(), now["gathers_kept"]) == (4000, memory, 0)
    pool.fill(a, 4000)  # nothing kept: new memory; 8000 bytes in use at once
    pool.empty(a)
    pool.empty(b)
    assert pool.kept == now["gathers_kept"] == 8000
    pool.fill(c, 2000)  # no kept memory of that size: the oldest kept (a's) is freed first, then new memory
    assert (pool.in_use, pool.kept) == (2000, 4000)  # in use plus kept within the most in use at once
    pool.empty(c)
    assert pool.kept == now["gathers_kept"] == 6000
    pool.fill(a, 4000)
    assert a.data_ptr() == memory  # b's, kept
    pool.empty(a)
    pool.new_window()  # the bound is the most in use in this window or the previous one: still 8000
    assert pool.kept == 6000
    pool.new_window()  # two windows without gathers: nothing may be kept
    assert pool.kept == now["gathers_kept"] == 0 and now["gathered"] == 0
    pool.fill(a, 4000)
    pool.empty(a)
    assert pool.kept == 4000
    pool.clear()  # the end of a loop
    assert pool.kept == now["gathers_kept"] == 0


def test_gather_pool_without_reuse_frees_at_once() -> None:
    """On an accelerator the caching allocator keeps freed blocks: the pool resizes storages only."""
    assert GatherPool(torch.device("cpu")).reuse and not GatherPool(torch.device("cuda")).reuse
    pool = GatherPool(torch.device("cpu"), reuse=False)
    a = torch.empty(0).untyped_storage()
    pool.fill(a, 4000)
    pool.empty(a)
    pool.fill(a, 4000)
    pool.empty(a)
    assert a.nbytes() == pool.kept == pool.ledger.peak["gathers_kept"] == 0


class _ViewBlock(nn.Module):
    """``x @ w.t()``: autograd saves the transposed view of the gathered weight, not the parameter,
    so backward reads the gather buffer's storage through that view after it was released and
    gathered again."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w.t())


def test_saved_views_of_gather_buffers_read_their_own_values_when_the_pool_moves_memory() -> None:
    """Every block is gathered, released (its memory kept by the pool) and its memory moved into
    the next block's buffer; backward re-gathers each into its own storage, which autograd's saved
    view points into. SGD steps on its gradients are bit-identical to plain PyTorch's, and the pool
    did move memory."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_ViewBlock(32) for _ in range(4)])
    reference = copy.deepcopy(model)
    engine = ZeroEngine(model, block_classes=[_ViewBlock], prefetch=PrefetchConfig(persistence_threshold=0))
    fills = []
    fill = engine.gathers.fill
    engine.gathers.fill = lambda storage, nbytes: (fills.append(engine.gathers.kept), fill(storage, nbytes))[1]
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        for net, optimizer in ((model, opt), (reference, reference_opt)):
            net(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert any(kept > 0 for kept in fills), "the pool never had kept memory to move: the test shows nothing"
    with engine.gathered():
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(ours, theirs)
