"""The gradient buffer pool's reuse rules and its ledger accounting, byte for byte."""

import weakref

import torch

from lightning_zinf.engine.buffers import BufferPool


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
