import numpy as np
import pytest

from serve_app.models.generation.kv_cache import CacheShape, KVCache

SHAPE = CacheShape(n_layers=2, n_heads=2, head_dim=3, width=8)


def as_list(stacked: np.ndarray) -> list[np.ndarray]:
    """(L, 2, B, H, P, D) as the per-layer key/value list the cache takes."""
    return [stacked[layer, kind] for layer in range(stacked.shape[0]) for kind in (0, 1)]


def stacked(past: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.stack(past[i : i + 2]) for i in range(0, len(past), 2)])


def present(batch: int, past: int, new: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 2, batch, 2, past + new, 3)).astype(np.float32)


def test_memory_is_allocated_once_and_bounded_by_slots():
    cache = KVCache(SHAPE, slots=3)
    assert cache.nbytes == 2 * 2 * 3 * 2 * 8 * 3 * 4
    buffer = cache.data
    slots = [cache.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and cache.free_slots == 0
    with pytest.raises(RuntimeError, match="full"):
        cache.allocate()
    cache.release(slots[1])
    assert cache.allocate() == slots[1]
    assert cache.data is buffer  # never reallocated


def test_store_writes_each_row_at_its_own_length_and_gather_reads_it_back():
    cache = KVCache(SHAPE, slots=2)
    a, b = cache.allocate(), cache.allocate()
    first = present(2, 0, 3)
    cache.store([a, b], as_list(first), past_width=0, counts=[3, 1])  # a fed 3 tokens, b one (right-padded)
    assert list(cache.lengths[[a, b]]) == [3, 1]
    second = present(2, 3, 1, seed=1)
    cache.store([a, b], as_list(second), past_width=3, counts=[1, 1])
    past = stacked(cache.gather([a, b], 4))
    np.testing.assert_array_equal(past[:, :, 0, :, :3], first[:, :, 0, :, :3])
    np.testing.assert_array_equal(past[:, :, 0, :, 3], second[:, :, 0, :, 3])
    np.testing.assert_array_equal(past[:, :, 1, :, 0], first[:, :, 1, :, 0])
    np.testing.assert_array_equal(past[:, :, 1, :, 1], second[:, :, 1, :, 3])  # b's 2nd position came from column P
    assert cache.used_positions == 6


def test_a_slot_cannot_grow_past_the_context_window():
    cache = KVCache(SHAPE, slots=1)
    s = cache.allocate()
    cache.store([s], as_list(present(1, 0, 8)), past_width=0, counts=[8])
    with pytest.raises(ValueError, match="width"):
        cache.store([s], as_list(present(1, 8, 1)), past_width=8, counts=[1])


def test_swap_out_and_in_is_bit_exact_and_frees_the_slot():
    cache = KVCache(SHAPE, slots=1)
    s = cache.allocate()
    p = present(1, 0, 5)
    cache.store([s], as_list(p), past_width=0, counts=[5])
    saved = cache.swap_out(s)
    assert cache.free_slots == 1 and saved.shape == (2, 2, 2, 5, 3)
    other = cache.allocate()  # someone else uses the slot meanwhile
    cache.store([other], as_list(present(1, 0, 7, seed=9)), past_width=0, counts=[7])
    cache.release(other)
    back = cache.swap_in(saved)
    assert cache.lengths[back] == 5
    np.testing.assert_array_equal(stacked(cache.gather([back], 5))[:, :, 0], p[:, :, 0])
