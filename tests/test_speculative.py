"""Draft-model speculation end to end on tiny models: lossless, greedy-identical, stops, rollback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from specdec import LLM, SamplingParams
from specdec.engine import engine as engine_module
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.spec.verifier import Verified

PROMPTS = ["def add(a, b):", "x", "The quick brown fox jumps over"]


# float32 target and draft throughout: the exact distributions come from transformers' float32 forward
# (int8 speculation: test_quantization.py)
def draft_config(draft, gamma: int = 3) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": gamma, "quantization": None,
            "adaptive": False}


def spec_llm(target, draft, gamma, **kw) -> LLM:
    return LLM(str(target), speculative_config=draft_config(draft, gamma), quantization=None, **kw)


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.waiting and not engine.running
    assert engine.cache.num_free_slots == engine.cache.num_slots
    assert engine.proposer.cache.num_free_slots == engine.proposer.cache.num_slots


# --- greedy identity ---------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=128, max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_speculation_is_token_identical_to_plain(gamma, tiny_qwen, tiny_qwen_draft, plain_greedy):
    llm = spec_llm(tiny_qwen, tiny_qwen_draft, gamma, max_model_len=128, max_num_seqs=3)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    drafted = sum(s["num_draft_tokens"] for s in stats)
    assert 0 < accepted < drafted  # the near draft is right often, wrong sometimes: both paths run
    for out, s in zip(outputs, stats):
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_spec_steps"])
        # every target forward emits its accepted drafts plus one token; a step whose γ was capped
        # to 0 by max_tokens is a plain step, not a spec step
        assert s["num_accepted_tokens"] + out.metrics.num_target_forwards == len(out.outputs[0].token_ids)
        assert out.metrics.num_target_forwards - 1 <= s["num_spec_steps"] <= out.metrics.num_target_forwards
        assert len(s["acceptance_histogram"]) <= gamma
    assert_idle(llm)


@pytest.mark.parametrize("top_k, nodes", [(2, 5), (3, 8), (4, 4)])
def test_draft_model_trees_are_token_identical_to_plain(top_k, nodes, tiny_qwen, tiny_qwen_draft, plain_greedy):
    """The draft grows a dynamic tree (its top-k most confident candidates expanded per depth, SGLang's standalone
    knobs); the target verifies it: plain's output, and trees verified more nodes than their depth."""
    config = {**draft_config(tiny_qwen_draft, 4), "speculative_eagle_topk": top_k, "speculative_num_draft_tokens": nodes}
    llm = LLM(str(tiny_qwen), speculative_config=config, quantization=None, max_model_len=128, max_num_seqs=3)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    assert sum(s["num_accepted_tokens"] for s in stats) > 0
    for out, s in zip(outputs, stats):
        assert s["num_accepted_tokens"] + out.metrics.num_target_forwards == len(out.outputs[0].token_ids)
        verified = sum(k * n for k, n in enumerate(s["verified_histogram"]))
        assert verified > s["num_draft_tokens"] and max(k for k, n in enumerate(s["verified_histogram"]) if n) <= nodes
    assert_idle(llm)


@pytest.mark.parametrize("case", ["temperature-1", "temperature-0.7-top-k-5"])
def test_draft_model_trees_keep_the_targets_distribution(case, small_vocab_pair):
    target, draft = small_vocab_pair
    base = DISTRIBUTION_CASES[case]
    params = SamplingParams(n=NUM_SAMPLES, temperature=base.temperature, top_k=base.top_k, max_tokens=4, seed=2024,
                            ignore_eos=True)
    prompt = [1, 2, 3]
    config = {**draft_config(draft, 2), "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 5}
    counts, stats = sampled_first_two(target, config, params, prompt)
    assert 100 < stats["acceptance_histogram"][0] < stats["num_spec_steps"] - 100
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_draft_equal_to_target_accepts_everything(gamma, tiny_qwen):
    llm = spec_llm(tiny_qwen, tiny_qwen, gamma, max_model_len=128)
    [out] = llm.generate("same", SamplingParams(temperature=0, max_tokens=4 * (gamma + 1), ignore_eos=True))
    s = out.metrics.speculative_decoding
    assert s["draft_acceptance_rate"] == 1.0
    assert s["mean_acceptance_length"] == gamma + 1
    assert s["alpha"] == 1.0
    assert s["num_spec_steps"] == 4 and s["acceptance_histogram"] == [4] * gamma


# --- stops inside an accepted block ----------------------------------------------------

def free_greedy(llm: LLM, prompt: str) -> list[int]:
    """The 20 greedy tokens a prompt gives with no stop rule: a stop is then placed inside them."""
    [free] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    return free.outputs[0].token_ids


def test_stop_token_inside_an_accepted_block(tiny_qwen):
    llm = spec_llm(tiny_qwen, tiny_qwen, 4, max_model_len=128)
    tokens = free_greedy(llm, "stops")
    stop = tokens[2]
    cut = tokens.index(stop) + 1
    [out] = llm.generate("stops", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]))
    assert out.outputs[0].token_ids == tokens[:cut] and out.outputs[0].finish_reason == "stop"
    s = out.metrics.speculative_decoding
    assert s["num_spec_steps"] == 1 and s["num_draft_tokens"] == 4
    assert s["num_accepted_tokens"] == cut  # only committed tokens count: the rest of the block is dropped
    assert_idle(llm)


