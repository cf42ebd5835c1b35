"""An image batch is built in one pass (serve_app.models.classifier.image_feed): the same floats
as casting, scaling, concatenating and padding one step at a time. No Ray, no ONNX Runtime run."""

from __future__ import annotations

import numpy as np
import pytest

from serve_app.models.classifier import image_feed


def step_by_step(payloads: list[np.ndarray], start: int, stop: int, size: int) -> np.ndarray:
    """The copies image_feed replaces: each payload cast and scaled, the batch joined, sliced and padded."""
    floats = [p.astype(np.float32) / 255.0 if p.dtype == np.uint8 else p.astype(np.float32) for p in payloads]
    rows = np.concatenate(floats)[start:stop]
    padded = np.zeros((size, *rows.shape[1:]), dtype=np.float32)
    padded[: len(rows)] = rows
    return padded


def payloads(sizes: list[int], dtypes: list[type]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out: list[np.ndarray] = []
    for n, dtype in zip(sizes, dtypes, strict=True):
        if dtype is np.uint8:
            out.append(rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8))
        else:
            out.append(rng.random((n, 3, 4, 4), dtype=np.float32))
    return out


@pytest.mark.parametrize(
    ("start", "stop", "size"),
    [(0, 6, 6), (0, 6, 8), (2, 5, 5), (1, 4, 16), (5, 6, 1)],
    ids=["all", "padded", "across-payloads", "across-and-padded", "last-row"],
)
@pytest.mark.parametrize(
    "dtypes", [[np.uint8] * 3, [np.float32] * 3, [np.uint8, np.float32, np.uint8]], ids=["uint8", "float32", "mixed"]
)
def test_one_pass_gives_the_same_floats_as_the_step_by_step_copies(start, stop, size, dtypes):
    batch = payloads([1, 3, 2], dtypes)
    feed = image_feed(batch, start, stop, size)
    assert feed.dtype == np.float32 and feed.shape == (size, 3, 4, 4)
    np.testing.assert_array_equal(feed, step_by_step(batch, start, stop, size))
    assert not feed[stop - start :].any()  # the padding rows are zeros, whatever np.empty held


def test_uint8_pixels_scale_to_the_unit_interval():
    feed = image_feed([np.array([0, 255], dtype=np.uint8).reshape(2, 1, 1, 1)], 0, 2, 2)
    assert feed.ravel().tolist() == [0.0, 1.0]
