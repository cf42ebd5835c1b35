"""A multiplexed pool (serve_app.models.pool): three text models found under one directory by a
`reviews-*` entry, served by one replica that holds at most two of them at a time."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.serving import SHARED_GRPC_PORT, SHARED_PORT, app_for_module, deployment_handle

MEMBERS = ("reviews-de", "reviews-en", "reviews-fr")
OPERATOR_KEY, USER_KEY = "pool-operator-key", "pool-user-key"
AS_USER = {"Authorization": f"Bearer {USER_KEY}"}
AS_OPERATOR = {"Authorization": f"Bearer {OPERATOR_KEY}"}


def user() -> dict[str, str]:
    """The user's headers, a copy each time: tritonclient adds its own to the dict it is given."""
    return dict(AS_USER)


def operator() -> dict[str, str]:
    return dict(AS_OPERATOR)


@pytest.fixture(scope="module")
def pool_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BERT three times, each with labels of its own, and one directory the pattern skips."""
    root = tmp_path_factory.mktemp("pool")
    for name in (*MEMBERS, "other-model"):
        put_model(tiny_model_dir, root, name)
    return root


def put_model(tiny_model_dir: Path, root: Path, name: str) -> None:
    """The tiny BERT as `name` under the pool's directory, its labels named after its language."""
    shutil.copytree(tiny_model_dir / "bert-light", root / name)
    manifest = json.loads((root / name / "manifest.json").read_text())
    language = name.rsplit("-", 1)[1]
    manifest.update(name=name, labels=[f"{language}-negative", f"{language}-positive"])
    (root / name / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def app_url(pool_dir: Path, serve_url: str) -> Iterator[str]:
    args = {
        "models": {
            "reviews-*": {
                "family": "bert", "path": str(pool_dir), "multiplex": {"max_models_per_replica": 2},
                "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.005},
                "faults": {"load_delay_s": 0.5},  # a load long enough to refuse a deadline for
            },
        },
        "tenants": [
            {"name": "ops", "key_sha256": hashlib.sha256(OPERATOR_KEY.encode()).hexdigest(), "operator": True},
            {"name": "user", "key_sha256": hashlib.sha256(USER_KEY.encode()).hexdigest()},
        ],
    }  # fmt: skip
    yield from app_for_module(args, serve_url)


def classify(url: str, model: str, text: str = "a fine film") -> httpx.Response:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, headers=AS_USER, timeout=60)


def test_each_model_of_the_pool_answers_with_its_own_labels(app_url: str) -> None:
    for model in MEMBERS:
        r = classify(app_url, model)
        assert r.status_code == 200, r.text
        labels = next(o["data"] for o in r.json()["outputs"] if o["name"] == "label")
        assert labels[0].startswith(model.rsplit("-", 1)[1]), labels
        assert r.headers["x-served-by"] == model
        assert httpx.get(f"{app_url}/v2/models/{model}/ready", headers=AS_USER, timeout=10).status_code == 200
    # The directory the pattern does not match is no model.
    assert classify(app_url, "other-model").status_code == 404


def test_a_handle_caller_names_the_pools_model_and_gets_its_answer(app_url: str) -> None:
    pool = deployment_handle("reviews-pool", "default")
    texts = [f"a fine film {i}" for i in range(12)]
    asked = {m: [pool.options(multiplexed_model_id=m).classify.remote(t) for t in texts] for m in MEMBERS[:2]}
    for model, calls in asked.items():
        for text, call in zip(texts, calls, strict=True):
            answer = call.result(timeout_s=60)
            routed = classify(app_url, model, text).json()
            assert answer.label == next(o["data"] for o in routed["outputs"] if o["name"] == "label")[0]
            assert answer.label.startswith(model.rsplit("-", 1)[1])


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
    # The evicted model's memory went with it: what the replica holds, and at most the one evicted
    # by the last load (freed at the next), not every model it ever loaded.
    stats = pool.stats.remote().result(timeout_s=60)
    assert stats["resident_models"] <= 3 and len(stats["loads_s"]) >= 4, stats


