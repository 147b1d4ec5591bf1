"""EAGLE end to end on tiny models: the dynamic tree against a brute-force reference, the engine's draft layer
against the trainable one, greedy identity (chains, EAGLE-2 trees, reduced vocabulary, chunked prompts), the
sampled distribution through verification, checkpoints (ours and the official layouts), training, configuration
— for EAGLE-1/2's layer and EAGLE-3's (fused target layers, own head) alike."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from specdec import LLM, SamplingParams
from specdec.models.decoder import Decoder
from specdec.models.eagle import EagleConfig, EagleDrafter, EagleLayer
from specdec.models.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Layer
from specdec.models.linear import DenseLinear
from specdec.models.loader import load_decoder
from specdec.spec.draft_tree import DraftTreeSearch
from specdec.spec.tree import ROOT

PROMPTS = ["abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "x"]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
METHODS = ["eagle", "eagle3"]


def random_layer(target_dir, directory, vocab: list[int] | None = None, scale: float = 0.5, seed: int = 0,
                 pass_through: bool = True, method: str = "eagle"):
    """A layer (EAGLE-1/2's or, with method "eagle3", EAGLE-3's) that passes the feature through (or not) plus
    random weights: its guesses are sometimes right, which is what identity and distribution tests need."""
    from specdec.models.medusa import output_embedding
    from specdec.training.eagle import EagleTrainingConfig, new_layer

    target = load_decoder(target_dir, torch.float32, "cpu")
    torch.manual_seed(seed)
    config = EagleTrainingConfig(intermediate_size=48, eagle3=method == "eagle3")
    vocab = None if vocab is None else torch.tensor(vocab)
    projection = output_embedding(target, target_dir)
    projection = projection if vocab is None else projection[vocab]
    if pass_through:
        layer = new_layer(target, config, vocab, "t", projection)
    elif config.eagle3:
        layer = Eagle3Layer(Eagle3Config.for_target(target.config, config.intermediate_size,
                                                    draft_vocab_size=len(projection)), vocab)
    else:
        layer = EagleLayer(EagleConfig.for_target(target.config, config.intermediate_size), vocab)
    jitter(layer, scale, seed)
    layer.save(directory)
    return directory


def jitter(module: torch.nn.Module, scale: float, seed: int) -> None:
    """Random weights added to every parameter (scaled by its fan-in), seeded."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def plain_greedy(tiny_qwen):
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


# --- EAGLE-2's dynamic tree, pure ----------------------------------------------------------------------------

def _reference_tree(logprob, top_k: int, depth: int, num_nodes: int) -> set[tuple[int, ...]]:
    """EAGLE-2 by enumeration: every level's candidates are the top-k children of the previous level's top-k;
    the tree is the num_nodes best of all levels (paths of child ranks)."""
    score = {}
    level = [(r,) for r in range(top_k)]
    for path in level:
        score[path] = logprob(path)
    for _ in range(depth - 1):
        expanded = sorted(level, key=lambda p: -score[p])[:top_k]
        level = [p + (r,) for p in expanded for r in range(top_k)]
        for path in level:
            score[path] = score[path[:-1]] + logprob(path)
    return set(sorted(score, key=lambda p: (-score[p], len(p)))[:num_nodes])


@pytest.mark.parametrize("top_k, depth, num_nodes", [(1, 4, 4), (2, 3, 5), (3, 4, 8), (4, 5, 12), (3, 2, 30)])
def test_dynamic_tree_matches_brute_force(top_k, depth, num_nodes):
    for seed in range(20):
        rng = random.Random(seed)
        table: dict[tuple[int, ...], float] = {}

        def logprob(path):  # children by rank: non-increasing log-probs under each parent
            if path not in table:
                values = sorted((-rng.expovariate(1.0) for _ in range(top_k)), reverse=True)
                for r, v in enumerate(values):
                    table[path[:-1] + (r,)] = v
            return table[path]

        expected = _reference_tree(logprob, top_k, depth, num_nodes)
        search = DraftTreeSearch(top_k, depth, num_nodes)
        paths = {ROOT: ()}
        search.add_children(ROOT, [100 + r for r in range(top_k)], [logprob((r,)) for r in range(top_k)])
        for i in range(top_k):
            paths[i] = (i,)
        while frontier := search.frontier():
            for node in frontier:
                first = len(search.candidates)
                children = [paths[node] + (r,) for r in range(top_k)]
                search.add_children(node, [100 + r for r in range(top_k)], [logprob(c) for c in children])
                for r, child in enumerate(children):
                    paths[first + r] = child
        chosen = {paths[i] for i in search.best()}
        assert chosen == expected
        tree, tokens = search.tree()
        assert tree.num_nodes == len(expected) and tree.max_depth <= depth
        assert all(tree.path_to(n) for n in range(tree.num_nodes))  # every node's ancestors are in the tree
        assert tokens == [100 + rank for rank in tree.ranks]


