"""Fixtures: tiny models built inside the tests (specdec.bench.tiny), exact distributions to test against."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specdec.bench.tiny import build_tiny_model, perturbed_copy
from specdec.models.batch import ForwardBatch, SequenceInput


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=2)


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch):
    """Tests never write to the user's model cache, except the real-model (`slow`) ones, which share it."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "specdec-cache"))


@pytest.fixture
def oversubscribed_threads():
    """Three intra-op threads per core for the test (the OS time-slices them, so work split between them finishes
    unevenly); the thread count is restored after."""
    before = torch.get_num_threads()
    threads = 3 * (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_qwen_draft(tiny_qwen, tmp_path_factory) -> Path:
    return perturbed_copy(tiny_qwen, tmp_path_factory.mktemp("tiny-qwen2-draft"), noise=0.08)


# --- the distribution, end to end: a 16-token vocabulary, exact P(t1, t2) by enumeration ------

SMALL_VOCAB = 16
NUM_SAMPLES = 20_000


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """Tiny target and a clearly different tiny draft over 16 tokens, sharpened logits."""
    common = dict(vocab_size=SMALL_VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    target = build_tiny_model(tmp_path_factory.mktemp("v16-target"), "llama", seed=11, **common)
    draft = build_tiny_model(tmp_path_factory.mktemp("v16-draft"), "llama", seed=12, **common)
    return target, draft


def exact_first_two(target_dir, prompt: list[int], params) -> torch.Tensor:
    """P(t1, t2) by enumeration with transformers' forward: [V, V]."""
    from transformers import AutoModelForCausalLM

    from specdec.sampling import processed_probs

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1:]
        seconds = model(torch.tensor([prompt + [t] for t in range(SMALL_VOCAB)])).logits[:, -1]
    p1 = processed_probs(first, [params])[0]
    p2 = processed_probs(seconds, [params] * SMALL_VOCAB)
    return p1[:, None] * p2


def sampled_first_two(
    target_dir, speculative_config: dict, params, prompt: list[int], controller=None, device: str = "cpu"
) -> tuple[torch.Tensor, dict]:
    """Counts of (t1, t2) over params.n samples generated in one call (float32 target), and the speculation
    stats; `controller(llm)` (optional) builds the engine's γ controller."""
    from specdec import LLM

    llm = LLM(str(target_dir), speculative_config=speculative_config, quantization=None, skip_tokenizer_init=True,
              max_model_len=max(16, len(prompt) + 8), max_num_seqs=512, device=device)
    if controller is not None:
        llm.engine.controller = controller(llm)
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    for c in out.outputs:
        counts[c.token_ids[0], c.token_ids[1]] += 1
    return counts, out.metrics.speculative_decoding


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if expected[-1] < 1e-9:
        assert observed[-1] == 0, "tokens the target gives probability 0 were generated"
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue)


def prefill_chain_tree_logits(decoder) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits of a prefill of 17 tokens, a chain verification of 5 after it, and a tree of 4 in its place: every
    path a forward of the decoder's kernels takes."""
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    cache = decoder.new_kv_cache(1, 64)
    slot = cache.allocate()
    prefill = decoder.forward(ForwardBatch.build([SequenceInput(slot, list(range(3, 20)))], [0]), cache)
    chain = decoder.forward(ForwardBatch.build([SequenceInput(slot, [7, 8, 9, 10, 11])], [17]), cache)
    cache.truncate(slot, 17)
    mask = torch.cat((torch.ones(4, 17, dtype=torch.bool), tree), dim=1)
    branch = decoder.forward(
        ForwardBatch.build([SequenceInput(slot, [5, 6, 7, 8], positions=[17, 18, 18, 19], mask=mask)], [17]), cache
    )
    return prefill.logits, chain.logits, branch.logits