def test_a_deadline_a_cold_load_would_miss_is_refused_at_once_and_the_load_starts(app_url: str) -> None:
    """The model the test above evicted is held nowhere: a request whose deadline leaves room for
    its batch but not for its load is refused at once (503, Retry-After), and the load starts
    anyway, so that the model is held when the retry comes."""
    model = MEMBERS[2]
    for first in MEMBERS[:2]:  # the replica's two slots, as this router last saw them answer
        assert classify(app_url, first).status_code == 200

    def status() -> dict[str, Any]:
        resp = httpx.get(f"{app_url}/router/status", headers=AS_OPERATOR, timeout=30)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def held_anywhere(pool: dict[str, Any]) -> bool:
        return any(model in seen["models"] for seen in pool["held"].values())

    now = status()
    pool = now["pools"]["reviews-*"]
    assert pool["load_s"] > 0 and not held_anywhere(pool), pool
    warm_ms = now["models"][model]["lanes"]["bulk"]["batch_ms"]["one"]
    timeout_ms = warm_ms + pool["load_s"] * 1e3 / 2  # room for the batch, not for the load
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a fine film"]}]}
    refused = httpx.post(
        f"{app_url}/v2/models/{model}/infer", json=body, timeout=60,
        headers={**AS_USER, "X-Request-Timeout-Ms": f"{timeout_ms:.0f}"},
    )  # fmt: skip
    assert refused.status_code == 503 and "not loaded on any replica" in refused.json()["error"], refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    deadline = time.monotonic() + 60
    while not held_anywhere(status()["pools"]["reviews-*"]):
        assert time.monotonic() < deadline, "the refused request's model was never loaded"
        time.sleep(0.2)
    assert status()["models"][model]["shed"]["cold_load"] == 1
    assert classify(app_url, model).status_code == 200


def _states(client: triton.InferenceServerClient) -> dict[str, tuple[str, str]]:
    index = client.get_model_repository_index(headers=operator())
    return {m["name"]: (m["state"], m.get("reason", "")) for m in index}


def _infer(client: triton.InferenceServerClient, model: str) -> np.ndarray:
    text = triton.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a fine film"], dtype=np.object_), binary_data=True)
    return client.infer(model, [text], headers=user()).as_numpy("logits")


def test_the_repository_extension_through_tritonclient(app_url: str) -> None:
    """Triton's repository extension as tritonclient calls it: index, unload, load, then inference;
    only an operator may load and unload."""
    client = triton.InferenceServerClient(f"127.0.0.1:{SHARED_PORT}")
    model = MEMBERS[2]
    assert _states(client)[model] == ("READY", "")
    with pytest.raises(InferenceServerException, match="is not an operator"):
        client.unload_model(model, headers=user())
    try:
        client.unload_model(model, headers=operator())
        assert _states(client)[model] == ("UNAVAILABLE", "unloaded")
        assert classify(app_url, model).status_code == 503
        assert httpx.get(f"{app_url}/v2/models/{model}/ready", headers=AS_USER, timeout=10).status_code == 503
        assert classify(app_url, MEMBERS[0]).status_code == 200  # the pool's other models serve on
        with pytest.raises(InferenceServerException, match="is not an operator"):
            client.load_model(model, headers=user())
    finally:
        client.load_model(model, headers=operator())
    assert _states(client)[model] == ("READY", "")
    assert _infer(client, model).shape == (1, 2)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.load_model("no-such-model", headers=operator())


def test_an_unload_reaches_the_router_that_did_not_serve_it(app_url: str) -> None:
    """The ledger, not the router that took the call, holds the state: a router that follows it
    (every second) refuses the model too. With one router here, a second view is the ledger's own."""
    import ray

    from serve_app.router.routing.repository import repository_name
    from serve_app.router.routing.rollback_ledger import NAMESPACE

    client = triton.InferenceServerClient(f"127.0.0.1:{SHARED_PORT}")
    ledger = ray.get_actor(repository_name("default"), namespace=NAMESPACE)
    try:
        ray.get(ledger.set.remote(MEMBERS[1], False, time.time()), timeout=30)  # as another router would
        deadline = time.monotonic() + 10
        while classify(app_url, MEMBERS[1]).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _states(client)[MEMBERS[1]] == ("UNAVAILABLE", "unloaded")
    finally:
        client.load_model(MEMBERS[1], headers=operator())
    assert classify(app_url, MEMBERS[1]).status_code == 200


