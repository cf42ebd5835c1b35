"""A replica's KV cache: one preallocated array of fixed slots (pure numpy).

Layout (L, 2, slots, heads, width, head_dim), float32, allocated once: a slot
holds one sequence's keys and values at positions 0..len-1, so its memory is
bounded by slots x width whatever the traffic. The exported GPT graph takes a
`past` tensor and appends the new positions at its end; `gather` builds that
tensor for a batch of slots (each row left-aligned, a masked gap up to the
batch's longest row) and `store` writes the graph's new columns back at each
row's own length. Nothing is reallocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheShape:
    n_layers: int
    n_heads: int
    head_dim: int
    width: int  # positions per slot: the model's context window


class KVCache:
    def __init__(self, shape: CacheShape, slots: int) -> None:
        if slots < 1:
            raise ValueError("a KV cache needs at least one slot")
        self.shape = shape
        self.slots = slots
        self.data = np.zeros((shape.n_layers, 2, slots, shape.n_heads, shape.width, shape.head_dim), dtype=np.float32)
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

    def gather(self, slots: list[int], width: int) -> np.ndarray:
        """`past` for a batch: (L, 2, B, heads, width, head_dim), row i from slots[i]."""
        L, _, _, nh, _, hd = self.data.shape
        past = np.empty((L, 2, len(slots), nh, width, hd), dtype=np.float32)
        # A block copy per row: faster than fancy indexing, which copies twice.
        for i, slot in enumerate(slots):
            past[:, :, i] = self.data[:, :, slot, :, :width]
        return past

    def store(self, slots: list[int], present: np.ndarray, past_width: int, counts: list[int]) -> None:
        """Write each row's `counts[i]` new positions from the graph's `present` (they start at
        column `past_width`) at that slot's current length, and advance the length."""
        for i, (slot, n) in enumerate(zip(slots, counts, strict=True)):
            start = int(self.lengths[slot])
            if start + n > self.shape.width:
                raise ValueError(f"slot {slot} would hold {start + n} positions; its width is {self.shape.width}")
            self.data[:, :, slot, :, start : start + n, :] = present[:, :, i, :, past_width : past_width + n, :]
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
