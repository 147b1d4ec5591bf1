"""Draft-model speculation on the embedded pair (1.5B target, 0.5B draft): greedy identity (slow)."""

from __future__ import annotations

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
        "method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, "quantization": quantization})
    outputs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    for out in outputs:
        s = out.metrics.speculative_decoding
        assert s["num_spec_steps"] > 0 and s["num_accepted_tokens"] > 0
        assert out.metrics.num_target_forwards < len(out.outputs[0].token_ids)  # fewer target forwards than tokens
