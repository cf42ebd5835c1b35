"""A text replica on a GPU runs only shapes it ran at start: batches padded to a batch bucket and
texts to their length bucket's edge (a new shape's first run is slow on CUDA). No GPU here: the
replica is told it has one, and a recording session checks the shapes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from serve_app.padding import batch_buckets, length_buckets, length_edges, merged_length_buckets

BUCKETS = batch_buckets(8)


class Recording:
    """An ONNX Runtime session that notes the (batch, length) of every run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shapes: list[tuple[int, int]] = []

    def run(self, outputs: Any, feed: dict[str, np.ndarray]) -> Any:
        assert feed["input_ids"].shape == feed["attention_mask"].shape
        self.shapes.append(feed["input_ids"].shape)
        return self.inner.run(outputs, feed)


def text_replica(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import ray

    from serve_app.config import ModelConfig
    from serve_app.models.classifier import TextClassifier

    monkeypatch.setattr(
        ray,
        "get_runtime_context",
        lambda: SimpleNamespace(get_assigned_resources=lambda: {"CPU": 1.0}, get_node_id=lambda: "node"),
    )
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    config = ModelConfig.model_validate({"preset": "bert-tiny", "batching": {"max_batch_size": 8}}).model_dump(mode="json")
    return TextClassifier.func_or_class("bert-heavy", str(model_dir / "bert-heavy"), config)  # type: ignore[attr-defined]


def test_on_a_gpu_text_runs_only_the_shapes_warmed_at_start_and_answers_as_on_cpu(tiny_model_dir, monkeypatch):
    replica = text_replica(tiny_model_dir, monkeypatch)
    texts = ["ok", "a somewhat longer sentence, with a few more words in it", "mid length text here", "x " * 200]
    prepared = replica._prepare(texts)
    on_cpu = replica._forward_all([prepared], replica.session)

    replica._buckets = lambda n=None: BUCKETS  # as on a GPU
    session = Recording(replica.session)
    replica._warm(session, BUCKETS)
    warmed = set(session.shapes)
    assert len(session.shapes) == len(warmed) == len(BUCKETS) * len(length_edges(replica.max_len))
    assert warmed == {(b, t) for b in BUCKETS for t in length_edges(replica.max_len)}

    session.shapes.clear()
    on_gpu = replica._forward_all([prepared, replica._prepare(texts[:3])], session)
    assert set(session.shapes) <= warmed
    # Seven texts in one batch: a run per group of neighbouring length buckets, not per bucket.
    groups = merged_length_buckets([len(s) for p in (prepared, prepared[:3]) for s in p])
    assert len(session.shapes) == len(groups) < len(length_buckets([len(s) for p in (prepared, prepared[:3]) for s in p]))
    # The padding rows and columns change nothing for the real rows (the mask hides them).
    np.testing.assert_allclose(on_gpu[: len(texts)], on_cpu, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(on_gpu[len(texts) :], on_cpu[:3], rtol=1e-4, atol=1e-5)
    # A health probe runs one warmed shape, not the whole warm-up.
    session.shapes.clear()
    replica._probe_one_row(session)
    assert session.shapes == [(1, 8)]


def test_a_text_the_tokenizer_cannot_take_fails_alone_in_its_batch(tiny_model_dir, monkeypatch):
    from serve_app.errors import InvalidInput

    replica = text_replica(tiny_model_dir, monkeypatch)
    results = replica._run_payloads([["the food"], ["a\ud800b"], ["was great", "ok"]], session=replica.session)
    assert isinstance(results[1], InvalidInput) and "not valid Unicode" in str(results[1])
    assert results[0].shape[0] == 1 and results[2].shape[0] == 2
    alone = replica._run_payloads([["the food"]], session=replica.session)[0]
    assert np.allclose(results[0], alone, atol=1e-5)


def test_a_live_batch_size_change_runs_its_new_shapes_before_batches_use_them(tiny_model_dir, monkeypatch):
    replica = text_replica(tiny_model_dir, monkeypatch)
    seen: list[int] = []  # max_batch_size when each warm-up run happened
    session = Recording(replica.session)
    original = session.run

    def run(outputs: Any, feed: dict[str, np.ndarray]) -> Any:
        seen.append(replica.batching.max_batch_size)
        return original(outputs, feed)

    session.run = run  # type: ignore[method-assign]
    replica.sessions = [session]
    replica.reconfigure({"max_batch_size": 16})
    assert session.shapes == []  # on CPU a new shape costs nothing extra: nothing to warm

    monkeypatch.setattr(type(replica), "_buckets", lambda self, n=None: batch_buckets(n or self.batching.max_batch_size))
    replica.reconfigure({"max_batch_size": 32})
    edges = length_edges(replica.max_len)
    assert set(session.shapes) == {(32, t) for t in edges}  # the one size it adds; 1-16 were the old sizes
    assert set(seen) == {16}  # all run before the switch
    assert replica.batching.max_batch_size == 32 and all(lane.max_items == 32 for lane in replica.lanes.values())
    session.shapes.clear()
    replica.reconfigure({"max_batch_size": 32, "batch_wait_timeout_s": 0.01})  # same shapes: nothing to run
    assert session.shapes == []
    replica.reconfigure({"max_batch_size": 24})  # 24 is new; 1-16 ran already
    assert {b for b, _ in session.shapes} == {24}