def test_draft_tree_search_rejects_empty_settings():
    with pytest.raises(ValueError, match="top_k"):
        DraftTreeSearch(0, 3, 4)


# --- the draft layer -----------------------------------------------------------------------------------------

def drafter_of(layer, target):
    if isinstance(layer, Eagle3Layer):
        return Eagle3Drafter(layer, target, DenseLinear, "float32")
    return EagleDrafter(layer, target, target.lm_head, DenseLinear, "float32")


@pytest.mark.parametrize("method", METHODS)
def test_engine_draft_layer_computes_what_the_trainable_layer_does(method, tiny_qwen, tmp_path):
    """The drafter (a one-layer Decoder, KV-cached, fed in two pieces) against the trainable layer's forward, and
    (EAGLE-3) its own head; EAGLE-3's features are three target layers side by side."""
    from specdec.models.batch import ForwardBatch, SequenceInput

    target = load_decoder(tiny_qwen, torch.float32, "cpu", None)
    layer = random_layer(tiny_qwen, tmp_path / "l", scale=1.0, method=method)
    layer = (Eagle3Layer if method == "eagle3" else EagleLayer).load(layer)
    drafter = drafter_of(layer, target)
    tokens = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    width = layer.fc.in_features - (target.config.hidden_size if method == "eagle" else 0)
    features = torch.randn(12, width, generator=torch.Generator().manual_seed(2))
    cos, sin = target.rope(torch.arange(12))
    with torch.no_grad():
        expected = layer.unrolled(target.embed[tokens][None], features[None], cos, sin, 1)[0][0]
    cache = drafter.decoder.new_kv_cache(1, 16)
    slot = cache.allocate()
    rows, logits = [], []
    for start, end in ((0, 7), (7, 12)):
        batch = ForwardBatch.build([SequenceInput(slot, tokens[start:end].tolist())], [start])
        out = drafter.forward(batch, cache, tokens[start:end], features[start:end])
        rows.append(out.hidden)
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=1e-4)
    if method == "eagle3":
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(logits), layer.logits(expected), atol=1e-4, rtol=1e-4)
    assert isinstance(drafter.decoder, Decoder) and drafter.decoder.config.num_layers == 1


@pytest.mark.parametrize("method", METHODS)
def test_training_time_test_sees_what_deeper_drafts_see(method, tiny_qwen, tmp_path):
    """Unrolled step 1's row t (EAGLE-3's training-time test) against the engine's draft layer fed positions 0 … t
    with real features and then one row of its own output: the depth-2 draft after position t."""
    from specdec.models.batch import ForwardBatch, SequenceInput

    target = load_decoder(tiny_qwen, torch.float32, "cpu", None)
    layer = random_layer(tiny_qwen, tmp_path / "l", scale=1.0, method=method)
    layer = (Eagle3Layer if method == "eagle3" else EagleLayer).load(layer)
    drafter = drafter_of(layer, target)
    tokens = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(1))  # tokens[t]: token t + 1
    width = layer.fc.in_features - (target.config.hidden_size if method == "eagle" else 0)
    features = torch.randn(10, width, generator=torch.Generator().manual_seed(2))
    cos, sin = target.rope(torch.arange(12))
    with torch.no_grad():
        steps = layer.unrolled(target.embed[tokens][None], features[None], cos, sin, 3)
    for t in (0, 4, 7):
        cache = drafter.decoder.new_kv_cache(1, 16)
        slot = cache.allocate()
        batch = ForwardBatch.build([SequenceInput(slot, tokens[: t + 1].tolist())], [0])
        hidden = drafter.forward(batch, cache, tokens[: t + 1], features[: t + 1]).hidden[-1:]
        torch.testing.assert_close(hidden[0], steps[0][0, t], atol=1e-4, rtol=1e-4)
        for step in (1, 2):  # the next depth: token t + step + 1, fed its parent's output, at position t + step
            token = tokens[t + step : t + step + 1]
            batch = ForwardBatch.build([SequenceInput(slot, token.tolist())], [t + step])
            hidden = drafter.forward(batch, cache, token, hidden).hidden
            torch.testing.assert_close(hidden[0], steps[step][0, t], atol=1e-4, rtol=1e-4)


