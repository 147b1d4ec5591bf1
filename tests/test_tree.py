"""Token trees and tree verification, without models: structure, masks, greedy identity, distributions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import chi_square_pvalue
from specdec.spec import verifier
from specdec.spec.tree import ROOT, TokenTree
from specdec.spec.verifier import tree_greedy_match, tree_rejection_sample, tree_typical_accept

MEDUSA_LIKE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


@st.composite
def trees(draw, max_nodes: int = 12) -> TokenTree:
    n = draw(st.integers(1, max_nodes))
    return TokenTree(tuple(draw(st.integers(ROOT, node - 1)) for node in range(n)))


# --- structure ---------------------------------------------------------------------------

def test_from_choices_orders_depth_first_and_links_parents():
    tree = TokenTree.from_choices(MEDUSA_LIKE)
    # (0,) (0, 0) (0, 0, 0) (0, 1) (0, 1, 0) (1,) (1, 0) (2,)
    assert tree.parents == (ROOT, 0, 1, 0, 3, ROOT, 5, ROOT)
    assert tree.ranks == (0, 0, 0, 1, 0, 1, 0, 2)
    assert tree.depths == (1, 2, 3, 2, 3, 1, 2, 1)
    assert tree.children(ROOT) == (0, 5, 7) and tree.children(0) == (1, 3) and tree.children(7) == ()
    assert tree.leaf_paths() == [[0, 1, 2], [0, 3, 4], [5, 6], [7]]
    assert TokenTree.chain(3).parents == (ROOT, 0, 1) and TokenTree.chain(3).max_depth == 3
    assert tree.sizes() == [0, 3, 6, 8]
    small, kept = tree.pruned(2)
    assert kept == [0, 1, 3, 5, 6, 7] and small.parents == (ROOT, 0, 0, ROOT, 3, ROOT)
    assert small.ranks == (0, 0, 1, 1, 0, 2) and small.sizes() == [0, 3, 6]


@settings(max_examples=100, deadline=None)
@given(tree=trees(), prefix_len=st.integers(0, 5), fed=st.integers(0, 5))
def test_mask_with_prefix_rows_fed_in_the_same_forward(tree, prefix_len, fed):
    fed = min(fed, prefix_len)
    mask = tree.attention_mask(prefix_len, fed)
    assert torch.equal(mask[fed:], tree.attention_mask(prefix_len))
    causal = torch.ones(fed, prefix_len, dtype=torch.bool).tril(diagonal=prefix_len - fed)
    assert torch.equal(mask[:fed, :prefix_len], causal) and not mask[:fed, prefix_len:].any()


@pytest.mark.parametrize("choices, message", [
    ([(0,), (0, 1, 0)], "no parent choice"),
    ([], "at least one"),
    ([(0,), (-1,)], "ranks"),
    ([()], "non-empty"),
])
def test_bad_choices(choices, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.from_choices(choices)


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree((ROOT, 2, 0))


@settings(max_examples=100, deadline=None)
@given(tree=trees(), prefix_len=st.integers(0, 5), root_position=st.integers(0, 50))
def test_mask_and_positions(tree, prefix_len, root_position):
    mask = tree.attention_mask(prefix_len)
    n = tree.num_nodes
    assert mask.shape == (1 + n, prefix_len + 1 + n)
    assert mask[:, : prefix_len + 1].all() and not mask[0, prefix_len + 1 :].any()
    for node in range(n):
        ancestors, a = set(), node
        while a != ROOT:
            ancestors.add(a)
            a = tree.parents[a]
        assert {j for j in range(n) if mask[1 + node, prefix_len + 1 + j]} == ancestors
    positions = tree.positions(root_position)
    assert positions[0] == root_position
    assert all(positions[1 + node] == root_position + len(tree.path_to(node)) for node in range(n))


# --- a synthetic target: a Markov chain over a small vocabulary ---------------------------

V = 6


def markov(seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(V, V, generator=g), dim=-1)


TARGET = markov(1)
DRAFT = 0.6 * TARGET + 0.4 * markov(2)  # a draft that agrees with the target often, not always


def rows_for(tree: TokenTree, root: int, tokens: list[int], table: torch.Tensor) -> torch.Tensor:
    """The Markov chain's next-token distribution after the root and after each node: [1 + n, V]."""
    return torch.stack([table[root], *(table[t] for t in tokens)])


@settings(max_examples=200, deadline=None)
@given(tree=trees(), root=st.integers(0, V - 1), data=st.data())
def test_greedy_tree_is_token_identical_to_greedy_decoding(tree, root, data):
    argmax = TARGET.argmax(-1)
    # node tokens: often the target's choice (so paths get accepted), sometimes not
    tokens = []
    for node, parent in enumerate(tree.parents):
        previous = root if parent == ROOT else tokens[parent]
        tokens.append(int(argmax[previous]) if data.draw(st.booleans()) else data.draw(st.integers(0, V - 1)))
    result = tree_greedy_match(tree, tokens, rows_for(tree, root, tokens, TARGET).argmax(-1).tolist())
    expected, last = [], root
    for _ in result.tokens:
        last = int(argmax[last])
        expected.append(last)
    assert result.tokens == expected
    assert [tokens[c] for c in result.path] == expected[:-1]
    assert result.path == [] or result.path == tree.path_to(result.path[-1])


