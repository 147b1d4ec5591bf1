"""Speculation on the embedded models (1.5B target, 0.5B draft; n-gram and suffix on the 1.5B): greedy identity (slow)."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.bench.dataset import load_prompts, render

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("quantization", ["auto", None], ids=["default-formats", "float32"])
def test_greedy_speculation_matches_plain_on_the_embedded_pair(quantization):
    params = SamplingParams(temperature=0, max_tokens=128)
    llm = LLM("qwen2.5-coder-1.5b", quantization=quantization, max_model_len=1024, max_num_seqs=3)
    assert llm.config.quantization == ("int8" if quantization == "auto" else None)
    prompts = [{"prompt_token_ids": render(p, llm.get_tokenizer())} for p in load_prompts("code")[:3]]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    spec = LLM("qwen2.5-coder-1.5b", quantization=quantization, max_model_len=1024, max_num_seqs=3, speculative_config={
        "method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, "quantization": quantization,
        "adaptive": False})
    outputs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    for out in outputs:
        s = out.metrics.speculative_decoding
        assert s["num_spec_steps"] > 0 and s["num_accepted_tokens"] > 0
        assert out.metrics.num_target_forwards < len(out.outputs[0].token_ids)  # fewer target forwards than tokens


def test_adaptive_speculation_matches_plain_on_the_1_5b():
    """An edit task (copy-heavy), γ chosen by the adaptive controller (the default) from this machine's
    measured cost curves: greedy identity, and most tokens come from accepted drafts. The draft model comes first:
    it measures the pair's curves, which the lookups then read from the cache (the other way round, the target's
    curve was measured twice)."""
    params = SamplingParams(temperature=0, max_tokens=128)
    outputs = {}
    for name, config in [("plain", None), ("draft_model", {"method": "draft_model", "num_speculative_tokens": 8}),
                         ("ngram", {"method": "ngram", "num_speculative_tokens": 8,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
                         ("suffix", {"method": "suffix", "num_speculative_tokens": 16})]:
        llm = LLM("qwen2.5-coder-1.5b", max_model_len=1024, speculative_config=config)
        prompt = render(load_prompts("edit")[0], llm.get_tokenizer())
        [outputs[name]] = llm.generate({"prompt_token_ids": prompt}, params)
        del llm
    for name in ("ngram", "suffix", "draft_model"):
        out = outputs[name]
        assert out.outputs[0].token_ids == outputs["plain"].outputs[0].token_ids
        assert out.metrics.num_target_forwards < len(out.outputs[0].token_ids) / 2, name


def test_generate_speculates_by_default_with_the_embedded_pair(capsys):
    """`specdec generate PROMPT` (the README's first command): the 0.5B drafts for the 1.5B with adaptive γ by
    default, and the greedy text is plain decoding's (`--method none`)."""
    from specdec.cli import main

    args = ["generate", "def quicksort(arr):", "--max-tokens", "48", "--json"]
    assert main(args) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert speculative["token_ids"] == plain["token_ids"]
    sd = speculative["metrics"]["speculative_decoding"]
    assert sd["num_spec_steps"] > 0 and plain["metrics"]["speculative_decoding"] is None


def test_medusa_and_eagle_trees_match_plain_on_the_1_5b(tmp_path):
    """Medusa heads and an EAGLE layer trained for a minute each (a small corpus read once by the target) guess often
    enough that steps accept and reject tree nodes; greedy identity with plain decoding on code prompts (int8 target,
    the default)."""
    from specdec.training.data import CorpusConfig
    from specdec.training.eagle import EagleTrainingConfig, train_eagle
    from specdec.training.medusa import MedusaTrainingConfig, train_medusa

    params = SamplingParams(temperature=0, max_tokens=96)
    llm = LLM("qwen2.5-coder-1.5b", max_model_len=1024, max_num_seqs=3)
    corpus = CorpusConfig(corpus_tokens=6000, generated_tokens=0)
    train_medusa(llm, tmp_path / "heads", corpus, MedusaTrainingConfig(num_heads=3, vocab_size=8192, epochs=1))
    train_eagle(llm, tmp_path / "eagle", corpus, EagleTrainingConfig(vocab_size=8192, epochs=4, learning_rate=1e-3),
                data=tmp_path / "heads" / "data")
    prompts = [{"prompt_token_ids": render(p, llm.get_tokenizer())} for p in load_prompts("code")[:3]]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    for config in ({"method": "medusa", "model": str(tmp_path / "heads"),
                    "speculative_token_tree": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]},
                   {"method": "eagle", "model": str(tmp_path / "eagle"), "speculative_eagle_topk": 3,
                    "speculative_num_draft_tokens": 7, "num_speculative_tokens": 3}):
        spec = LLM("qwen2.5-coder-1.5b", max_model_len=1024, max_num_seqs=3,
                   speculative_config={**config, "adaptive": False})
        outputs = spec.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == plain, config["method"]
        accepted = sum(o.metrics.speculative_decoding["num_accepted_tokens"] for o in outputs)
        assert accepted > 0.1 * sum(len(o.outputs[0].token_ids) for o in outputs), config["method"]
        del spec
