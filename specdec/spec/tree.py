"""Token trees for tree speculation (pure): structure, attention mask, positions, paths.

A tree hangs below its root: the last sampled token, not yet in the KV cache. A verify forward feeds
the root and then the n nodes in the tree's order (every parent before its children), each attending
to the cached prefix, the root and its own ancestors; row 0 of its logits is the target's distribution
after the root, row 1 + j the one after the path root → node j. Siblings are tried in node order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1  # the parent of depth-1 nodes


@dataclass(frozen=True)
class TokenTree:
    """`parents[j]`: node j's parent (ROOT or an earlier node). `ranks[j]`: which candidate node j is among
    the proposals under its parent (Medusa: the top-k index of its head); sibling order by default."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    depths: tuple[int, ...] = field(init=False, repr=False)
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)  # [1 + parent]

    def __post_init__(self) -> None:
        depths = []
        for node, parent in enumerate(self.parents):
            if not ROOT <= parent < node:
                raise ValueError(f"node {node}'s parent must be {ROOT} (the root) or an earlier node, got {parent}")
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        children: list[list[int]] = [[] for _ in range(1 + len(self.parents))]
        for node, parent in enumerate(self.parents):
            children[1 + parent].append(node)
        object.__setattr__(self, "_children", tuple(map(tuple, children)))
        if not self.ranks:
            seen: dict[int, int] = {}
            ranks = []
            for parent in self.parents:
                ranks.append(seen.get(parent, 0))
                seen[parent] = ranks[-1] + 1
            object.__setattr__(self, "ranks", tuple(ranks))
        elif len(self.ranks) != len(self.parents) or min(self.ranks) < 0:
            raise ValueError("ranks must give one non-negative rank per node")

    @classmethod
    def chain(cls, length: int) -> "TokenTree":
        return cls(tuple(range(-1, length - 1)))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "TokenTree":
        """Medusa's / vLLM's `speculative_token_tree`: each choice (i_1, …, i_d) is the node reached by taking
        the i_1-th candidate at depth 1, …, the i_d-th at depth d; every prefix of a choice is a choice too.
        Nodes are in depth-first order (the choices sorted): the first branch, each node's first candidate, is a
        chain at the front, whose rows attend to the cache as a chain's do (the others' ancestors are copied)."""
        paths = sorted({tuple(c) for c in choices})
        if not paths:
            raise ValueError("a token tree needs at least one choice")
        index = {path: node for node, path in enumerate(paths)}
        parents = []
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"a choice is a non-empty tuple of candidate ranks ≥ 0, got {path}")
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"choice {path} has no parent choice {path[:-1]}")
            parents.append(ROOT if len(path) == 1 else index[path[:-1]])
        return cls(tuple(parents), tuple(path[-1] for path in paths))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> tuple[int, ...]:
        """The nodes under `node` (ROOT for the depth-1 nodes), in the order verification tries them."""
        return self._children[1 + node]

    def path_to(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """One path per leaf, in node order of the leaves."""
        parents = set(self.parents)
        return [self.path_to(node) for node in range(self.num_nodes) if node not in parents]

    def attention_mask(self, prefix_len: int, fed_prefix: int = 0) -> torch.Tensor:
        """[fed_prefix + 1 + n, prefix_len + 1 + n] bool: the root and every node see the prefix, the root and their
        ancestors. The last `fed_prefix` prefix tokens are fed in the same forward (a prompt's last chunk): their
        rows come first, causal."""
        n = self.num_nodes
        mask = torch.zeros(fed_prefix + 1 + n, prefix_len + 1 + n, dtype=torch.bool)
        first = prefix_len - fed_prefix
        mask[:fed_prefix, :prefix_len] = torch.ones(fed_prefix, prefix_len, dtype=torch.bool).tril(diagonal=first)
        tree = mask[fed_prefix:]
        tree[:, : prefix_len + 1] = True
        for node in range(n):
            tree[1 + node, [prefix_len + 1 + a for a in self.path_to(node)]] = True
        return mask

    def pruned(self, max_depth: int) -> tuple["TokenTree", list[int]]:
        """The nodes down to `max_depth` as a tree of their own, and which nodes of this tree they are."""
        if max_depth >= self.max_depth:  # the whole tree (every step's usual case): nothing to rebuild
            return self, list(range(self.num_nodes))
        kept = [node for node in range(self.num_nodes) if self.depths[node] <= max_depth]
        index = {node: i for i, node in enumerate(kept)}
        parents = tuple(ROOT if self.parents[node] == ROOT else index[self.parents[node]] for node in kept)
        return TokenTree(parents, tuple(self.ranks[node] for node in kept)), kept

    def sizes(self) -> list[int]:
        """sizes[d]: how many nodes lie at depth d or above (sizes[0] = 0), d = 0..max_depth."""
        sizes = [0] * (self.max_depth + 1)
        for depth in self.depths:
            sizes[depth] += 1
        for d in range(1, len(sizes)):
            sizes[d] += sizes[d - 1]
        return sizes

    def positions(self, root_position: int) -> torch.Tensor:
        """[1 + n] position ids: the root's, then each node's depth below it."""
        return torch.tensor([root_position, *(root_position + d for d in self.depths)], dtype=torch.long)
