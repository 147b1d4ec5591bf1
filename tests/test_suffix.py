"""Suffix decoding: the counted suffix tree against brute-force counts, speculation, the shared cache."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.spec.proposers.suffix import SuffixTree, best_speculation, speculate, speculate_tree
from specdec.spec.tree import TokenTree


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """Every node as path → (count, continued count, best child's count)."""
    found, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        if path:
            found[path] = (node.count, node.continued, node.best.count if node.best else 0)
        stack += [((*path, token), child) for token, child in node.children.items()]
    return found


def brute_force_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int, int]]:
    count, continued = Counter(), Counter()
    for tokens in sequences:
        for start in range(len(tokens)):
            for length in range(1, min(depth, len(tokens) - start) + 1):
                substring = tuple(tokens[start : start + length])
                count[substring] += 1
                continued[substring] += length < depth and start + length < len(tokens)
    best = Counter()
    for substring, n in count.items():
        if len(substring) > 1:
            best[substring[:-1]] = max(best[substring[:-1]], n)
    return {s: (n, continued[s], best[s]) for s, n in count.items()}


@settings(max_examples=200, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=5),
    chunk=st.integers(1, 6),
    depth=st.integers(1, 6),
    removed=st.sets(st.integers(0, 4)),
)
def test_tree_counts_every_substring_and_removal_takes_them_back(sequences, chunk, depth, removed):
    tree = SuffixTree(depth)
    for start in range(0, max(map(len, sequences)), chunk):  # sequences grow interleaved, in chunks
        for key, tokens in enumerate(sequences):
            tree.extend(key, tokens[start : start + chunk])
    assert tree_counts(tree) == brute_force_counts(sequences, depth)
    for key in sorted(removed & set(range(len(sequences)))):
        tree.remove(key, sequences[key])
    kept = [tokens for key, tokens in enumerate(sequences) if key not in removed]
    assert tree_counts(tree) == brute_force_counts(kept, depth)
    assert tree.num_nodes == len(brute_force_counts(kept, depth))


def test_speculation_follows_the_most_frequent_continuation_while_likely():
    tree = SuffixTree(4)
    tree.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    [_, node_12] = tree.match([5, 1, 2])  # "2" and "1 2" occur, "5 1 2" does not
    found = speculate(node_12, 10, 0.1)
    # "1 2" is followed by 3 twice and 4 once (2/3); "1 2 3" by 1 once, its end by nothing (1/1)
    assert found.tokens == [3, 1] and abs(found.score - 4 / 3) < 1e-12  # depth 4 ends the path
    assert speculate(node_12, 10, 0.7).tokens == []
    assert speculate(node_12, 1, 0.1).tokens == [3]
    # a 2-token match proposes at most 2 × factor tokens; the best score over match lengths wins
    assert best_speculation([tree], [5, 1, 2], 10, 0.5, 0.1).tokens == [3]
    assert best_speculation([tree], [9], 10, 1.0, 0.1).tokens == []


def test_tree_speculation_takes_the_most_probable_continuations_best_first():
    tree = SuffixTree(4)
    tree.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
    [_, node_12] = tree.match([5, 1, 2])
    # below "1 2": 3 (2/3), then "3 1" (2/3 · 1: "1 2 3" continues once, with 1), 4 (1/3), "4 1" (1/3 · 1)
    found = speculate_tree(node_12, 10, 0.1)
    assert found.tokens == [3, 1, 4, 1] and found.parents == (-1, 0, -1, 2)
    assert abs(found.score - 2.0) < 1e-12
    assert speculate_tree(node_12, 2, 0.1).tokens == [3, 1]  # a node budget
    assert speculate_tree(node_12, 10, 0.5).tokens == [3, 1]  # 4 is below the probability floor
    chain = speculate(node_12, 10, 0.1)
    assert found.tokens[: len(chain.tokens)] == chain.tokens  # the chain is the tree's first branch here
    assert best_speculation([tree], [5, 1, 2], 10, 2.0, 0.1, as_tree=True).parents == (-1, 0, -1, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=40), st.integers(1, 12), st.floats(0.0, 0.5))
def test_tree_speculation_is_a_valid_tree_of_paths_that_occur(tokens, budget, floor):
    tree = SuffixTree(6)
    tree.extend("a", tokens)
    for node in tree.match(tokens[-3:]):
        found = speculate_tree(node, budget, floor)
        assert len(found.tokens) <= budget
        token_tree = TokenTree(found.parents) if found.parents else None  # parents first, or it raises
        for j in range(len(found.tokens)):
            path = [found.tokens[a] for a in token_tree.path_to(j)]
            below = node
            for t in path:  # every node's path continues the match somewhere in the sequence
                below = below.children[t]


def _suffix_llm(model, **options) -> LLM:
    return LLM(str(model), quantization=None, max_model_len=256, speculative_config={"method": "suffix", "adaptive": False, **options})


def _accepted(llm: LLM, prompt: str) -> tuple[list[int], int]:
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].token_ids, out.metrics.speculative_decoding["num_accepted_tokens"]


def test_outputs_are_shared_across_requests_only_within_one_engine_and_only_as_configured(tiny_qwen):
    prompt = "a quick test of sharing"
    shared = _suffix_llm(tiny_qwen, num_speculative_tokens=8)
    tokens, first = _accepted(shared, prompt)
    again, second = _accepted(shared, prompt)
    assert again == tokens and second > first  # the first answer is in the shared tree: copied
    _, fresh = _accepted(_suffix_llm(tiny_qwen, num_speculative_tokens=8), prompt)
    assert fresh == first  # a new engine starts empty: no state outside the engine
    isolated = _suffix_llm(tiny_qwen, num_speculative_tokens=8, suffix_decoding_max_cached_requests=0)
    assert _accepted(isolated, prompt)[1] == _accepted(isolated, prompt)[1]
    assert isolated.engine.proposer.shared is None


def test_shared_tree_keeps_at_most_max_cached_requests_outputs(tiny_qwen):
    llm = _suffix_llm(tiny_qwen, num_speculative_tokens=4, suffix_decoding_max_cached_requests=2)
    proposer = llm.engine.proposer
    outputs = [_accepted(llm, prompt)[0] for prompt in ["one", "two two", "three three three", "four"]]
    assert len(proposer.cached) == 2
    assert list(proposer.cached.values()) == outputs[2:]  # the least recently finished went first
    assert tree_counts(proposer.shared) == brute_force_counts(outputs[2:], proposer.max_depth)
    assert not proposer._local and not llm.engine.running  # finished sequences leave no per-sequence state
