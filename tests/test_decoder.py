"""The native decoder against transformers on the same weights, and its batch/mask contract."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.models import kernels
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder
from specdec.models.linear import (
    Avx2Int8Linear,
    DenseLinear,
    PanelLinear,
    float32_linear,
    gate_up_product,
    int8_linear,
)
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


def test_one_call_attention_mask_is_made_once_bitwise_as_pytorchs_bool_mask(tiny_qwen, monkeypatch):
    """Without the row kernel (CUDA, other dtypes), prefill chunks and masks that are not trees of few rows attend in
    one call per layer, with an additive mask made once a forward: every output and the cache bitwise what PyTorch's
    attention gives for the bool mask."""
    decoder = load_decoder(tiny_qwen)
    decoder.row_attention = decoder.layer_stack = None
    n = decoder.row_invariant_tokens + 6
    # not causal: each new token sees the cache, the even-numbered new tokens before it and itself
    sparse = torch.ones(n, 2 * n, dtype=torch.bool).tril(diagonal=n)
    sparse[:, n:] &= (torch.arange(n) % 2 == 0)[None, :] | torch.eye(n, dtype=torch.bool)

    def outputs() -> list[torch.Tensor]:
        cache = decoder.new_kv_cache(num_slots=1, max_len=4 * n)
        slot = cache.allocate()
        first = run(decoder, cache, [SequenceInput(slot, list(range(n)), num_logits=n)])  # after nothing cached
        second = run(decoder, cache, [SequenceInput(slot, list(range(50, 50 + n)), num_logits=n, mask=sparse)])
        third = run(decoder, cache, [SequenceInput(slot, list(range(90, 90 + n)), num_logits=n)])  # after 2n
        kept = [c[:, slot, :, : cache.length(slot)] for c in (cache.keys, cache.values)]
        return [first.logits, second.logits, third.logits, *kept]

    made_once = outputs()
    group = decoder.config.num_heads // decoder.config.num_kv_heads
    monkeypatch.setattr(decoder, "_additive_mask", lambda seen: seen.repeat(group, 1))
    for got, expected in zip(made_once, outputs(), strict=True):
        assert torch.equal(got, expected)


class _CountingStack:
    """A decoder's layer loop that counts its forwards."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def _steps(decoder) -> list:
    """Prefills, a batched decode/verify step with intermediate layers, a tree and a long chunk: every output and the
    caches after them."""
    cache = decoder.new_kv_cache(num_slots=3, max_len=128)
    a, b = cache.allocate(), cache.allocate()
    outputs = [run(decoder, cache, [SequenceInput(a, list(range(10, 20))), SequenceInput(b, [7, 8, 9])])]
    last = decoder.config.num_layers - 1
    outputs.append(run(decoder, cache, [SequenceInput(a, [21]), SequenceInput(b, [30, 31, 32, 33], num_logits=2)],
                       hidden_layers=(0, last)))
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0)])
    cached = cache.length(a)
    outputs.append(run(decoder, cache, [SequenceInput(a, [40, 41, 42, 43, 44], positions=tree.positions(cached).tolist(),
                                                      mask=tree.attention_mask(cached))]))
    outputs.append(run(decoder, cache, [SequenceInput(b, list(range(100, 170)))]))  # over row_invariant_tokens
    outputs.append(run(decoder, cache, [SequenceInput(b, [5])]))
    tensors = [c[:, slot, :, : cache.length(slot)] for slot in (a, b) for c in (cache.keys, cache.values)]
    for output in outputs:
        tensors += [output.logits, output.hidden, *output.layer_hidden.values()]
        tensors.append(torch.tensor(sorted(output.layer_hidden)))
    return tensors


def _with_linears(source: Decoder, make_linear) -> Decoder:
    """`source` (dense float32 weights) with every layer's products made by `make_linear(weight, bias)` (the gate/up
    product applying SwiGLU where that kernel offers it, as the loader makes it)."""
    layers = [dataclasses.replace(layer, **{name: make_linear(getattr(layer, name).weight, getattr(layer, name).bias)
                                            for name in ("qkv", "o", "down")},
                                  gate_up=gate_up_product(make_linear, layer.gate_up.weight, layer.gate_up.bias))
              for layer in source.layers]
    return Decoder(source.config, source.embed, layers, source.final_norm, source.lm_head, source.inv_freq)