def test_checkpoint_round_trip_and_the_official_layout(tmp_path):
    config = EagleConfig(16, 24, 4, 2, 4, base_model="m")
    layer = EagleLayer(config, torch.tensor([3, 1, 2]))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    layer.save(tmp_path / "ours")
    again = EagleLayer.load(tmp_path / "ours")
    assert again.config == config and torch.equal(again.vocab, layer.vocab)
    for (name, a), b in zip(layer.official_parameters().items(), again.official_parameters().values()):
        assert torch.equal(a, b), name
    # the official EAGLE-1 layout: a Llama config, pytorch_model.bin with the embedding copy, q/k/v biases (Qwen2)
    official = tmp_path / "official"
    official.mkdir()
    tensors = {name: p.detach().clone() for name, p in layer.official_parameters().items()}
    tensors |= {f"layers.0.self_attn.{x}_proj.bias": torch.randn(16 if x == "q" else 8) for x in "qkv"}
    tensors["embed_tokens.weight"] = torch.randn(40, 16)
    torch.save(tensors, official / "pytorch_model.bin")
    (official / "config.json").write_text(json.dumps({"hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "bias": True}))
    loaded = EagleLayer.load(official)
    assert loaded.config.attention_bias and not loaded.config.input_norm and loaded.vocab is None
    assert loaded.config.head_dim == 4 and loaded.config.rms_norm_eps == 1e-5
    assert torch.equal(loaded.q_proj.bias, tensors["layers.0.self_attn.q_proj.bias"])
    assert torch.equal(loaded.fc.weight, layer.fc.weight)
    (official / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no EAGLE weights"):
        EagleLayer.load(official)


def test_eagle3_checkpoint_round_trip_and_the_official_layout(tmp_path):
    config = Eagle3Config(16, 24, 4, 2, 4, base_model="m", draft_vocab_size=3, vocab_size=40, aux_layers=(2, 5, 9))
    layer = Eagle3Layer(config, torch.tensor([1, 7, 30]))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    layer.save(tmp_path / "ours")
    again = Eagle3Layer.load(tmp_path / "ours")
    assert again.config == config and torch.equal(again.vocab, layer.vocab)
    for (name, a), b in zip(layer.official_parameters().items(), again.official_parameters().values()):
        assert torch.equal(a, b), name
    maps = layer.token_maps()
    assert maps["d2t"].tolist() == [1, 6, 28] and maps["t2d"].nonzero().flatten().tolist() == [1, 7, 30]
    # the official layout: pytorch_model.bin, no aux layer ids (the serving engine's default for the target)
    official = tmp_path / "official"
    official.mkdir()
    torch.save({**{n: p.detach().clone() for n, p in layer.official_parameters().items()}, **maps},
               official / "pytorch_model.bin")
    (official / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 16, "intermediate_size": 24,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "draft_vocab_size": 3,
        "vocab_size": 40}))
    loaded = Eagle3Layer.load(official)
    assert loaded.config.aux_layers == () and loaded.vocab.tolist() == [1, 7, 30]
    assert torch.equal(loaded.lm_head.weight, layer.lm_head.weight)
    with pytest.raises(ValueError, match="EAGLE-3 layer: use method 'eagle3'"):
        EagleLayer.load(official)
    EagleLayer(EagleConfig(16, 24, 4, 2, 4)).save(tmp_path / "eagle1")
    with pytest.raises(ValueError, match="not an EAGLE-3 draft layer"):
        Eagle3Layer.load(tmp_path / "eagle1")


# --- speculation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 6},
                                  {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 10}],
                         ids=["chain", "tree-k3-n6", "tree-k2-n10"])
