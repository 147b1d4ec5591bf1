"""Medusa heads end to end on tiny models: greedy identity with trees and chains, the sampled distribution
through tree verification, typical acceptance, the checkpoint layouts, configuration errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from specdec import LLM, SamplingParams
from specdec.models.loader import load_hf_config
from specdec.models.medusa import MedusaConfig, MedusaHeads

PROMPTS = ["abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "x"]
CHAIN = [(0,), (0, 0), (0, 0, 0)]


def random_heads(target_dir, directory, num_heads: int = 4, vocab: list[int] | None = None, scale: float = 0.3):
    """Heads with random blocks: their guesses are often wrong and sometimes right, which is what identity and
    distribution tests need (good heads are not)."""
    config = MedusaConfig(num_heads, load_hf_config(target_dir).hidden_size)
    heads = MedusaHeads(config, None if vocab is None else torch.tensor(vocab))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) * scale / config.hidden_size**0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=g) * scale)
    heads.save(directory)
    return directory


@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]


@pytest.mark.parametrize("tree", [None, CHAIN, [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]],
                         ids=["default-tree", "chain", "wide-tree"])
@pytest.mark.parametrize("vocab", [None, "reduced"])
def test_greedy_output_is_token_identical_to_plain(tree, vocab, tiny_qwen, plain_greedy, tmp_path):
    reduced = None if vocab is None else list(range(0, 256, 2))  # half the byte tokenizer's ids
    heads = random_heads(tiny_qwen, tmp_path / "heads", vocab=reduced)
    config = {"method": "medusa", "model": str(heads), "adaptive": False}
    if tree is not None:
        config["speculative_token_tree"] = tree
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3, speculative_config=config)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    assert sum(s["num_spec_steps"] for s in stats) > 0 and sum(s["num_accepted_tokens"] for s in stats) > 0
    for out, s in zip(outputs, stats):
        assert s["num_accepted_tokens"] + out.metrics.num_target_forwards == len(out.outputs[0].token_ids)
        # every step counted once by depth and once by nodes verified; a tree verifies more nodes than its depth
        nodes = sum(k * n for k, n in enumerate(s["verified_histogram"]))
        assert sum(s["verified_histogram"]) == sum(s["gamma_histogram"]) and nodes >= s["num_draft_tokens"]
        assert (nodes > s["num_draft_tokens"]) == (tree != CHAIN and s["num_spec_steps"] > 0)
    assert not llm.engine.running and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots


def test_typical_acceptance_at_temperature_zero_is_greedy(tiny_qwen, plain_greedy, tmp_path):
    heads = random_heads(tiny_qwen, tmp_path / "heads")
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3, speculative_config={
        "method": "medusa", "model": str(heads), "acceptance_method": "typical_acceptance_sampler"})
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy


@pytest.mark.parametrize("case", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["temperature-1", "temperature-0.7-top-k-5"])
@pytest.mark.parametrize("tree", [CHAIN, [(0,), (1,), (2,), (0, 0), (1, 0)]], ids=["chain", "tree"])
def test_first_two_tokens_are_distributed_as_the_target(tree, case, small_vocab_pair, tmp_path):
    """The second token is verified against the heads' candidates (the first comes from the prompt's forward):
    20k samples vs the exact P(t1, t2)."""
    target, _ = small_vocab_pair
    heads = random_heads(target, tmp_path / "heads", scale=1.0)
    params = SamplingParams(n=NUM_SAMPLES, temperature=case.temperature, top_k=case.top_k, max_tokens=3, seed=7,
                            ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    config = {"method": "medusa", "model": str(heads), "speculative_token_tree": tree, "adaptive": False}
    counts, stats = sampled_first_two(target, config, params, prompt)
    accepted_steps = stats["acceptance_histogram"][0]  # steps that accepted a candidate
    assert 100 < accepted_steps < stats["num_spec_steps"] - 100  # accepted and rejected candidates both ran
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


def test_typical_acceptance_is_lossy_and_reported_so(small_vocab_pair, tmp_path):
    """A lax threshold accepts candidates the target seldom picks: the distribution moves (which is why it is
    opt-in)."""
    target, _ = small_vocab_pair
    heads = random_heads(target, tmp_path / "heads", scale=1.0)
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=3, seed=7, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    config = {"method": "medusa", "model": str(heads), "speculative_token_tree": [(0,), (1,), (2,)], "adaptive": False,
              "acceptance_method": "typical_acceptance_sampler", "typical_acceptance_sampler_posterior_threshold": 0.01,
              "typical_acceptance_sampler_posterior_alpha": 0.01}
    counts, _ = sampled_first_two(target, config, params, prompt)
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) < 1e-6


def test_heads_checkpoint_round_trip_and_original_layout(tmp_path):
    heads = MedusaHeads(MedusaConfig(3, 8, num_layers=2, base_model="m"), torch.tensor([5, 1, 7]))
    with torch.no_grad():
        heads.weight.normal_()
        heads.bias.normal_()
    heads.save(tmp_path / "ours")
    again = MedusaHeads.load(tmp_path / "ours")
    assert again.config == heads.config and torch.equal(again.vocab, heads.vocab)
    assert torch.equal(again.weight, heads.weight) and torch.equal(again.bias, heads.bias)
    # the original Medusa code's layout: ResBlocks `{k}.{l}.linear`, then each head's own output layer `{k}.{L}`
    original = tmp_path / "original"
    original.mkdir()
    tensors = {f"{k}.{l}.linear.{p}": getattr(heads, p)[k, l].contiguous() for k in range(3) for l in range(2)
               for p in ("weight", "bias")}
    tensors |= {f"{k}.2.weight": torch.zeros(11, 8) for k in range(3)}
    save_file(tensors, str(original / "medusa_lm_head.safetensors"))
    (original / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2}))
    loaded = MedusaHeads.load(original)
    assert loaded.config.num_heads == 3 and loaded.config.num_layers == 2 and loaded.vocab is None
    assert torch.equal(loaded.weight, heads.weight) and torch.equal(loaded.bias, heads.bias)


def test_zero_heads_guess_the_targets_next_token(tiny_qwen):
    """Untrained (zero) blocks are the identity: every head starts from the LM head's own guess."""
    heads = MedusaHeads(MedusaConfig(2, 4))
    hidden = torch.randn(5, 4)
    assert torch.equal(heads(hidden), hidden[:, None].expand(-1, 2, -1))


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "model": "/nonexistent/heads"}, "no Medusa heads"),
    ({"method": "medusa", "speculative_token_tree": "[(0,), (0, 0"}, "speculative_token_tree"),
    ({"method": "medusa", "speculative_token_tree": [(0,), (1, 0)]}, "no parent choice"),
    ({"method": "medusa", "acceptance_method": "best_guess"}, "acceptance_method"),
    ({"method": "medusa", "typical_acceptance_sampler_posterior_threshold": 2}, "posterior_threshold"),
])
def test_bad_config(config, message, tiny_qwen, tmp_path):
    if "model" not in config and "no parent" in message:
        config = {**config, "model": str(random_heads(tiny_qwen, tmp_path / "heads"))}
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), quantization=None, speculative_config=config)