def _grpc_states(client: triton_grpc.InferenceServerClient) -> dict[str, tuple[str, str]]:
    index = client.get_model_repository_index(headers={"authorization": AS_OPERATOR["Authorization"]}, as_json=True)
    return {m["name"]: (m["state"], m.get("reason", "")) for m in index.get("models", [])}


def test_the_repository_extension_over_grpc(app_url: str) -> None:
    """The same extension through Serve's gRPC proxy, as tritonclient.grpc calls it: the same
    operators-only rule (PERMISSION_DENIED), the same ledger, then inference on the loaded model;
    HTTP's index with `ready` set leaves the unloaded model out."""
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{SHARED_GRPC_PORT}")
    as_user, as_operator = ({"authorization": h["Authorization"]} for h in (AS_USER, AS_OPERATOR))
    model = MEMBERS[0]
    assert _grpc_states(client)[model] == ("READY", "")
    with pytest.raises(InferenceServerException, match="is not an operator") as denied:
        client.unload_model(model, headers=dict(as_user))
    assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
    try:
        client.unload_model(model, headers=dict(as_operator))
        assert _grpc_states(client)[model] == ("UNAVAILABLE", "unloaded")
        assert not client.is_model_ready(model)
        ready = httpx.post(f"{app_url}/v2/repository/index", json={"ready": True}, headers=AS_USER, timeout=10).json()
        assert model not in {m["name"] for m in ready} and MEMBERS[1] in {m["name"] for m in ready}
    finally:
        client.load_model(model, headers=dict(as_operator))
    assert _grpc_states(client)[model] == ("READY", "")
    text = triton_grpc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a fine film"], dtype=np.object_))
    result = client.infer(model, [text], headers=dict(as_user))
    assert result.as_numpy("logits").shape == (1, 2)
    with pytest.raises(InferenceServerException, match="unknown model") as unknown:
        client.load_model("no-such-model", headers=dict(as_operator))
    assert unknown.value.status() == "StatusCode.NOT_FOUND"


def test_a_model_put_under_the_pool_after_the_start_is_served_once_an_operator_loads_it(
    app_url: str, pool_dir: Path, tiny_model_dir: Path
) -> None:
    """No redeploy: the index lists the new directory as not loaded, an operator's load (HTTP,
    then gRPC for another) checks it and serves it, with its own labels; a directory whose model
    would not load is refused with the reason (400), a name with no directory is not found."""
    client = triton.InferenceServerClient(f"127.0.0.1:{SHARED_PORT}")
    put_model(tiny_model_dir, pool_dir, "reviews-it")
    (pool_dir / "reviews-xx").mkdir()  # no model in it
    assert classify(app_url, "reviews-it").status_code == 404
    deadline = time.monotonic() + 10  # the router lists a pool's path at most every few seconds
    while "reviews-it" not in _states(client) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _states(client)["reviews-it"] == ("UNAVAILABLE", "not loaded")
    with pytest.raises(InferenceServerException, match="is not an operator"):
        client.load_model("reviews-it", headers=user())
    client.load_model("reviews-it", headers=operator())
    assert _states(client)["reviews-it"] == ("READY", "")
    r = classify(app_url, "reviews-it")
    assert r.status_code == 200, r.text
    assert next(o["data"] for o in r.json()["outputs"] if o["name"] == "label")[0].startswith("it-")
    assert client.get_model_metadata("reviews-it", headers=user())["name"] == "reviews-it"
    assert _infer(client, "reviews-it").shape == (1, 2)
    refused = httpx.post(f"{app_url}/v2/repository/models/reviews-xx/load", headers=AS_OPERATOR, timeout=30)
    assert refused.status_code == 400 and "failed to load 'reviews-xx'" in refused.json()["error"], refused.text
    missing = httpx.post(f"{app_url}/v2/repository/models/reviews-zz/load", headers=AS_OPERATOR, timeout=30)
    assert missing.status_code == 404 and "no model directory reviews-zz" in missing.json()["error"], missing.text
    put_model(tiny_model_dir, pool_dir, "reviews-es")
    grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{SHARED_GRPC_PORT}")
    grpc_client.load_model("reviews-es", headers={"authorization": AS_OPERATOR["Authorization"]})
    text = triton_grpc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a fine film"], dtype=np.object_))
    result = grpc_client.infer("reviews-es", [text], headers={"authorization": AS_USER["Authorization"]})
    assert result.as_numpy("label")[0].decode().startswith("es-")
