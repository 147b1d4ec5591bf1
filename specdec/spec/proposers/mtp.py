"""MTP self-speculation (DeepSeek-V3 / MiMo; vLLM `method: "mtp"`): the target's own multi-token prediction modules.

Drafting a step γ deep runs module 1 … min(γ, K) in turn, one forward each, all at the position N − 2
of the last target feature (models/mtp.py). Each module first catches up on its real rows, those whose
token is committed: module 1 on the target features the engine handed over since its last run,
module k on module k − 1's outputs at the positions whose token p + k is now committed (kept until
module k runs: a step drafting fewer than k tokens leaves them waiting). Module k ≥ 2's draft row
reads module k − 1's guess with its output. Deeper than K (vLLM's reuse of the last MTP layer), module K
autoregresses as an EAGLE layer does: its row at N − 2 + j reads the previous guess with its own output
one row back, attending to everything before it — a pattern it was not trained on, so its guesses are
weaker (the adaptive controller finds out how much). Draft rows leave the caches after the step. The
draft is a chain of each step's most likely token (deterministic: q = None).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.mtp import MtpDrafter, skipped_rows
from specdec.sampling import greedy_tokens
from specdec.spec.proposers.base import Draft


class MtpProposer:
    needs_hidden_states = True
    stratified = False
    feature_layers = ()

    def __init__(self, drafter: MtpDrafter, max_num_seqs: int, max_model_len: int) -> None:
        self.drafter = drafter
        self.model = drafter.decoders[0]  # every module has this shape: its measured cost curve prices drafting
        self.caches = [decoder.new_kv_cache(max_num_seqs, max_model_len + 1) for decoder in drafter.decoders]
        self._slots: dict[Sequence, list[int]] = {}
        # per sequence and module k: the inputs h_{k−1}(p) of its rows not yet run, from p = its cache length on
        self._pending: dict[Sequence, list[list[torch.Tensor]]] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        rows = [i for i, seq in enumerate(seqs) if num_tokens[i] > 0 and self._ready(seq)]
        drafts: list[list[int]] = [[] for _ in seqs]
        fed, forwards = [0] * len(seqs), [0] * len(seqs)
        carried: dict[int, torch.Tensor] = {}  # row i → the output of its previous draft row
        num_modules = self.drafter.num_modules
        for depth in range(1, 1 + max((num_tokens[i] for i in rows), default=0)):
            module = min(depth, num_modules)
            active = [i for i in rows if num_tokens[i] >= depth]
            inputs, token_ids, hidden, real = [], [], [], []
            for i in active:
                seq = seqs[i]
                slot, cache = self._slots[seq][module - 1], self.caches[module - 1]
                if depth > num_modules:  # module K again, one row further: causal over its cache
                    tokens, positions = [drafts[i][-1]], [seq.num_tokens - 2 + depth - module]
                    states, mask = carried[i][None], None
                    start = end = 0
                else:
                    start, end = cache.length(slot), seq.num_tokens - module  # real rows p = start … end − 1
                    tokens = seq.token_ids_from(start + module)[: end - start]
                    states = self._take(seq, module, end - start)
                    positions = list(range(start, end))
                    if module > 1:  # the draft row at N − 2: the previous module's guess and output
                        tokens, positions = [*tokens, drafts[i][-1]], [*positions, seq.num_tokens - 2]
                        states = torch.cat([states, carried[i][None]])
                    mask = _mask(module, start, positions)
                inputs.append(SequenceInput(slot, tokens, positions, mask, len(tokens)))
                token_ids += tokens
                hidden.append(states)
                real.append(end - start)
            cache = self.caches[module - 1]
            batch = ForwardBatch.build(inputs, [cache.length(s.slot) for s in inputs])
            out = self.drafter.forward(module, batch, cache, torch.tensor(token_ids), torch.cat(hidden))
            best = self.drafter.token_ids(greedy_tokens(out.logits)).tolist()
            row = 0
            for i, item, n_real in zip(active, inputs, real):
                seq, last = seqs[i], row + len(item.token_ids) - 1
                drafts[i].append(best[last])
                carried[i] = out.hidden[last]
                if module < num_modules and n_real:
                    self._pending[seq][module].append(out.hidden[row : row + n_real])
                fed[i] += len(item.token_ids)
                forwards[i] += 1
                row += len(item.token_ids)
        for i in rows:
            for module in range(1, 1 + min(num_tokens[i], num_modules)):
                slot, cache = self._slots[seqs[i]][module - 1], self.caches[module - 1]
                cache.truncate(slot, cache.length(slot) - _draft_rows(module, num_tokens[i], num_modules))
        draft = Draft.deterministic(drafts)
        return Draft(draft.tokens, draft.num_tokens, None, num_tokens_fed=fed, num_forwards=forwards)

    def _ready(self, seq: Sequence) -> bool:
        """Module 1 has new target features, up to every committed token's but the last (the next verify computes
        it)."""
        if seq not in self._slots or not self._pending[seq][0]:
            return False
        slot = self._slots[seq][0]
        return self.caches[0].length(slot) + sum(len(h) for h in self._pending[seq][0]) == seq.num_tokens - 1

    def _take(self, seq: Sequence, module: int, count: int) -> torch.Tensor:
        """The next `count` pending inputs of module `module` (1-based), removed from the queue."""
        queue = self._pending[seq][module - 1]
        states = torch.cat(queue) if queue else torch.zeros(0, self.drafter.embed.shape[1], dtype=self.model.dtype)
        if len(states) < count:
            raise RuntimeError(f"MTP module {module} lacks inputs: {len(states)} of {count}")
        self._pending[seq][module - 1] = [states[count:]] if len(states) > count else []
        return states[:count]

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        if hidden is None:
            raise ValueError("MTP drafts from the target's hidden states: the engine must hand them over")
        for seq, states in zip(seqs, hidden):
            if seq not in self._slots:
                self._slots[seq] = [cache.allocate() for cache in self.caches]
                self._pending[seq] = [[] for _ in self.caches]
            self._pending[seq][0].append(states.to(self.model.dtype))

    def release(self, seq: Sequence) -> None:
        self._pending.pop(seq, None)
        for cache, slot in zip(self.caches, self._slots.pop(seq, [])):
            cache.free(slot)


def _draft_rows(module: int, gamma: int, num_modules: int) -> int:
    """Rows of module k's cache that hold drafts after a step γ deep: its row at N − 2 (k ≥ 2), and module K's rows
    beyond it."""
    return int(module > 1) + (max(0, gamma - num_modules) if module == num_modules else 0)


def _mask(module: int, cached: int, positions: list[int]) -> torch.Tensor | None:
    """Module k's attention over its cache (real row p at index p) and the new rows: the row at position p sees indices
    ≤ p − skipped_rows(k) − 1 and itself; None (causal) where nothing is skipped."""
    skip = skipped_rows(module)
    if skip == 0:
        return None
    mask = torch.zeros(len(positions), cached + len(positions), dtype=torch.bool)
    for j, position in enumerate(positions):
        mask[j, : max(0, min(cached + j, position - skip))] = True
        mask[j, cached + j] = True
    return mask