def test_greedy_takes_the_deepest_match_when_siblings_repeat_a_token():
    tree = TokenTree((ROOT, ROOT, 1))  # two depth-1 nodes proposing the same token; only the second has a child
    argmax = [7, 8, 8, 9]  # after the root: 7; after node 1: 8; after node 2: 9
    result = tree_greedy_match(tree, [7, 7, 8], argmax)
    assert result.path == [1, 2] and result.tokens == [7, 8, 9]


# --- distributions: the first three tokens against the chain's exact law -------------------------

SAMPLES = 30_000
ROOT_TOKEN = 2


def exact_three() -> torch.Tensor:
    first = TARGET[ROOT_TOKEN]
    return first[:, None, None] * TARGET[:, :, None] * TARGET[None, :, :].expand(V, V, V)


def sample_three(tree: TokenTree, sampled_children: bool, seed: int = 7) -> tuple[torch.Tensor, float]:
    """Counts of (t1, t2, t3): a tree step from the root, then plain draws from the target for what it left."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, V)
    accepted = 0
    top = DRAFT.argsort(-1, descending=True)
    for _ in range(SAMPLES):
        tokens: list[int] = []
        for node, parent in enumerate(tree.parents):
            previous = ROOT_TOKEN if parent == ROOT else tokens[parent]
            if sampled_children:  # children drawn i.i.d. from q after their parent
                tokens.append(int(torch.multinomial(DRAFT[previous], 1, generator=g)))
            else:  # deterministic candidates: the draft's top-k, rank = the node's rank
                tokens.append(int(top[previous, tree.ranks[node]]))
        q = rows_for(tree, ROOT_TOKEN, tokens, DRAFT) if sampled_children else None
        result = tree_rejection_sample(tree, tokens, rows_for(tree, ROOT_TOKEN, tokens, TARGET), g, q)
        accepted += len(result.path)
        out = result.tokens[:3]
        while len(out) < 3:
            out.append(int(torch.multinomial(TARGET[out[-1]], 1, generator=g)))
        counts[out[0], out[1], out[2]] += 1
    return counts, accepted / SAMPLES


@pytest.mark.parametrize("sampled_children", [False, True], ids=["top-k candidates", "sampled children"])
def test_tree_rejection_sampling_is_lossless(sampled_children):
    tree = TokenTree.from_choices(MEDUSA_LIKE)
    counts, mean_accepted = sample_three(tree, sampled_children)
    assert 0.3 < mean_accepted < 2.5  # paths are accepted and rejected at every depth
    assert chi_square_pvalue(counts, exact_three()) > 1e-4


def test_power_a_verifier_that_forgets_the_residual_fails(monkeypatch):
    """The classic bug: after a rejection, draw from p instead of norm(max(0, p − q))."""
    monkeypatch.setattr(verifier, "_residual", lambda p_i, q_i, x: p_i)
    counts, _ = sample_three(TokenTree.from_choices(MEDUSA_LIKE), sampled_children=True)
    assert chi_square_pvalue(counts, exact_three()) < 1e-6


# --- typical acceptance (lossy, opt-in) ------------------------------------------------

def test_typical_acceptance_keeps_the_deepest_passing_path():
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0), (1, 0, 0)])
    p = torch.zeros(1 + tree.num_nodes, 4)
    p[0] = torch.tensor([0.5, 0.3, 0.15, 0.05])  # after the root: tokens 0 and 1 pass, 3 does not
    p[1:] = torch.tensor([0.7, 0.15, 0.1, 0.05])
    # nodes (0,) (0, 0) (1,) (1, 0) (1, 0, 0); the last proposes token 3, which fails under its parent's p
    tokens = [0, 0, 1, 0, 3]
    result = tree_typical_accept(tree, tokens, p, torch.Generator().manual_seed(0), posterior_threshold=0.09)
    assert result.path == [0, 1]  # depth 2 reached through node 0 (first in order) and node 2 alike
    assert result.tokens[:2] == [0, 0]


@settings(max_examples=100, deadline=None)
@given(tree=trees(), root=st.integers(0, V - 1), seed=st.integers(0, 1000))
def test_typical_acceptance_at_temperature_zero_is_greedy(tree, root, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (tree.num_nodes,), generator=g).tolist()
    argmax = rows_for(tree, root, tokens, TARGET).argmax(-1)
    one_hot = torch.nn.functional.one_hot(argmax, V).float()
    typical = tree_typical_accept(tree, tokens, one_hot, g)
    assert typical.tokens == tree_greedy_match(tree, tokens, argmax.tolist()).tokens
