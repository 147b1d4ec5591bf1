"""Growing EAGLE-2-style dynamic draft trees with a draft network that has its own KV cache.

Shared by the EAGLE layer and independent draft models (SGLang's "standalone" speculation takes the
same knobs). Each sequence has caught up to `real` cached positions, and its last row's logits start
the search (depth 1). Then, one draft forward per depth for every sequence at once, the search's
frontier is fed: each node at position real + depth − 1, seeing the real positions and its own
expanded ancestors (which the earlier depths wrote behind them). The rows' logits give the nodes'
children. The cache is cut back to `real` at the end: drafting leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.kv_cache import KVCache
from specdec.models.batch import ForwardBatch, ForwardOutput, SequenceInput
from specdec.spec.draft_tree import DraftTreeSearch
from specdec.spec.proposers.base import Draft
from specdec.spec.tree import ROOT, TokenTree

# a draft forward: (batch, its KV cache, the rows' token ids [n], their parents' output rows [n, H]) → output, whose
# `hidden` rows are what a child row reads (a draft model ignores them; EAGLE's layer feeds them back)
DraftForward = Callable[[ForwardBatch, KVCache, torch.Tensor, torch.Tensor], ForwardOutput]


def grow_trees(forward: DraftForward, cache: KVCache, slots: list[int], searches: list[DraftTreeSearch],
               logits: torch.Tensor, hidden: torch.Tensor, token_ids: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """`logits`, `hidden` [rows, ·]: each sequence's last caught-up row. `token_ids` maps the draft's logit columns
    to token ids. Returns the draft forwards each sequence ran (the catch-up's included)."""
    real = [cache.length(slot) for slot in slots]
    rows = list(range(len(slots)))
    parent_hidden: list[dict[int, torch.Tensor]] = [{} for _ in rows]  # candidate → its parent row's output
    _add_children(searches, parent_hidden, rows, [ROOT] * len(rows), logits, hidden, token_ids)
    written: list[dict[int, int]] = [{} for _ in rows]  # expanded candidate → its cache position
    forwards = [1] * len(rows)
    while frontier := [(r, nodes) for r in rows if (nodes := searches[r].frontier())]:
        inputs, tokens_fed, parents_hidden, owners, parents = [], [], [], [], []
        for r, nodes in frontier:
            search, cached = searches[r], cache.length(slots[r])
            depth = search.candidates[nodes[0]].depth
            mask = torch.zeros(len(nodes), cached + len(nodes), dtype=torch.bool)
            mask[:, : real[r]] = True
            for j, node in enumerate(nodes):
                written[r][node] = cached + j
                mask[j, cached + j] = True
                ancestor = search.candidates[node].parent
                while ancestor != ROOT:
                    mask[j, written[r][ancestor]] = True
                    ancestor = search.candidates[ancestor].parent
            tokens = [search.candidates[n].token for n in nodes]
            inputs.append(SequenceInput(slots[r], tokens, [real[r] + depth - 1] * len(nodes), mask))
            tokens_fed += tokens
            parents_hidden += [parent_hidden[r][n] for n in nodes]
            owners += [r] * len(nodes)
            parents += nodes
            forwards[r] += 1
        batch = ForwardBatch.build(inputs, [cache.length(slots[r]) for r, _ in frontier])
        out = forward(batch, cache, torch.tensor(tokens_fed), torch.stack(parents_hidden))
        _add_children(searches, parent_hidden, owners, parents, out.logits, out.hidden, token_ids)
    for slot, length in zip(slots, real):
        cache.truncate(slot, length)
    return forwards


def _add_children(searches: list[DraftTreeSearch], parent_hidden: list[dict[int, torch.Tensor]], owners: list[int],
                  parents: list[int], logits: torch.Tensor, hidden: torch.Tensor,
                  token_ids: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Row j's top-k tokens become children of `parents[j]` in search `owners[j]`, remembering row j's output."""
    top_k = min(searches[0].top_k, logits.shape[-1])
    logprobs, indices = logits.float().log_softmax(-1).topk(top_k, dim=-1)
    tokens = token_ids(indices).tolist()
    for j, (r, parent) in enumerate(zip(owners, parents)):
        search = searches[r]
        first = len(search.candidates)
        search.add_children(parent, tokens[j], logprobs[j].tolist())
        for child in range(first, len(search.candidates)):
            parent_hidden[r][child] = hidden[j]


def tree_draft(batch: int, rows: list[int], searches: list[DraftTreeSearch], forwards: list[int], caught_up: list[int],
               chain: bool) -> Draft:
    """The searches' trees (sequence rows[r] ← searches[r]; the others draft nothing) as the engine's Draft: chains
    where `chain`, else token trees; the draft's work is its forwards, the first over `caught_up[r]` tokens and each
    later one over a frontier of top-k nodes."""
    drafts: list[list[int]] = [[] for _ in range(batch)]
    trees: list[TokenTree | None] = [None] * batch
    num_forwards, fed = [0] * batch, [0] * batch
    for r, i in enumerate(rows):
        trees[i], drafts[i] = searches[r].tree()
        num_forwards[i] = forwards[r]
        fed[i] = caught_up[r] + (forwards[r] - 1) * searches[r].top_k
    draft = Draft.deterministic(drafts)
    return Draft(draft.tokens, draft.num_tokens, None, num_tokens_fed=fed, trees=None if chain else trees,
                 num_forwards=num_forwards)