def test_a_given_tree_deeper_than_the_heads_is_refused_the_default_one_is_cut(tiny_qwen, tmp_path):
    heads = random_heads(tiny_qwen, tmp_path / "heads", num_heads=2)
    with pytest.raises(ValueError, match="predict 2"):
        LLM(str(tiny_qwen), quantization=None, speculative_config={
            "method": "medusa", "model": str(heads), "speculative_token_tree": CHAIN})
    llm = LLM(str(tiny_qwen), quantization=None, speculative_config={"method": "medusa", "model": str(heads)})
    assert llm.engine.proposer.tree.max_depth == 2


def test_vllm_style_config():
    from specdec.config import DEFAULT_MEDUSA_TREE, SpeculativeConfig

    default = SpeculativeConfig("medusa")
    assert default.speculative_token_tree is None and default.num_speculative_tokens == max(map(len, DEFAULT_MEDUSA_TREE))
    given = SpeculativeConfig("medusa", speculative_token_tree="[(0,), (0, 0), (1,)]")
    assert given.speculative_token_tree == ((0,), (0, 0), (1,)) and given.num_speculative_tokens == 2
    assert SpeculativeConfig("medusa", 1).num_speculative_tokens == 1


def test_adaptive_tree_depth_keeps_greedy_identity(tiny_qwen, plain_greedy, tmp_path):
    """The controller picks each step's tree depth (a tree priced by its node count); output stays plain's."""
    from specdec.engine.adaptive import AdaptiveGamma, StepCosts
    from test_adaptive import FLAT

    heads = random_heads(tiny_qwen, tmp_path / "heads")
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "medusa", "model": str(heads)})
    llm.engine.controller = AdaptiveGamma(StepCosts(FLAT), calibration_weight=0.0)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    depths = [sum(col) for col in zip(*[o.metrics.speculative_decoding["gamma_histogram"] + [0] * 5 for o in outputs])]
    assert sum(d > 0 for d in depths[1:]) >= 2  # steps drafted trees of different depths
