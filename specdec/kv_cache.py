"""A pool of per-sequence KV slots, preallocated up to `max_len` tokens each.

Keys are stored after RoPE, so an entry never needs recomputing when it moves:
rollback of a chain is `truncate` (the tail is simply overwritten by the next
forward) and keeping a tree's accepted path is `compact`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCacheFullError(ValueError):
    """A sequence would grow past its slot, or no slot is free."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        # torch.empty: pages are only touched as sequences grow.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._layer_views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    # --- slot accounting -------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self._lengths)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise KVCacheFullError(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop()
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check_slot(slot)
        if slot in self._free:
            raise ValueError(f"KV slot {slot} is already free")
        self._lengths[slot] = 0
        self._free.append(slot)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.keys.shape
        return 2 * layers * heads * dim * self.keys.element_size()

    # --- used by the model's forward ---------------------------------------
    def check_room(self, slot: int, num_new: int) -> None:
        self._check_slot(slot)
        if self._lengths[slot] + num_new > self.max_len:
            raise KVCacheFullError(
                f"sequence in slot {slot} would reach {self._lengths[slot] + num_new} tokens, "
                f"over max_model_len={self.max_len}"
            )

    def write(self, layer: int, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store [heads, n, dim] keys/values at token indices [start, start + n)."""
        n = keys.shape[1]
        self.keys[layer, slot, :, start : start + n] = keys
        self.values[layer, slot, :, start : start + n] = values

    def view(self, layer: int, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, slot, :, :end], self.values[layer, slot, :, :end]

    def layer_views(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the slot's whole keys and values [kv_heads, max_len, head_dim], for kernels told the cached
        length: made once per slot, as slicing two views per layer and forward costs ~5 µs a layer."""
        self._check_slot(slot)
        if slot not in self._layer_views:
            self._layer_views[slot] = list(zip(self.keys[:, slot].unbind(0), self.values[:, slot].unbind(0)))
        return self._layer_views[slot]

    def advance(self, slot: int, num_new: int) -> None:
        self.check_room(slot, num_new)
        self._lengths[slot] += num_new

    # --- rollback ----------------------------------------------------------
    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens (chain rollback)."""
        self._check_slot(slot)
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self._lengths[slot] = length

    def compact(self, slot: int, prefix_len: int, keep_positions: Sequence[int]) -> None:
        """Keep tokens [0, prefix_len) and then `keep_positions` (ascending, each >= prefix_len),
        moved to follow the prefix: a tree's accepted path becomes a plain chain."""
        self._check_slot(slot)
        keep = list(keep_positions)
        end = self._lengths[slot]
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and (keep[0] < prefix_len or keep[-1] >= end)):
            raise ValueError(f"keep_positions must ascend within [{prefix_len}, {end}), got {keep}")
        if keep:
            index = torch.tensor(keep, device=self.keys.device)
            for cache in (self.keys, self.values):
                moved = cache[:, slot, :, index]  # advanced indexing copies first, so overlap is safe
                cache[:, slot, :, prefix_len : prefix_len + len(keep)] = moved
        self._lengths[slot] = prefix_len + len(keep)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"no KV slot {slot} (pool has {self.num_slots})")
