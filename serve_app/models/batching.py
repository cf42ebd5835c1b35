"""Per-batch padding and length bucketing for variable-length text (pure numpy)."""

from __future__ import annotations

import numpy as np


def length_buckets(lengths: list[int], min_bucket: int = 8) -> list[list[int]]:
    """Group item indices so that each group pads to at most 2x its shortest member.

    Buckets are power-of-two length ranges (..8], (8..16], (16..32], ...: a short
    request is never padded to the longest one in the batch.
    """
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        edge = min_bucket
        while edge < n:
            edge *= 2
        groups.setdefault(edge, []).append(i)
    return [groups[k] for k in sorted(groups)]


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) ids and attention mask, padded on the right to the longest sequence."""
    T = max(1, max((len(s) for s in seqs), default=1))
    ids = np.full((len(seqs), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) ids and mask padded on the left, so every sequence ends at the last column
    (decoders then append the next token at the same index for all rows)."""
    T = max(1, max((len(s) for s in seqs), default=1))
    ids = np.full((len(seqs), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s) :] = s
            mask[i, T - len(s) :] = 1
    return ids, mask
