"""MTP self-speculation on tiny models: the engine's modules against the trainable ones (real rows and draft rows,
module k's attention), greedy identity, the sampled distribution, checkpoints (ours and native modules in a target
checkpoint), training, configuration."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from specdec import LLM, SamplingParams
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.linear import DenseLinear
from specdec.models.loader import load_decoder
from specdec.models.mtp import MtpConfig, MtpDrafter, MtpModules
from specdec.spec.proposers.mtp import _mask
from test_eagle import jitter

PROMPTS = ["abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "x"]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def random_modules(target_dir, directory, num_modules: int = 3, vocab: list[int] | None = None, scale: float = 0.5,
                   seed: int = 0, pass_through: bool = True, intermediate_size: int | None = 48):
    """Modules that pass the hidden state through (or not) plus random weights: sometimes right, as the identity and
    distribution tests need."""
    from specdec.training.mtp import MtpTrainingConfig, new_modules

    target = load_decoder(target_dir, torch.float32, "cpu")
    torch.manual_seed(seed)
    config = MtpTrainingConfig(num_modules=num_modules, intermediate_size=intermediate_size)
    vocab = None if vocab is None else torch.tensor(vocab)
    if pass_through:
        modules = new_modules(target, config, vocab, "t")
    else:
        t = target.config
        modules = MtpModules(MtpConfig(t.hidden_size, intermediate_size or t.intermediate_size, t.num_heads,
                                       t.num_kv_heads, t.head_dim, t.rms_norm_eps, fc_bias=False,
                                       num_modules=num_modules), vocab)
    jitter(modules, scale, seed)
    modules.save(directory)
    return directory


@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_engine_modules_compute_what_the_trainable_ones_do(tiny_qwen, tmp_path):
    """For committed tokens 0 … n − 1: each module's real rows (fed in two pieces, as catch-ups are) and its draft row
    at n − 2 — given the true token instead of a draft — equal the trainable modules' rows, with module k's
    attention skipping the rows whose tokens would still be drafts."""
    target = load_decoder(tiny_qwen, torch.float32, "cpu", None)
    modules = MtpModules.load(random_modules(tiny_qwen, tmp_path / "m", num_modules=4, scale=1.0))
    drafter = MtpDrafter(modules, target, target.lm_head, DenseLinear, "float32")
    n, total = 14, 18  # committed tokens; the training rows know 4 more (the drafts' true values)
    tokens = torch.randint(0, 256, (total,), generator=torch.Generator().manual_seed(1))
    features = torch.randn(total, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = target.rope(torch.arange(total))
    expected, hidden = [], features[None]
    with torch.no_grad():
        for k, module in enumerate(modules.layers, start=1):
            embeds = torch.nn.functional.pad(target.embed[tokens[k:]], (0, 0, 0, k))[None]
            hidden = module(embeds, hidden, cos, sin, k)
            expected.append(hidden[0])
    inputs = features
    for k in range(1, 5):
        cache = drafter.decoders[k - 1].new_kv_cache(1, n + 2)
        slot = cache.allocate()
        real = n - k  # rows p = 0 … n − k − 1 read committed tokens
        outputs = []
        for start, end in ((0, real // 2), (real // 2, real)):
            positions = list(range(start, end))
            batch = ForwardBatch.build([SequenceInput(slot, tokens[start + k : end + k].tolist(), positions,
                                                      _mask(k, start, positions))], [start])
            outputs.append(drafter.forward(k, batch, cache, tokens[start + k : end + k], inputs[start:end]).hidden)
        real_rows = torch.cat(outputs)
        torch.testing.assert_close(real_rows, expected[k - 1][:real], atol=1e-4, rtol=1e-4)
        if k > 1:  # the draft row at n − 2, reading token n − 2 + k (a draft in the engine; here the true one)
            p = n - 2
            token = tokens[p + k : p + k + 1]
            batch = ForwardBatch.build([SequenceInput(slot, token.tolist(), [p], _mask(k, real, [p]))], [real])
            row = drafter.forward(k, batch, cache, token, expected[k - 2][p : p + 1]).hidden[0]
            torch.testing.assert_close(row, expected[k - 1][p], atol=1e-4, rtol=1e-4)
        inputs = expected[k - 1]


@pytest.mark.parametrize("gamma, adaptive, num_modules", [(1, False, 3), (2, False, 3), (3, False, 3), (3, True, 3),
                                                       (5, False, 3), (3, False, 1), (4, True, 2)])
def test_greedy_output_is_token_identical_to_plain(gamma, adaptive, num_modules, tiny_qwen, plain_greedy, tmp_path):
    """γ beyond the modules: the last one repeats."""
    directory = random_modules(tiny_qwen, tmp_path / "m", num_modules,
                               vocab=list(range(0, 256, 2)) if gamma == 2 else None)
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "mtp", "model": str(directory), "num_speculative_tokens": gamma,
                                  "adaptive": adaptive})
    if adaptive:
        from specdec.engine.adaptive import AdaptiveGamma, StepCosts
        from test_adaptive import FLAT

        llm.engine.controller = AdaptiveGamma(StepCosts(FLAT, FLAT), calibration_weight=0.0)
    proposer, propose, checked = llm.engine.proposer, llm.engine.proposer.propose, []

    def propose_and_check_caches(seqs, num_tokens):
        draft = propose(seqs, num_tokens)
        # after a step ≥ K deep, module k holds its real rows only: p ≤ N − 1 − k
        for seq, n in zip(seqs, num_tokens):
            if n >= num_modules and draft.num_tokens[seqs.index(seq)] == n:
                slots = proposer._slots[seq]
                assert [c.length(s) for c, s in zip(proposer.caches, slots)] == [
                    max(0, seq.num_tokens - k) for k in range(1, num_modules + 1)]
                checked.append(n)
        return draft

    proposer.propose = propose_and_check_caches
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert checked or adaptive or gamma < num_modules
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    assert sum(s["num_accepted_tokens"] for s in stats) > 0
    assert sum(s["num_accepted_tokens"] for s in stats) < sum(s["num_draft_tokens"] for s in stats)
    if not adaptive:
        assert max(len(s["per_position_acceptance"]) for s in stats) == gamma
    assert not llm.engine.running and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots
    assert all(c.num_free_slots == c.num_slots for c in llm.engine.proposer.caches)


def test_a_prompt_fed_in_chunks_is_read_whole(tiny_qwen, plain_greedy, tmp_path):
    import dataclasses

    directory = random_modules(tiny_qwen, tmp_path / "m")
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "mtp", "model": str(directory), "num_speculative_tokens": 3,
                                  "adaptive": False})
    llm.engine.config = dataclasses.replace(llm.engine.config, max_prefill_chunk=5)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    assert all(o.metrics.speculative_decoding["num_spec_steps"] > 5 for o in outputs)


@pytest.mark.parametrize("case", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["temperature-1", "temperature-0.7-top-k-5"])
def test_first_two_tokens_are_distributed_as_the_target(case, small_vocab_pair, tmp_path):
    target, _ = small_vocab_pair
    directory = random_modules(target, tmp_path / "m", num_modules=2, scale=3.0, seed=3, pass_through=False)
    params = SamplingParams(n=NUM_SAMPLES, temperature=case.temperature, top_k=case.top_k, max_tokens=3, seed=7,
                            ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    config = {"method": "mtp", "model": str(directory), "num_speculative_tokens": 2, "adaptive": False}
    counts, stats = sampled_first_two(target, config, params, prompt)
    accepted_steps = stats["acceptance_histogram"][0]
    assert 100 < accepted_steps < stats["num_spec_steps"] - 100
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


def test_checkpoint_round_trip_and_native_modules_in_the_target(tiny_qwen, plain_greedy, tmp_path):
    modules = MtpModules.load(random_modules(tiny_qwen, tmp_path / "ours", num_modules=2, vocab=[1, 5, 9]))
    again = MtpModules.load(tmp_path / "ours")
    assert again.config == modules.config and again.vocab.tolist() == [1, 5, 9]
    for (name, a), b in zip(modules.official_parameters().items(), again.official_parameters().values()):
        assert torch.equal(a, b), name
    # a target checkpoint with its own modules (MiMo's layout beside the model's weights): drafted with, unasked
    from safetensors.torch import save_file

    native = tmp_path / "native"
    shutil.copytree(tiny_qwen, native)
    full = MtpModules.load(random_modules(tiny_qwen, tmp_path / "full", num_modules=2, intermediate_size=None))
    save_file({n: p.detach().contiguous() for n, p in full.official_parameters().items()}, str(native / "mtp.safetensors"))
    config = json.loads((native / "config.json").read_text())
    (native / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    llm = LLM(str(native), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    assert llm.engine.proposer.drafter.num_modules == 2
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    assert sum(o.metrics.speculative_decoding["num_accepted_tokens"] for o in outputs) > 0


def test_training_lowers_the_loss_resumes_and_drives_speculation(tiny_qwen, plain_greedy, tmp_path):
    from specdec.training.data import CorpusConfig
    from specdec.training.mtp import MtpTrainingConfig, train_mtp

    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=1024)
    corpus = CorpusConfig(corpus_tokens=3000, generated_tokens=256, chunk_tokens=256)
    config = MtpTrainingConfig(num_modules=2, intermediate_size=64, vocab_size=64, epochs=8, learning_rate=3e-3)
    report = train_mtp(llm, tmp_path / "mtp", corpus, config)
    before, after = report["before"], report["after"]
    assert all(a < b for a, b in zip(after["loss"], before["loss"])), (before, after)
    assert len(after["top1"]) == 2 and all(a > b for a, b in zip(after["top1"], before["top1"])), (before, after)
    assert report["epochs"][-1]["loss"] < report["epochs"][0]["loss"]
    assert 0 < len(MtpModules.load(tmp_path / "mtp").vocab) <= 64
    assert train_mtp(llm, tmp_path / "mtp", corpus, config)["epochs"] == report["epochs"]  # resumed: all done
    spec = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
               speculative_config={"method": "mtp", "model": str(tmp_path / "mtp"), "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain_greedy


def test_train_heads_command_mtp(tiny_qwen, tmp_path, capsys):
    from specdec.cli import main

    code = main(["train-heads", "--method", "mtp", "--model", str(tiny_qwen), "--out", str(tmp_path / "m"),
                 "--num-heads", "3", "--intermediate-size", "32", "--vocab-size", "0", "--corpus-tokens", "600",
                 "--generated-tokens", "0", "--epochs", "1", "--quantization", "none"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["after"]["top1"]) == 3
    assert MtpModules.load(tmp_path / "m").config.num_modules == 3


def test_bad_config(tiny_qwen, tmp_path):
    directory = random_modules(tiny_qwen, tmp_path / "m", num_modules=2)
    for config, message in [
        ({"method": "mtp", "model": str(directory), "speculative_eagle_topk": 2}, "chain"),
        ({"method": "mtp", "model": str(tmp_path / "none")}, "no MTP modules"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_qwen), quantization=None, speculative_config=config)
