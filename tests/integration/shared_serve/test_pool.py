"""A multiplexed pool (serve_app.models.pool): three text models found under one directory by a
`reviews-*` entry, served by one replica that holds at most two of them at a time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.serving import app_for_module, deployment_handle

MEMBERS = ("reviews-de", "reviews-en", "reviews-fr")


@pytest.fixture(scope="module")
def pool_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT three times, each with labels of its own, and one directory the pattern skips."""
    root = tmp_path_factory.mktemp("pool")
    for name in (*MEMBERS, "other-model"):
        shutil.copytree(tiny_model_dir / "bert-light", root / name)
        manifest = json.loads((root / name / "manifest.json").read_text())
        language = name.rsplit("-", 1)[1]
        manifest.update(name=name, labels=[f"{language}-negative", f"{language}-positive"])
        (root / name / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def app_url(pool_dir: Path, serve_url: str) -> Iterator[str]:
    args = {
        "models": {
            "reviews-*": {
                "family": "bert", "path": str(pool_dir), "multiplex": {"max_models_per_replica": 2},
                "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.005},
            },
        },
    }  # fmt: skip
    yield from app_for_module(args, serve_url)


def classify(url: str, model: str, text: str = "a fine film") -> httpx.Response:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def test_each_model_of_the_pool_answers_with_its_own_labels(app_url: str) -> None:
    for model in MEMBERS:
        r = classify(app_url, model)
        assert r.status_code == 200, r.text
        labels = next(o["data"] for o in r.json()["outputs"] if o["name"] == "label")
        assert labels[0].startswith(model.rsplit("-", 1)[1]), labels
        assert r.headers["x-served-by"] == model
        assert httpx.get(f"{app_url}/v2/models/{model}/ready", timeout=10).status_code == 200
    # The directory the pattern does not match is no model.
    assert classify(app_url, "other-model").status_code == 404


def test_a_replica_holds_at_most_its_share_and_loads_an_evicted_model_again(app_url: str) -> None:
    pool = deployment_handle("reviews-pool", "default")
    for model in (*MEMBERS, MEMBERS[0]):  # three models through room for two: the first comes back
        assert classify(app_url, model).status_code == 200
    # The replica ran the model the call named: its own manifest says so.
    meta = pool.options(multiplexed_model_id=MEMBERS[1]).metadata.remote().result(timeout_s=60)
    assert meta["manifest"]["labels"][0] == "en-negative"
    # Every model was loaded on the one replica, which holds two now: the last two it ran.
    info = pool.options(multiplexed_model_id=MEMBERS[0]).runtime_info.remote().result(timeout_s=60)
    assert info["pool"] == "reviews-*" and set(info["load_s"]) == set(MEMBERS)
    assert info["held"] == [MEMBERS[0], MEMBERS[1]], info
