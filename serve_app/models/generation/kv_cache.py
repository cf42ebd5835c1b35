"""A replica's KV cache: one preallocated array of fixed slots (pure numpy).

Layout (L, 2, slots, heads, width, head_dim), allocated once: a slot holds one
sequence's keys and values at positions 0..len-1, so its memory is bounded by
slots x width whatever the traffic. The exported decoder takes the past the way
Hugging Face exports do, a (B, heads, P, head_dim) key and value per layer
(`Past`: layer 0's key, layer 0's value, layer 1's key...), and returns them
with the new positions appended; `gather` builds that past for a batch of slots
(each row left-aligned, a masked gap up to the batch's longest row) and `store`
writes the graph's new columns back at each row's own length. Nothing is
reallocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Per layer, its key then its value, each (B, heads, positions, head_dim).
Past = list[np.ndarray]


def past_names(n_layers: int) -> list[str]:
    """The graph inputs a Past feeds, in its order."""
    return [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def present_names(n_layers: int) -> list[str]:
    """The graph outputs that come back as a Past, in its order."""
    return [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


@dataclass(frozen=True)
class CacheShape:
    n_layers: int
    n_heads: int
    head_dim: int
    width: int  # positions per slot: the model's context window
    dtype: str = "float32"

    def empty_past(self, batch: int) -> Past:
        return [np.zeros((batch, self.n_heads, 0, self.head_dim), dtype=self.dtype) for _ in range(2 * self.n_layers)]


class KVCache:
    def __init__(self, shape: CacheShape, slots: int) -> None:
        if slots < 1:
            raise ValueError("a KV cache needs at least one slot")
        self.shape = shape
        self.slots = slots
        self.data = np.zeros((shape.n_layers, 2, slots, shape.n_heads, shape.width, shape.head_dim), dtype=shape.dtype)
        self.lengths = np.zeros(slots, dtype=np.int64)  # cached positions per slot
        # Lowest slot first, so a lightly loaded replica touches the same few slots (warm in CPU caches).
        self._free = list(range(slots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.slots - len(self._free)

    @property
    def used_positions(self) -> int:
        return int(self.lengths.sum())

    @property
    def capacity_positions(self) -> int:
        return self.slots * self.shape.width

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache full")  # callers check free_slots first: a bug, not load
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        # The stale keys stay: every read masks positions at or past the slot's length.
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def gather(self, slots: list[int], width: int) -> Past:
        """The past for a batch, row i from slots[i]: per layer a (B, heads, width, head_dim) key and value."""
        L, _, _, nh, _, hd = self.data.shape
        past = np.empty((L, 2, len(slots), nh, width, hd), dtype=self.data.dtype)
        # A block copy per row: faster than fancy indexing, which copies twice.
        for i, slot in enumerate(slots):
            past[:, :, i] = self.data[:, :, slot, :, :width]
        return [past[layer, kind] for layer in range(L) for kind in (0, 1)]  # contiguous views, no copy

    def store(self, slots: list[int], present: Past, past_width: int, counts: list[int]) -> None:
        """Write each row's `counts[i]` new positions from the graph's present (they start at
        column `past_width`) at that slot's current length, and advance the length."""
        L = self.shape.n_layers
        for i, (slot, n) in enumerate(zip(slots, counts, strict=True)):
            start = int(self.lengths[slot])
            if start + n > self.shape.width:
                raise ValueError(f"slot {slot} would hold {start + n} positions; its width is {self.shape.width}")
            for layer in range(L):
                for kind in (0, 1):
                    new = present[2 * layer + kind][i, :, past_width : past_width + n, :]
                    self.data[layer, kind, slot, :, start : start + n, :] = new
            self.lengths[slot] = start + n

    def swap_out(self, slot: int) -> np.ndarray:
        """Copy a slot's cached positions out (a preempted sequence keeps them) and free it."""
        saved = self.data[:, :, slot, :, : self.lengths[slot], :].copy()
        self.release(slot)
        return saved

    def swap_in(self, saved: np.ndarray) -> int:
        """Put positions saved by `swap_out` into a free slot, bit for bit."""
        slot = self.allocate()
        n = saved.shape[3]
        self.data[:, :, slot, :, :n, :] = saved
        self.lengths[slot] = n
        return slot