@pytest.mark.parametrize("vocab", [None, "reduced"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_token_identical_to_plain(method, tree, vocab, tiny_qwen, plain_greedy, tmp_path):
    reduced = None if vocab is None else list(range(0, 256, 2))
    layer = random_layer(tiny_qwen, tmp_path / "layer", vocab=reduced, method=method)
    config = {"method": method, "model": str(layer), "adaptive": False, "num_speculative_tokens": 4, **tree}
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3, speculative_config=config)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    stats = [o.metrics.speculative_decoding for o in outputs]
    assert sum(s["num_spec_steps"] for s in stats) > 0 and sum(s["num_accepted_tokens"] for s in stats) > 0
    for out, s in zip(outputs, stats):
        assert s["num_accepted_tokens"] + out.metrics.num_target_forwards == len(out.outputs[0].token_ids)
        assert s["num_draft_forwards"] >= s["num_spec_steps"]  # a forward per depth drafted
    assert not llm.engine.running and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots
    assert llm.engine.proposer.cache.num_free_slots == llm.engine.proposer.cache.num_slots


@pytest.mark.parametrize("method", METHODS)
def test_a_prompt_fed_in_chunks_is_read_whole(method, tiny_qwen, plain_greedy, tmp_path):
    """The draft layer reads the features of every prompt chunk, not only the last: it drafts from the first
    generated token on, and the output is plain's."""
    layer = random_layer(tiny_qwen, tmp_path / "layer", method=method)
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": method, "model": str(layer), "adaptive": False, "speculative_eagle_topk": 2})
    llm.engine.config = dataclasses.replace(llm.engine.config, max_prefill_chunk=5)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy
    # a draft layer missing a chunk's features could not draft at all: it drafts on every prompt
    assert all(o.metrics.speculative_decoding["num_spec_steps"] > 5 for o in outputs)


@pytest.mark.parametrize("case", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["temperature-1", "temperature-0.7-top-k-5"])
@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 5}],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("method", METHODS)
def test_first_two_tokens_are_distributed_as_the_target(method, tree, case, small_vocab_pair, tmp_path):
    """The second token is verified against the draft layer's candidates: 20k samples vs the exact P(t1, t2)."""
    target, _ = small_vocab_pair
    layer = random_layer(target, tmp_path / "layer", scale=1.0, seed=3, pass_through=False, method=method)
    params = SamplingParams(n=NUM_SAMPLES, temperature=case.temperature, top_k=case.top_k, max_tokens=3, seed=7,
                            ignore_eos=True)
    prompt = [3, 1, 4, 1, 5]
    config = {"method": method, "model": str(layer), "num_speculative_tokens": 2, "adaptive": False, **tree}
    counts, stats = sampled_first_two(target, config, params, prompt)
    accepted_steps = stats["acceptance_histogram"][0]
    assert 100 < accepted_steps < stats["num_spec_steps"] - 100  # accepted and rejected candidates both ran
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


def test_adaptive_depth_keeps_greedy_identity(tiny_qwen, plain_greedy, tmp_path):
    from specdec.engine.adaptive import AdaptiveGamma, StepCosts
    from test_adaptive import FLAT

    layer = random_layer(tiny_qwen, tmp_path / "layer")
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "eagle", "model": str(layer), "speculative_eagle_topk": 2})
    llm.engine.controller = AdaptiveGamma(StepCosts(FLAT, FLAT), calibration_weight=0.0)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_greedy


