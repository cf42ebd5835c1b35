import numpy as np

from serve_app.models.batching import length_buckets, pad_left, pad_right


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
