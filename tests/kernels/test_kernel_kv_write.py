"""KV write kernel against its torch reference: every row lands in its slot, skips write nothing."""

from __future__ import annotations

import pytest
import torch
from kernel_batches import DEVICE, dev

from inflight.ops import reference
from inflight.ops.triton.kv_write import write_kv


@pytest.mark.parametrize(
    ("num_heads", "head_dim", "block_size", "dtype"),
    [(4, 64, 16, torch.float32), (1, 80, 32, torch.float16), (8, 128, 16, torch.float16), (2, 96, 32, torch.float32)],
)
def test_matches_reference(num_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, tokens = 6, 23
    key = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
    # Distinct slots, the first two across the boundary of blocks 0 and 1, and some skipped tokens.
    rest = torch.randperm(num_blocks * block_size, generator=gen)
    rest = rest[(rest != block_size - 1) & (rest != block_size)]
    slots = torch.cat([torch.tensor([block_size - 1, block_size]), rest[: tokens - 2]])
    slots[[2, 7, 8]] = -1
    k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, generator=gen).to(dtype)
    key, value, slots, k_cache, v_cache = dev(key, value, slots, k_cache, v_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv(key, value, k_cache, v_cache, slots)
    reference.write_kv(key, value, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[0, block_size - 1], key[0]) and torch.equal(v_cache[1, 0], value[1])


def test_skip_slots_leave_the_cache_untouched_and_strided_inputs_work():
    # key/value as views into a fused kv projection [T, 2, Hkv, D] (non-contiguous token stride).
    kv = dev(torch.randn(5, 2, 2, 32))
    key, value = kv[:, 0], kv[:, 1]
    k_cache, v_cache = dev(torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32))
    write_kv(key, value, k_cache, v_cache, dev(torch.tensor([-1, -1, -1, -1, -1])))
    assert not k_cache.any() and not v_cache.any()
    write_kv(key, value, k_cache, v_cache, dev(torch.tensor([3, -1, 31, 16, -5], dtype=torch.int32)))
    assert torch.equal(k_cache[0, 3], key[0]) and torch.equal(k_cache[1, 15], key[2])
    assert torch.equal(v_cache[1, 0], value[3])
    assert int((k_cache.abs().sum((-1, -2)) > 0).sum()) == 3


def test_converts_to_the_cache_dtype():
    key = dev(torch.randn(3, 2, 64))
    k_cache = torch.zeros(1, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros(1, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    write_kv(key, key * 2, k_cache, v_cache, dev(torch.tensor([0, 5, 9])))
    assert torch.equal(k_cache[0, 5], key[1].half()) and torch.equal(v_cache[0, 9], (key[2] * 2).half())
