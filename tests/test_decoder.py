"""The native decoder against transformers on the same weights, and its batch/mask contract."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.linear import DenseLinear, float32_linear
from specdec.models.loader import load_decoder
from specdec.spec.tree import ROOT, TokenTree

# float32 through a few layers: differences come only from summation order.
ATOL = 2e-5


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def run(decoder, cache, inputs, **kwargs):
    batch = ForwardBatch.build(inputs, [cache.length(s.slot) for s in inputs], **kwargs)
    return decoder.forward(batch, cache)


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama", "tiny_mistral"])
def test_logits_match_transformers_prefill_then_decode(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = hf_logits(model_dir, ids)
    decoder = load_decoder(model_dir)
    cache = decoder.new_kv_cache(num_slots=2, max_len=64)
    slot = cache.allocate()
    parts = [run(decoder, cache, [SequenceInput(slot, ids[:10])]).logits]
    parts += [run(decoder, cache, [SequenceInput(slot, ids[10:13])]).logits]
    for token in ids[13:]:
        parts.append(run(decoder, cache, [SequenceInput(slot, [token])]).logits)
    got = torch.cat(parts)
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference, atol=ATOL, rtol=0)
    assert cache.length(slot) == len(ids)


def test_uneven_batch_equals_separate_forwards(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 1, 12)]
    batched_cache = decoder.new_kv_cache(3, 32)
    slots = [batched_cache.allocate() for _ in prompts]
    batched = run(decoder, batched_cache, [SequenceInput(s, p) for s, p in zip(slots, prompts)])
    start = 0
    for prompt in prompts:
        cache = decoder.new_kv_cache(1, 32)
        alone = run(decoder, cache, [SequenceInput(cache.allocate(), prompt)]).logits
        torch.testing.assert_close(batched.logits[start : start + len(prompt)], alone, atol=ATOL, rtol=0)
        start += len(prompt)


def test_last_logits_only_and_hidden_layers(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    cache = decoder.new_kv_cache(2, 32)
    a, b = cache.allocate(), cache.allocate()
    out = run(decoder, cache, [SequenceInput(a, [1, 2, 3], num_logits=1), SequenceInput(b, [4, 5], num_logits=2)], hidden_layers=(0,))
    assert out.logits.shape == (3, decoder.config.vocab_size)
    assert out.hidden.shape == (5, decoder.config.hidden_size)
    assert set(out.layer_hidden) == {0} and out.layer_hidden[0].shape == (5, decoder.config.hidden_size)
    full_cache = decoder.new_kv_cache(1, 32)
    full = run(decoder, full_cache, [SequenceInput(full_cache.allocate(), [1, 2, 3])])
    torch.testing.assert_close(out.logits[0], full.logits[-1], atol=ATOL, rtol=0)
    pair_cache = decoder.new_kv_cache(1, 32)
    pair = run(decoder, pair_cache, [SequenceInput(pair_cache.allocate(), [4, 5])])
    torch.testing.assert_close(out.logits[1:], pair.logits, atol=ATOL, rtol=0)


def test_tree_mask_and_positions_give_each_branch_its_chain_logits(tiny_llama):
    """A tree of new tokens in one forward: every node's logits equal those of its root→node chain."""
    decoder = load_decoder(tiny_llama)
    prefix = [10, 20, 30]
    # the root 40 (last sampled token); nodes 50 under it, 60 and 70 under 50, 80 under 70
    tree, root, nodes = TokenTree((ROOT, 0, 0, 2)), 40, [50, 60, 70, 80]
    cache = decoder.new_kv_cache(1, 32)
    slot = cache.allocate()
    run(decoder, cache, [SequenceInput(slot, prefix)])
    inputs = SequenceInput(slot, [root, *nodes], positions=tree.positions(len(prefix)).tolist(),
                           mask=tree.attention_mask(len(prefix)), num_logits=1 + tree.num_nodes)
    logits = run(decoder, cache, [inputs]).logits
    for row, chain in [(0, [40]), (1, [40, 50]), (2, [40, 50, 60]), (3, [40, 50, 70]), (4, [40, 50, 70, 80])]:
        reference = hf_logits(tiny_llama, prefix + chain)[-1]
        torch.testing.assert_close(logits[row], reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_every_tree_row_is_bitwise_its_one_token_step(tiny_qwen, quantization):
    """Each node sees the cache and its ancestors laid out as a one-token step after them would: its logits are
    bitwise that step's (what makes greedy tree speculation token-identical to plain decoding), the first branch
    and the others alike, and the cache holds every node's keys and values in node order afterwards."""
    decoder = load_decoder(tiny_qwen, quantization=quantization)
    prefix = [10, 20, 30]
    tree, root, nodes = TokenTree.from_choices([(0,), (0, 0), (1,), (0, 1), (1, 0), (0, 1, 0)]), 40, [50, 60, 70, 80, 90, 99]
    cache = decoder.new_kv_cache(2, 32)
    slot = cache.allocate()
    run(decoder, cache, [SequenceInput(slot, prefix)])
    logits = run(decoder, cache, [SequenceInput(slot, [root, *nodes], positions=tree.positions(len(prefix)).tolist(),
                                                mask=tree.attention_mask(len(prefix)), num_logits=1 + len(nodes))]).logits
    tree_keys = cache.keys[:, slot, :, : len(prefix) + 1 + len(nodes)].clone()
    for row, node in enumerate([None, *range(len(nodes))]):
        chain = [root] + ([] if node is None else [nodes[j] for j in tree.path_to(node)])
        steps = cache.allocate()
        run(decoder, cache, [SequenceInput(steps, prefix)])
        for token in chain:
            step = run(decoder, cache, [SequenceInput(steps, [token])]).logits[0]
        assert torch.equal(logits[row], step), row
        position = len(prefix) + (0 if node is None else 1 + node)
        assert torch.equal(tree_keys[:, :, position], cache.keys[:, steps, :, len(prefix) + len(chain) - 1]), row
        cache.free(steps)


def test_forward_past_the_slot_is_refused_without_writing(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    cache = decoder.new_kv_cache(1, 8)
    slot = cache.allocate()
    run(decoder, cache, [SequenceInput(slot, [1, 2, 3, 4, 5])])
    before = cache.keys.clone()
    with pytest.raises(ValueError, match="max_model_len"):
        run(decoder, cache, [SequenceInput(slot, [1, 2, 3, 4])])
    assert cache.length(slot) == 5
    assert torch.equal(cache.keys[:, :, :, :5], before[:, :, :, :5])


def test_batch_build_rejects_bad_shapes():
    with pytest.raises(ValueError, match="no new tokens"):
        ForwardBatch.build([SequenceInput(0, [])], [0])
    with pytest.raises(ValueError, match="mask must be"):
        ForwardBatch.build([SequenceInput(0, [1, 2], mask=torch.ones(2, 2, dtype=torch.bool))], [3])
    with pytest.raises(ValueError, match="num_logits"):
        ForwardBatch.build([SequenceInput(0, [1, 2], num_logits=3)], [0])
    with pytest.raises(ValueError, match="positions"):
        ForwardBatch.build([SequenceInput(0, [1, 2], positions=[0])], [0])


def test_packed_and_dense_kernels_agree(tiny_qwen):
    packed, dense = load_decoder(tiny_qwen), load_decoder(tiny_qwen, prepack=False)
    kernel = float32_linear()
    assert isinstance(packed.layers[0].qkv, kernel) and isinstance(packed.lm_head, kernel)
    assert isinstance(dense.layers[0].qkv, DenseLinear)
    ids = list(range(40, 60))
    logits = []
    for decoder in (packed, dense):
        cache = decoder.new_kv_cache(1, 32)
        logits.append(run(decoder, cache, [SequenceInput(cache.allocate(), ids)]).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)


def test_rope_rows_come_from_a_table_bitwise_as_computed(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    for positions in (torch.tensor([5]), torch.arange(300, 316), torch.tensor([0, 1023, 1024, 5000])):
        cos, sin = decoder.rope(positions)
        # the formula on just these positions, as before the table
        freqs = positions[:, None].float() * decoder.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        assert torch.equal(cos, emb.cos() * decoder.attention_scaling)
        assert torch.equal(sin, emb.sin() * decoder.attention_scaling)
    assert len(decoder.rope(torch.tensor([9000]))[0]) == 1
