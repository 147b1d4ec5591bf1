"""Proposers that draft from the context (n-gram prompt lookup, suffix decoding) end to end on tiny
models: greedy identity, the sampled distribution, plain steps where nothing matches, configuration."""

from __future__ import annotations

import pytest

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from test_adaptive import cheap_speculation
from specdec import LLM, SamplingParams

PROMPTS = ["abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "x"]
CONFIGS = {
    "ngram-1-3": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "ngram-default": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "suffix-factor-2": {"method": "suffix", "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.0},
    "suffix-tree": {"method": "suffix", "suffix_decoding_speculate_tree": True, "suffix_decoding_min_token_prob": 0.0},
}


@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_output_is_token_identical_to_plain(name, gamma, adaptive, tiny_qwen, plain_greedy):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={**CONFIGS[name], "num_speculative_tokens": gamma, "adaptive": adaptive})
    if adaptive:
        # a tiny model's steps are mostly Python overhead, which its measured cost curve and step-time calibration
        # would price (rightly: decode plain) depending on the machine's timing; this test needs drafts accepted
        # and rejected, so the controller gets verification priced as on a GPU
        llm.engine.controller = cheap_speculation(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    assert 0 < sum(s["num_accepted_tokens"] for s in stats) < sum(s["num_draft_tokens"] for s in stats)
    for out, s in zip(outputs, stats):
        assert max(s["num_draft_tokens"] / max(1, s["num_spec_steps"]), 0) <= gamma
        assert s["num_accepted_tokens"] + out.metrics.num_target_forwards == len(out.outputs[0].token_ids)
    assert not llm.engine.running and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots


def test_no_match_means_plain_steps(tiny_qwen):
    """Distinct prompt tokens and a 6-gram minimum: nothing to copy, every step is a plain step."""
    llm = LLM(str(tiny_qwen), quantization=None, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6})
    [out] = llm.generate("abcdefgh", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out.metrics.speculative_decoding["num_spec_steps"] == 0
    assert out.metrics.num_target_forwards == 6


@pytest.mark.parametrize("case", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["temperature-1", "temperature-0.7-top-k-5"])
@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 0.0, "adaptive": False,
     "suffix_decoding_speculate_tree": True},
], ids=["ngram", "suffix", "suffix-tree"])
def test_first_two_tokens_are_distributed_as_the_target(config, case, small_vocab_pair):
    """A repeating prompt whose copy the target takes about half the time (found by trying random
    patterns), so copies are drafted at every step; 20k samples vs the exact P(t1, t2)."""
    target, _ = small_vocab_pair
    params = SamplingParams(n=NUM_SAMPLES, temperature=case.temperature, top_k=case.top_k, max_tokens=4, seed=7,
                            ignore_eos=True)
    prompt = [12, 4, 8, 12, 4, 8, 12, 4]
    counts, stats = sampled_first_two(target, config, params, prompt)
    assert 0.05 < stats["draft_acceptance_rate"] < 0.95  # accepted and rejected copies both ran
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "qwen2.5-coder-0.5b"}, "takes no model"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
    ],
)
def test_bad_config(config, message, tiny_qwen):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), speculative_config=config)


def test_vllm_defaults():
    from specdec.config import SpeculativeConfig

    assert (SpeculativeConfig("ngram", 3).prompt_lookup_min, SpeculativeConfig("ngram", 3).prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig("ngram", 3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig("suffix").num_speculative_tokens == 24  # γ defaults to the tree depth


@pytest.mark.parametrize("name", ["ngram-1-3", "suffix"])
def test_seeded_sampling_gives_plain_decodings_text_whatever_the_lookup_drafts(name, tiny_qwen):
    """At temperature > 0 the target draws each position's token from a uniform fixed by the seed and the position
    (spec/verifier.py): a seeded request's text is plain decoding's, token for token, for every γ and schedule —
    and adaptive γ is compared with fixed γ on the same text."""
    params = SamplingParams(temperature=0.5, top_k=8, max_tokens=60, ignore_eos=True, seed=11)
    plain = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    accepted = rejected = 0
    for gamma, adaptive in [(1, False), (3, False), (8, False), (8, True)]:
        llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
                  speculative_config={**CONFIGS[name], "num_speculative_tokens": gamma, "adaptive": adaptive})
        if adaptive:
            llm.engine.controller = cheap_speculation(llm)  # as in the greedy test: drafts, whatever the timing
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, (gamma, adaptive)
        stats = [o.metrics.speculative_decoding for o in outputs]
        accepted += sum(s["num_accepted_tokens"] for s in stats)
        rejected += sum(s["num_draft_tokens"] - s["num_accepted_tokens"] for s in stats)
    assert accepted > 5 and rejected > 20, (accepted, rejected)  # drafts were accepted and rejected
