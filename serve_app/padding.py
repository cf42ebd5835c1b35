"""Per-batch padding and length bucketing for variable-length text (pure numpy)."""

from __future__ import annotations

import numpy as np


def length_edge(n: int, min_bucket: int = 8) -> int:
    """The power-of-two length range (..8], (8..16], ... that a sequence of `n` tokens falls in."""
    edge = min_bucket
    while edge < n:
        edge *= 2
    return edge


def length_buckets(lengths: list[int], min_bucket: int = 8) -> list[list[int]]:
    """Group item indices so that each group pads to at most 2x its shortest member.

    Buckets are power-of-two length ranges (..8], (8..16], (16..32], ...: a short
    request is never padded to the longest one in the batch.
    """
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(length_edge(n, min_bucket), []).append(i)
    return [groups[k] for k in sorted(groups)]


def length_edges(max_len: int, min_bucket: int = 8) -> list[int]:
    """Every length a GPU session pads text to: the bucket edges up to `max_len`, and `max_len`
    itself for the last bucket (a model takes no longer sequence than it was built for)."""
    edges, edge = [], min_bucket
    while edge < max_len:
        edges.append(edge)
        edge *= 2
    edges.append(max(max_len, 1))
    return edges


def pad_right(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) ids and attention mask, padded on the right to `length` (default: the longest sequence)."""
    T = max(1, max((len(s) for s in seqs), default=1), length or 0)
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


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes a GPU session runs: powers of two below `max_batch_size`, and it.

    Each new input shape costs ONNX Runtime's CUDA provider a first run far slower than
    the runs after it (cuDNN's algorithm search and per-shape setup; still so with the
    HEURISTIC search): see benchmarks/results/gpu/ for ResNet-50 on an H100.
    Padding every batch up to one of a few sizes, each run once at replica start, keeps
    that cost out of traffic, for at most 2x the rows on a device that has them to spare.
    Text replicas use these sizes. Convolutions keep the plan of the last shape only, so a
    change between warmed sizes costs as much as a new one: image replicas use the largest
    alone (serve_app.models.classifier.ImageClassifier._buckets).
    """
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max(max_batch_size, 1))
    return sizes


def bucket_size(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `n` rows; `n` itself if none does."""
    return next((b for b in buckets if b >= n), n)


def merged_length_buckets(lengths: list[int], min_bucket: int = 8) -> list[list[int]]:
    """`length_buckets`, with neighbouring buckets run as one while that pads the merged group to
    at most twice the tokens its buckets would pad to apart. For a GPU, where a small run costs
    about its kernel launches whatever its tokens: a batch of short texts runs once, while one long
    text does not pad a batch of short ones to its length."""
    merged: list[list[int]] = []
    apart = 0  # tokens the open group's buckets pad to, each at its own edge
    for bucket in length_buckets(lengths, min_bucket):
        edge = length_edge(lengths[bucket[0]], min_bucket)  # every member of a bucket shares its edge
        if merged and (len(merged[-1]) + len(bucket)) * edge <= 2 * (apart + len(bucket) * edge):
            merged[-1] += bucket
            apart += len(bucket) * edge
        else:
            merged.append(list(bucket))
            apart = len(bucket) * edge
    return merged