def test_eos_inside_an_accepted_block(tiny_qwen):
    llm = spec_llm(tiny_qwen, tiny_qwen, 4, max_model_len=128)
    tokens = free_greedy(llm, "eos")
    eos = tokens[3]
    cut = tokens.index(eos) + 1
    engine = llm.engine
    engine.rules = dataclasses.replace(engine.rules, eos_token_ids=frozenset({eos}))
    [out] = llm.generate("eos", SamplingParams(temperature=0, max_tokens=20))
    assert out.outputs[0].token_ids == tokens[:cut]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    assert out.metrics.speculative_decoding["num_accepted_tokens"] <= cut
    assert_idle(llm)


def test_stop_string_and_max_tokens_inside_a_block(tiny_qwen):
    llm = spec_llm(tiny_qwen, tiny_qwen, 6, max_model_len=128)
    [free] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = free.outputs[0].text
    stop = text[5:8]
    [out] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert out.outputs[0].text == text[: text.find(stop)] and out.outputs[0].stop_reason == stop
    [short] = llm.generate("abc", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert short.outputs[0].token_ids == free.outputs[0].token_ids[:9]
    assert short.outputs[0].finish_reason == "length"
    assert_idle(llm)


# --- caches after rollback -----------------------------------------------------------

def test_both_caches_hold_exactly_the_committed_tokens_after_every_step(tiny_qwen, tiny_qwen_draft):
    llm = spec_llm(tiny_qwen, tiny_qwen_draft, 4, max_model_len=128)
    engine = llm.engine
    [seq] = engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0.8, max_tokens=30, seed=3, ignore_eos=True))
    target_fresh = llm.engine.model
    draft_model = engine.proposer.model
    rejected_steps = 0
    while not seq.is_finished:
        before = seq.num_tokens
        drafted_before = seq.spec_stats.num_draft_tokens
        accepted_before = seq.spec_stats.num_accepted_tokens
        engine.step()
        if seq.is_finished:
            break
        drafted = seq.spec_stats.num_draft_tokens - drafted_before
        accepted = seq.spec_stats.num_accepted_tokens - accepted_before
        rejected_steps += accepted < drafted
        assert seq.num_tokens == before + accepted + 1
        slot, draft_slot = seq.slot, engine.proposer._slots[seq]
        assert engine.cache.length(slot) == seq.num_tokens - 1
        assert engine.proposer.cache.length(draft_slot) <= seq.num_tokens - 1
        # The kept entries equal a fresh prefill of the committed tokens (float32 rounding only).
        committed = seq.token_ids[:-1]
        for model, cache, s in ((target_fresh, engine.cache, slot), (draft_model, engine.proposer.cache, draft_slot)):
            n = cache.length(s)
            fresh = model.new_kv_cache(1, 128)
            fresh_slot = fresh.allocate()
            model.forward(ForwardBatch.build([SequenceInput(fresh_slot, committed[:n])], [0]), fresh)
            torch.testing.assert_close(cache.keys[:, s, :, :n], fresh.keys[:, fresh_slot, :, :n], atol=2e-5, rtol=0)
            torch.testing.assert_close(cache.values[:, s, :, :n], fresh.values[:, fresh_slot, :, :n], atol=2e-5, rtol=0)
    assert rejected_steps > 0
    assert engine.cache.num_free_slots == engine.cache.num_slots


# --- seeds -------------------------------------------------------------------------------

def test_seeded_speculative_request_ignores_its_batch(tiny_qwen, tiny_qwen_draft):
    llm = spec_llm(tiny_qwen, tiny_qwen_draft, 3, max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=77, ignore_eos=True)
    [alone] = llm.generate("seeded", params)
    batch = llm.generate(["noise one", "seeded", "noise two"], [SamplingParams(temperature=0.5, max_tokens=30), params, SamplingParams(temperature=0)])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


# --- the distribution, end to end ------------------------------------------------------------

DISTRIBUTION_CASES = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.7-top-k-5": SamplingParams(temperature=0.7, top_k=5),
    "top-p-0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_first_two_tokens_are_distributed_as_the_target(case, small_vocab_pair):
    """20k samples in one batched call vs the exact P(t1, t2); p < 1e-4 would be a real mismatch."""
    target, draft = small_vocab_pair
    base = DISTRIBUTION_CASES[case]
    params = SamplingParams(n=NUM_SAMPLES, temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
                            max_tokens=4, seed=2024, ignore_eos=True)
    prompt = [1, 2, 3]
    counts, stats = sampled_first_two(target, draft_config(draft), params, prompt)
    assert 0.05 < stats["draft_acceptance_rate"] < 0.95  # the draft really differs: both branches ran
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


def test_power_end_to_end_an_always_accepting_verifier_fails(small_vocab_pair, monkeypatch):
    def always_accept(p, drafts, num_draft, q, generators):
        tokens = [drafts[r, :n].tolist() + [int(torch.multinomial(p[r, n], 1, generator=generators[r]))] for r, n in enumerate(num_draft)]
        return Verified(list(num_draft), tokens)

    monkeypatch.setattr(engine_module, "rejection_sample", always_accept)
    target, draft = small_vocab_pair
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=4, seed=2024, ignore_eos=True)
    counts, _ = sampled_first_two(target, draft_config(draft), params, [1, 2, 3])
    assert chi_square_pvalue(counts, exact_first_two(target, [1, 2, 3], params)) < 1e-12


# --- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "medusa-ish", "num_speculative_tokens": 2}, "unknown speculative method"),
        ({"method": "draft_model", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "needs 'num_speculative_tokens'"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "gamma": 3}, "unknown speculative_config keys"),
        ("draft_model", "must be a dict"),
    ],
)
def test_bad_speculative_config(config, message, tiny_qwen):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), speculative_config=config)


def test_draft_with_another_vocabulary_is_refused(tiny_qwen, small_vocab_pair):
    with pytest.raises(ValueError, match="vocabulary size"):
        spec_llm(tiny_qwen, small_vocab_pair[1], 2)
