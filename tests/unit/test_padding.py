import numpy as np

from serve_app.models.runtime import with_options
from serve_app.padding import (
    batch_buckets,
    bucket_size,
    length_buckets,
    length_edge,
    length_edges,
    merged_length_buckets,
    pad_left,
    pad_right,
)


def test_buckets_never_pad_more_than_twice_the_shortest_member():
    lengths = [3, 60, 9, 17, 8, 33, 1, 16]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        members = [lengths[i] for i in b]
        assert max(members) <= max(8, 2 * min(members)), members


def test_short_request_is_not_padded_to_the_longest():
    buckets = length_buckets([4, 200])
    assert len(buckets) == 2


def test_pad_right_masks_padding():
    ids, mask = pad_right([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_left_aligns_ends():
    ids, mask = pad_left([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == np.int64


def test_batch_buckets_are_powers_of_two_up_to_the_max() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(1) == [1]


def test_a_batch_pads_up_to_the_smallest_bucket_that_holds_it() -> None:
    # The padding rows' contents (zeros, the rows before them unchanged): tests/unit/test_image_feed.py.
    assert bucket_size(3, [1, 2, 4, 8]) == 4
    assert bucket_size(2, [1, 2, 4]) == 2  # already a bucket size
    assert bucket_size(3, [1, 2]) == 3  # larger than every bucket: as is


def test_cuda_sessions_get_the_heuristic_cudnn_search_and_cpu_stays_bare() -> None:
    assert with_options(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"}),
        "CPUExecutionProvider",
    ]
    assert with_options(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_length_edges_cover_every_length_a_bucket_pads_to() -> None:
    assert [length_edge(n) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]
    assert length_edges(64) == [8, 16, 32, 64]
    assert length_edges(100) == [8, 16, 32, 64, 100]  # the last bucket stops at what the model takes
    for max_len in (5, 64, 100):
        assert {min(length_edge(n), max_len) for n in range(1, max_len + 1)} <= set(length_edges(max_len))


def test_pad_right_pads_to_a_given_length() -> None:
    ids, mask = pad_right([[5, 6], [9]], pad_id=0, length=4)
    assert ids.tolist() == [[5, 6, 0, 0], [9, 0, 0, 0]] and mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_on_a_gpu_short_texts_run_together_but_one_long_text_does_not_pad_them_to_its_length():
    # Texts of 8 and 16 tokens: one run, padded to 16 (at most twice what two runs would pad).
    assert merged_length_buckets([5, 12, 3, 14, 15, 7]) == [[0, 2, 5, 1, 3, 4]]
    # One 500-token text beside 63 short ones runs alone.
    assert merged_length_buckets([12] * 63 + [500]) == [list(range(63)), [63]]
    # Every item in exactly one group, and no group pads more than twice its buckets apart.
    lengths = [3, 60, 9, 17, 8, 33, 1, 16, 120, 7, 7, 7]
    groups = merged_length_buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        apart = sum(length_edge(lengths[i]) for i in g)
        assert len(g) * length_edge(max(lengths[i] for i in g)) <= 2 * apart, [lengths[i] for i in g]