LINEAR_KERNELS = [
    pytest.param(lambda: float32_linear(), id="float32"),
    pytest.param(lambda: functools.partial(PanelLinear, isa=kernels.AVX2), id="float32-avx2",
                 marks=pytest.mark.skipif(kernels.fp32_linear(kernels.AVX2) is None, reason="no AVX2 float32 kernel")),
    pytest.param(lambda: int8_linear(), id="int8"),
    pytest.param(lambda: Avx2Int8Linear, id="int8-avx2",
                 marks=pytest.mark.skipif(kernels.int8_avx2() is None, reason="no AVX2 int8 kernel")),
]


@pytest.mark.parametrize("kernel", LINEAR_KERNELS)
def test_layer_loop_is_bitwise_the_python_loop(tiny_qwen, kernel):
    """Forwards whose rows all take the row attention kernel run their layers in one C++ call (layer_loop.cpp) over
    each kernel's C++ entry; its logits, hidden states, intermediate layers and KV cache are bitwise the Python loop's,
    for batched steps, trees and a chunk longer than `row_invariant_tokens` (causal: its rows take the kernel too)."""
    source = load_decoder(tiny_qwen, prepack=False)
    native, python = (_with_linears(source, kernel()) for _ in range(2))
    if native.layer_stack is None:
        pytest.skip("no layer loop on this CPU (or no compiler)")
    python.layer_stack = None
    native.layer_stack = counting = _CountingStack(native.layer_stack)
    expected, got = _steps(python), _steps(native)
    assert counting.calls == 5  # every forward
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), index


def test_layer_loop_without_norms_is_bitwise_the_python_loop(tiny_qwen):
    """A layer that reads its input unnormalized and no final norm (EAGLE-1's draft layer): the same bits as Python."""
    source = load_decoder(tiny_qwen)
    layer = dataclasses.replace(source.layers[0], input_norm=None)
    config = dataclasses.replace(source.config, num_layers=1)
    decoders = [Decoder(config, source.embed, [layer], None, source.lm_head, source.inv_freq) for _ in range(2)]
    if decoders[0].layer_stack is None:
        pytest.skip("no layer loop on this CPU (or no compiler)")
    decoders[1].layer_stack = None
    outputs = []
    for decoder in decoders:
        cache = decoder.new_kv_cache(1, 16)
        slot = cache.allocate()
        outputs.append([run(decoder, cache, [SequenceInput(slot, ids)]).hidden for ids in ([1, 2, 3], [4], [5, 6])])
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


def test_layer_loop_refuses_a_wrong_entry_or_rows(tiny_qwen):
    decoder = load_decoder(tiny_qwen)
    if decoder.layer_stack is None:
        pytest.skip("no layer loop on this CPU (or no compiler)")
    layer, norms = decoder.layers[0], decoder.norm_swiglu
    swapped = (layer.input_norm, layer.qkv.entry, layer.o.entry, layer.post_norm, layer.gate_up.entry,
               (norms.swiglu_entry, [], 1), False)
    with pytest.raises(RuntimeError, match="specdec.entry.linear"):
        kernels.layer_loop().LayerStack([swapped], None, 1e-6, 1.0, decoder.row_attention.attend_entry,
                                        norms.rms_norm_entry, norms.add_rms_norm_entry, norms.swiglu_entry)
    cache = decoder.new_kv_cache(1, 16)
    x, (cos, sin) = torch.zeros(2, decoder.config.hidden_size), decoder.rope(torch.arange(2))
    with pytest.raises(RuntimeError, match="the sequences hold 1 rows, x 2"):
        decoder.layer_stack.forward(x, cos, sin, [(1, 0, [], cache.layer_views(cache.allocate()))], [])
