"""KV slot accounting and rollback: truncate (chains) and compact (trees)."""

from __future__ import annotations

import pytest
import torch

from specdec.kv_cache import KVCache, KVCacheFullError
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.loader import load_decoder
from specdec.spec.tree import ROOT, TokenTree

# Logits after rollback vs a fresh prefill of the kept tokens: the same math in another
# summation order (different row counts per matrix product), so float32 rounding only.
ROLLBACK_ATOL = 2e-5


def forward(decoder, cache, slot, tokens, **kw):
    batch = ForwardBatch.build([SequenceInput(slot, tokens, **kw)], [cache.length(slot)])
    return decoder.forward(batch, cache).logits


def test_allocate_free_and_capacity_errors():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=2, max_len=4)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and not cache.can_allocate()
    with pytest.raises(KVCacheFullError, match="in use"):
        cache.allocate()
    cache.free(a)
    assert cache.num_free_slots == 1
    with pytest.raises(ValueError, match="already free"):
        cache.free(a)
    with pytest.raises(ValueError, match="no KV slot"):
        cache.free(7)
    cache.advance(b, 3)
    with pytest.raises(KVCacheFullError, match="max_model_len=4"):
        cache.advance(b, 2)
    assert cache.length(b) == 3
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(b, 4)
    assert cache.bytes_per_token() == 2 * 1 * 1 * 4 * 4


def test_layer_views_are_the_slots_storage():
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=4, num_slots=2, max_len=5)
    views = cache.layer_views(1)
    assert views is cache.layer_views(1) and len(views) == 3
    keys, values = views[2]
    assert keys.shape == values.shape == (2, 5, 4)
    keys[1, 3] = 7.0  # what a kernel writes through the views lands in the slot
    values[0, 4] = -1.0
    stored_keys, stored_values = cache.view(2, 1, 5)
    assert torch.equal(stored_keys[1, 3], torch.full((4,), 7.0)) and torch.equal(stored_values[0, 4], torch.full((4,), -1.0))
    with pytest.raises(ValueError, match="no KV slot"):
        cache.layer_views(2)


def test_truncate_is_bitwise_the_same_forwards_without_the_rejected_tokens(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    prompt, block = [5, 6, 7, 8, 9], [11, 12, 13, 14]
    cache = decoder.new_kv_cache(2, 32)
    slot, other = cache.allocate(), cache.allocate()
    forward(decoder, cache, other, [1, 2, 3])
    other_before = (cache.keys[:, other, :, :3].clone(), cache.values[:, other, :, :3].clone())
    forward(decoder, cache, slot, prompt)
    forward(decoder, cache, slot, block)  # verify 4 tokens, keep 2
    kept = (cache.keys[:, slot, :, :7].clone(), cache.values[:, slot, :, :7].clone())
    cache.truncate(slot, len(prompt) + 2)
    assert cache.length(slot) == 7
    assert torch.equal(cache.keys[:, slot, :, :7], kept[0]) and torch.equal(cache.values[:, slot, :, :7], kept[1])
    assert torch.equal(cache.keys[:, other, :, :3], other_before[0])  # other slots untouched
    assert torch.equal(cache.values[:, other, :, :3], other_before[1])

    # The same forwards without the rejected tokens: prompt, then only the kept two. The prompt's
    # entries are bitwise equal; the kept block's were computed in a 4-row instead of a 2-row
    # product, which float32 GEMM may round differently, so they are compared with a tolerance.
    ref = decoder.new_kv_cache(1, 32)
    ref_slot = ref.allocate()
    forward(decoder, ref, ref_slot, prompt)
    forward(decoder, ref, ref_slot, block[:2])
    assert ref.length(ref_slot) == cache.length(slot)
    assert torch.equal(ref.keys[:, ref_slot, :, :5], cache.keys[:, slot, :, :5])
    assert torch.equal(ref.values[:, ref_slot, :, :5], cache.values[:, slot, :, :5])
    torch.testing.assert_close(ref.keys[:, ref_slot, :, :7], cache.keys[:, slot, :, :7], atol=ROLLBACK_ATOL, rtol=0)
    torch.testing.assert_close(ref.values[:, ref_slot, :, :7], cache.values[:, slot, :, :7], atol=ROLLBACK_ATOL, rtol=0)

    # The next forward overwrites the dropped tail and sees only the kept tokens.
    after = forward(decoder, cache, slot, [99])
    fresh_cache = decoder.new_kv_cache(1, 32)
    fresh = forward(decoder, fresh_cache, fresh_cache.allocate(), prompt + block[:2] + [99])
    torch.testing.assert_close(after[-1], fresh[-1], atol=ROLLBACK_ATOL, rtol=0)


def test_compact_keeps_a_tree_path_bitwise_and_continues_like_a_fresh_prefill(tiny_llama):
    decoder = load_decoder(tiny_llama)
    prefix = [3, 1, 4, 1, 5]
    # root 9 (the last sampled token), nodes 2 and 6 under it, 5 under 6
    tree, root, nodes = TokenTree((ROOT, ROOT, 1)), 9, [2, 6, 5]
    cache = decoder.new_kv_cache(1, 32)
    slot = cache.allocate()
    forward(decoder, cache, slot, prefix)
    forward(decoder, cache, slot, [root, *nodes], positions=tree.positions(len(prefix)).tolist(),
            mask=tree.attention_mask(len(prefix)))
    path = [len(prefix) + 0, len(prefix) + 2, len(prefix) + 3]  # root 9 → 6 → 5
    expected_keys = cache.keys[:, slot, :, path].clone()
    prefix_keys = cache.keys[:, slot, :, : len(prefix)].clone()
    cache.compact(slot, len(prefix), path)
    assert cache.length(slot) == len(prefix) + 3
    assert torch.equal(cache.keys[:, slot, :, len(prefix) : len(prefix) + 3], expected_keys)
    assert torch.equal(cache.keys[:, slot, :, : len(prefix)], prefix_keys)

    after = forward(decoder, cache, slot, [7])
    fresh_cache = decoder.new_kv_cache(1, 32)
    fresh = forward(decoder, fresh_cache, fresh_cache.allocate(), prefix + [9, 6, 5, 7])
    torch.testing.assert_close(after[-1], fresh[-1], atol=ROLLBACK_ATOL, rtol=0)


def test_compact_rejects_bad_positions():
    cache = KVCache(1, 1, 2, num_slots=1, max_len=8)
    slot = cache.allocate()
    cache.advance(slot, 6)
    for bad in ([4, 3], [1, 4], [4, 6]):
        with pytest.raises(ValueError, match="ascend"):
            cache.compact(slot, 2, bad)
    assert cache.length(slot) == 6
    cache.compact(slot, 2, [])
    assert cache.length(slot) == 2
