"""End to end on tiny models: the LLM API, greedy identity with transformers, stops, seeds, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from specdec import LLM, SamplingParams
from specdec.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.models.loader import load_decoder, load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def hf_greedy(model_dir, ids: list[int], max_new: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=256, pad_token_id=256)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=config)
    return out[0, len(ids):].tolist()


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.waiting and not engine.running
    assert engine.cache.num_free_slots == engine.cache.num_slots


@pytest.fixture(scope="module")
def llm(tiny_qwen) -> LLM:
    return LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=4)


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_greedy_matches_transformers_generate_in_a_batch(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), quantization=None, max_model_len=256, max_num_seqs=3)  # float32, as transformers
    prompts = ["def add(a, b):", "x", "The quick brown fox jumps over"]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        ids = llm.get_tokenizer().encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(model_dir, ids, GREEDY.max_tokens)
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert_engine_idle(llm)


def test_outputs_are_vllm_shaped(llm):
    [out] = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5))
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5
    m = out.metrics
    assert m.num_output_tokens == 5 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert 0 < m.ttft_s <= m.e2e_s and m.tpot_s > 0 and m.tokens_per_s > 0
    assert m.num_target_forwards == 5  # one prefill + four decode steps
    assert m.speculative_decoding is None


def test_stop_string_cuts_text_and_reports_it(llm):
    [free] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = free.outputs[0].text
    stop = text[10:13]
    first = text.find(stop)
    [out] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:first], "stop", stop)
    [out] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True))
    assert out.outputs[0].text == text[: first + len(stop)]
    assert free.outputs[0].token_ids[: len(out.outputs[0].token_ids)] == out.outputs[0].token_ids


def test_stop_token_ids_and_eos(tiny_qwen):
    decoder, tokenizer = load_decoder(tiny_qwen), load_tokenizer(tiny_qwen)
    config = EngineConfig(model=str(tiny_qwen), max_model_len=128)
    base = Engine(decoder, tokenizer, set(), config)
    [seq] = base.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    while base.has_unfinished():
        base.step()
    tokens = seq.output_token_ids
    target = tokens[4]
    cut = tokens.index(target) + 1

    as_eos = Engine(decoder, tokenizer, {target}, config)
    [eos_seq] = as_eos.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    as_stop = Engine(decoder, tokenizer, set(), config)
    [stop_seq] = as_stop.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))
    ignoring = Engine(decoder, tokenizer, {target}, config)
    [ignore_seq] = ignoring.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for engine in (as_eos, as_stop, ignoring):
        while engine.has_unfinished():
            engine.step()
        assert engine.cache.num_free_slots == engine.cache.num_slots
    assert (eos_seq.output_token_ids, eos_seq.finish_reason, eos_seq.stop_reason) == (tokens[:cut], "stop", None)
    assert (stop_seq.output_token_ids, stop_seq.finish_reason, stop_seq.stop_reason) == (tokens[:cut], "stop", target)
    assert (ignore_seq.output_token_ids, ignore_seq.finish_reason) == (tokens, "length")


def test_chunked_prefill_gives_the_same_greedy_tokens(tiny_qwen):
    decoder, tokenizer = load_decoder(tiny_qwen), load_tokenizer(tiny_qwen)
    prompt = list(range(30, 70))
    results = []
    for chunk in (512, 7):
        engine = Engine(decoder, tokenizer, set(), EngineConfig(model="m", max_model_len=128, max_prefill_chunk=chunk))
        [seq] = engine.add_request("r", prompt, GREEDY)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        results.append((seq.output_token_ids, steps))
    assert results[0][0] == results[1][0]
    assert results[1][1] - results[0][1] == 5  # 40 prompt tokens in chunks of 7 take 5 more steps


def test_generation_stops_at_max_model_len(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=16)
    [out] = llm.generate({"prompt_token_ids": list(range(10))}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    assert_engine_idle(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    [alone] = llm.generate("seeded", params)
    outs = llm.generate(["other prompt", "seeded", "third"], [SamplingParams(temperature=0.9, max_tokens=20), params, GREEDY])
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate("seeded", SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_samples_per_prompt(llm):
    [out] = llm.generate("multi", SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.metrics.num_output_tokens == 24


def test_stream_yields_growing_text_and_matches_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    chunks = [o.outputs[0].text for o in llm.stream("stream me", params)]
    [whole] = llm.generate("stream me", params)
    assert chunks[-1] == whole.outputs[0].text
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))
    stream = llm.stream("abandoned", SamplingParams(temperature=0, max_tokens=50))
    next(stream)
    stream.close()  # a client that goes away: the request is aborted, its slot returned
    assert_engine_idle(llm)


def test_chat_and_token_id_prompts(llm, tiny_qwen):
    [chat] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))
    expected = llm.get_tokenizer().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt_token_ids == expected
    bare = LLM(str(tiny_qwen), skip_tokenizer_init=True, max_model_len=64)
    [out] = bare.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate("text", GREEDY)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ("", GREEDY, "empty"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [7] * 300}, GREEDY, "max_model_len"),
        ({"prompt_token_ids": [1, 99999]}, GREEDY, "token ids"),
        (["a", "b"], [GREEDY], "2 prompts"),
        ([42], GREEDY, "a prompt is"),
        (["fine", {"prompt_token_ids": [7] * 300}], GREEDY, "max_model_len"),
    ],
)
def test_bad_input_raises_and_changes_nothing(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert_engine_idle(llm)
    [out] = llm.generate("still works", SamplingParams(temperature=0, max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


def test_unknown_model_and_unsupported_options(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'Qwen/Qwen2.5-0.5B'.*never downloads"):
        LLM("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="without config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="speculative_config"):
        LLM("qwen2.5-coder-0.5b", speculative_config={"method": "draft_model"})


@pytest.mark.parametrize("speculative", [None, {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}])
def test_logprobs_are_the_targets_log_softmax(tiny_qwen, tiny_qwen_draft, speculative):
    """Each output token's log-probability (and the top ones) under the target, speculating or not."""
    config = None if speculative is None else {**speculative, "model": str(tiny_qwen_draft)}
    llm = LLM(str(tiny_qwen), speculative_config=config, quantization=None, max_model_len=64)
    [out] = llm.generate("log me", SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=4), use_tqdm=False)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1].log_softmax(-1)
    for row, token, entry in zip(reference, out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert next(iter(entry)) == token  # the chosen token first
        top = set(row.topk(4).indices.tolist())
        assert top <= set(entry) and len(entry) <= 5
        for t, value in entry.items():
            assert value == pytest.approx(row[t].item(), abs=1e-4)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_token_budget_per_step(tiny_qwen, tiny_qwen_draft):
    """No forward takes in more than max_num_batched_tokens (drafts included); decoding sequences go first, so
    a long prompt arriving later is fed in budget-sized chunks; outputs are unchanged."""
    prompts = ["short", "a much longer prompt " * 6, "mid length prompt here"]
    params = SamplingParams(temperature=0, max_tokens=10)
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_qwen), quantization=None, max_model_len=128).generate(
        prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(tiny_qwen_draft), "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(tiny_qwen), speculative_config=spec, quantization=None, max_model_len=128, max_num_seqs=3,
              max_num_batched_tokens=8)
    fed = []
    forward = llm.engine.model.forward
    llm.engine.model.forward = lambda batch, cache: fed.append(len(batch.token_ids)) or forward(batch, cache)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(fed) <= 8 and max(fed) == 8
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(tiny_qwen), max_num_seqs=4, max_num_batched_tokens=2)
