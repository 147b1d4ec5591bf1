"""The embedded Qwen2.5-Coder 0.5B against transformers on the same weights (slow: real weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from specdec import LLM, SamplingParams
from specdec.bench.dataset import load_prompts, render
from specdec.models import zoo
from specdec.models.batch import ForwardBatch, SequenceInput

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-0.5b"
# Logits reach ~±30; 24 float32 layers summed in another order than transformers' drift by ~1e-4.
LOGITS_ATOL = 2e-3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, quantization=None, max_model_len=1024)  # float32, compared with transformers


@pytest.fixture(scope="module")
def hf_model(llm):
    model_dir = zoo.converted_dir(zoo.EMBEDDED_MODELS[MODEL])
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_embedded_gguf_matches_pinned_checksum(llm):  # loading the model assembles and converts it
    model = zoo.EMBEDDED_MODELS[MODEL]
    path = zoo.gguf_path(model)
    assert path.stat().st_size == model.size
    assert zoo.status(model)["assembled"] and zoo.status(model)["converted"]


def test_logits_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode("import numpy as np\n\ndef moving_average(x, window):\n    ")
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0]
    decoder = llm.engine.model
    cache = decoder.new_kv_cache(1, 128)
    slot = cache.allocate()
    prefill = decoder.forward(ForwardBatch.build([SequenceInput(slot, ids[:-3])], [0]), cache).logits
    steps = [decoder.forward(ForwardBatch.build([SequenceInput(slot, [t])], [cache.length(slot)]), cache).logits for t in ids[-3:]]
    got = torch.cat([prefill, *steps])
    torch.testing.assert_close(got, reference, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def test_greedy_64_tokens_identical_to_transformers_generate(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    prompts = [render(p, tokenizer) for p in load_prompts("code")[:3]]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], SamplingParams(temperature=0, max_tokens=64))
    config = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=sorted(llm.engine.rules.eos_token_ids),
                              pad_token_id=tokenizer.eos_token_id)
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          generation_config=config)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == reference
        assert len(reference) == 64 or reference[-1] in llm.engine.rules.eos_token_ids