# --- training ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_training_lowers_the_loss_resumes_and_drives_speculation(method, tiny_qwen, tmp_path):
    from specdec.training.data import CorpusConfig
    from specdec.training.eagle import EagleTrainingConfig, train_eagle

    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=1024)
    corpus = CorpusConfig(corpus_tokens=3000, generated_tokens=256, chunk_tokens=256)
    config = EagleTrainingConfig(intermediate_size=64, vocab_size=64, epochs=8, batch_chunks=1, learning_rate=3e-3,
                                 eagle3=method == "eagle3")
    report = train_eagle(llm, tmp_path / "eagle", corpus, config)
    before, after = report["before"], report["after"]
    assert all(a < b for a, b in zip(after["token_loss"], before["token_loss"])), (before, after)
    if method == "eagle":  # EAGLE-3 has no feature target
        assert all(a < b for a, b in zip(after["feature_loss"], before["feature_loss"])), (before, after)
    assert len(after["top1"]) == config.unroll_steps and after["top1"][0] > before["top1"][0]
    assert report["epochs"][-1]["loss"] < report["epochs"][0]["loss"]
    assert 0 < len((Eagle3Layer if config.eagle3 else EagleLayer).load(tmp_path / "eagle").vocab) <= 64
    again = train_eagle(llm, tmp_path / "eagle", corpus, config)  # every epoch is done: nothing to redo
    assert again["epochs"] == report["epochs"]

    plain = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    spec = LLM(str(tiny_qwen), quantization=None, speculative_config={"method": method, "model": str(tmp_path / "eagle"),
                                                                       "speculative_eagle_topk": 2})
    out = spec.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("method", METHODS)
def test_train_heads_command_eagle(method, tiny_qwen, tmp_path, capsys):
    from specdec.cli import main

    code = main(["train-heads", "--method", method, "--model", str(tiny_qwen), "--out", str(tmp_path / "e"),
                 "--intermediate-size", "32", "--vocab-size", "0", "--corpus-tokens", "600", "--generated-tokens", "0",
                 "--epochs", "1", "--quantization", "none"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["heads"] == str(tmp_path / "e") and all(0 <= a <= 1 for a in printed["after"]["top1"])
    assert (Eagle3Layer if method == "eagle3" else EagleLayer).load(tmp_path / "e").config.intermediate_size == 32


# --- configuration -------------------------------------------------------------------------------------------

def test_sglang_and_vllm_style_config():
    from specdec.config import DEFAULT_EAGLE_DEPTH, DEFAULT_EAGLE_DRAFT_TOKENS, SpeculativeConfig

    default = SpeculativeConfig("eagle")
    assert default.num_speculative_tokens == DEFAULT_EAGLE_DEPTH and default.speculative_eagle_topk == 1
    assert default.speculative_num_draft_tokens == DEFAULT_EAGLE_DEPTH
    tree = SpeculativeConfig("eagle", speculative_num_steps=3, speculative_eagle_topk=4)
    assert tree.num_speculative_tokens == 3 and tree.speculative_num_draft_tokens == DEFAULT_EAGLE_DRAFT_TOKENS
    assert SpeculativeConfig("eagle", 5, speculative_num_steps=5).num_speculative_tokens == 5


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "model": "/nonexistent/layer"}, "no EAGLE draft layer"),
    ({"method": "eagle3", "model": "/nonexistent/layer"}, "no EAGLE-3 draft layer"),
    ({"method": "eagle", "num_speculative_tokens": 3, "speculative_num_steps": 4}, "alias"),
    ({"method": "eagle", "speculative_eagle_topk": 0}, "speculative_eagle_topk"),
    ({"method": "eagle", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
])
def test_bad_config(config, message, tiny_qwen):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), quantization=None, speculative_config=config)


def test_a_layer_for_another_hidden_size_is_refused(tiny_qwen, tmp_path):
    EagleLayer(EagleConfig(32, 24, 4, 2, 8)).save(tmp_path / "other")
    with pytest.raises(ValueError, match="another model"):
        LLM(str(tiny_qwen), quantization=None, speculative_config={"method": "eagle", "model": str(tmp_path / "other")})
    Eagle3Layer(Eagle3Config(64, 24, 4, 2, 16, draft_vocab_size=8, vocab_size=1000)).save(tmp_path / "other3")
    with pytest.raises(ValueError, match="another model"):
        LLM(str(tiny_qwen), quantization=None, speculative_config={"method": "eagle3", "model": str(tmp_path / "other3")})

