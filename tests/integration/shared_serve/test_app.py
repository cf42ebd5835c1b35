"""The whole application on a real Ray Serve instance, over real HTTP, with tiny models.

One app for the module, on the Serve instance this package shares (conftest.py).
Answers are checked against running the same ONNX files directly.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from serve_app.app import as_deployment
from serve_app.errors import InvalidInput
from serve_app.models.prediction import Prediction
from serve_app.padding import pad_right
from serve_app.tokenization import TextTokenizer
from serve_app.zoo.data import shapes_dataset
from tests.conftest import tiny_args
from tests.integration.reference import greedy_text, session
from tests.integration.serving import SHARED_GRPC_PORT, SHARED_PORT, app_for_module, deployment_handle

pytestmark = pytest.mark.integration
URL = f"http://127.0.0.1:{SHARED_PORT}"
APP = "default"
TEXTS = ["the food was great", "the movie was not bad but the plot was dull", "i think the room was awful", "x"]


@pytest.fixture(scope="module")
def app_url(tiny_model_dir: Path, serve_url: str):
    yield from app_for_module(tiny_args(tiny_model_dir), serve_url, APP)


def _text_body(texts: list[str]) -> dict:
    return {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}


def _image_body(images: np.ndarray) -> dict:
    return {"inputs": [{"name": "image", "shape": list(images.shape), "datatype": "FP32", "data": images.ravel().tolist()}]}


def _output(resp: httpx.Response, name: str) -> np.ndarray:
    (out,) = [o for o in resp.json()["outputs"] if o["name"] == name]
    return np.array(out["data"]).reshape(out["shape"]) if out["datatype"] != "BYTES" else out["data"]


async def _post_many(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def test_health_and_server_metadata(app_url):
    assert httpx.get(f"{app_url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{app_url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{app_url}/v2").json()["name"] == "serve-app"


@pytest.mark.parametrize(
    "name", ["bert-light", "bert-heavy", "resnet-light", "resnet-heavy", "gpt", "text-classify", "image-classify"]
)
def test_every_model_and_route_has_metadata_config_and_readiness(app_url, name):
    meta = httpx.get(f"{app_url}/v2/models/{name}").json()
    assert meta["name"] == name and meta["inputs"] and meta["outputs"]
    config = httpx.get(f"{app_url}/v2/models/{name}/config").json()
    assert config["max_batch_size"] >= 1 and config["input"]
    assert httpx.get(f"{app_url}/v2/models/{name}/ready").status_code == 200


@pytest.mark.parametrize("model", ["bert-light", "bert-heavy"])
def test_text_models_under_concurrency_match_onnx_runtime(app_url, tiny_model_dir, model):
    bodies = [_text_body([TEXTS[i % 4], TEXTS[(i + 1) % 4]]) for i in range(16)]
    responses = asyncio.run(_post_many(app_url, f"/v2/models/{model}/infer", bodies))
    tok = TextTokenizer.from_file(tiny_model_dir / model / "tokenizer.json")
    sess = session(tiny_model_dir, model)
    for body, resp in zip(bodies, responses, strict=True):
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-served-by"] == model
        timing = dict(m.split(";dur=") for m in resp.headers["server-timing"].split(", "))
        assert set(timing) == {"queue", "model", "replica", "total"}
        assert 0 < float(timing["replica"]) <= float(timing["model"]) <= float(timing["total"])
        texts = body["inputs"][0]["data"]
        expected = np.concatenate(
            [
                sess.run(None, dict(zip(["input_ids", "attention_mask"], pad_right([tok.encode(t)], tok.pad_id), strict=True)))[0]
                for t in texts
            ]
        )
        np.testing.assert_allclose(_output(resp, "logits"), expected, atol=1e-4)


@pytest.mark.parametrize("model", ["resnet-light", "resnet-heavy"])
def test_image_models_under_concurrency_match_onnx_runtime(app_url, tiny_model_dir, model):
    images, _ = shapes_dataset(16, seed=11)
    bodies = [_image_body(images[i : i + 1]) for i in range(16)]
    responses = asyncio.run(_post_many(app_url, f"/v2/models/{model}/infer", bodies))
    (expected,) = session(tiny_model_dir, model).run(None, {"image": images})
    for i, resp in enumerate(responses):
        assert resp.status_code == 200, resp.text
        np.testing.assert_allclose(_output(resp, "logits")[0], expected[i], atol=1e-4)
        assert _output(resp, "label")[0] in ["circle", "square", "triangle", "cross", "ring", "diamond"]


def test_routes_answer_from_the_tier_they_name(app_url, tiny_model_dir):
    images, _ = shapes_dataset(12, seed=5)
    resp = httpx.post(f"{app_url}/v2/models/image-classify/infer", json=_image_body(images), timeout=60)
    assert resp.status_code == 200, resp.text
    served = resp.json()["parameters"]["served_by"]
    assert len(served) == 12 and set(served) <= {"resnet-light", "resnet-heavy"}
    assert set(resp.headers["x-served-by"].split(",")) == set(served)
    (light,) = session(tiny_model_dir, "resnet-light").run(None, {"image": images})
    (heavy,) = session(tiny_model_dir, "resnet-heavy").run(None, {"image": images})
    p = np.exp(light - light.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    escalate = p.max(1) < 0.3
    assert served == ["resnet-heavy" if e else "resnet-light" for e in escalate]
    np.testing.assert_allclose(_output(resp, "logits"), np.where(escalate[:, None], heavy, light), atol=1e-4)
    text = httpx.post(f"{app_url}/v2/models/text-classify/infer", json=_text_body(TEXTS), timeout=60)
    assert text.status_code == 200 and text.json()["model_name"] == "text-classify"


def test_batches_larger_than_one_form_under_load(app_url):
    handle = deployment_handle("bert-light", APP)
    before = handle.runtime_info.remote().result()["batch_sizes"]
    asyncio.run(_post_many(app_url, "/v2/models/bert-light/infer", [_text_body([TEXTS[0]]) for _ in range(32)]))
    after = handle.runtime_info.remote().result()["batch_sizes"]
    grown = {int(k): v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    assert any(size > 1 for size in grown), f"only single-item batches ran: {grown}"


def test_openai_completion_is_the_greedy_reference_whatever_the_batch(app_url, tiny_model_dir):
    prompts = ["the food", "honestly , the service was", "a", "the movie was not"]
    bodies = [{"model": "gpt", "prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
    responses = asyncio.run(_post_many(app_url, "/v1/completions", bodies))
    for p, resp in zip(prompts, responses, strict=True):
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["text"] == greedy_text(tiny_model_dir, p, 8)
        assert body["usage"]["completion_tokens"] <= 8
        assert resp.headers["x-served-by"] == "gpt"


def test_openai_streaming_sends_tokens_then_done(app_url, tiny_model_dir):
    body = {"model": "gpt", "prompt": "the food", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy_text(tiny_model_dir, "the food", 6)


def test_v2_generation_and_models_list(app_url):
    body = {
        "inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["the", "a"]}],
        "parameters": {"max_tokens": 4},
    }
    resp = httpx.post(f"{app_url}/v2/models/gpt/infer", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(_output(resp, "text_output")) == 2
    assert [m["id"] for m in httpx.get(f"{app_url}/v1/models").json()["data"]] == ["gpt"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v2/models/nope/infer", _text_body(["x"]), 404, "unknown model 'nope'"),
        (
            "/v2/models/bert-light/infer",
            {"inputs": [{"name": "txt", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
            400,
            "named 'text'",
        ),
        (
            "/v2/models/bert-light/infer",
            {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["x"]}]},
            400,
            "needs 2 elements",
        ),
        (
            "/v2/models/bert-light/infer",
            {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
            400,
            "datatype BYTES",
        ),
        ("/v2/models/bert-light/infer", {"inputs": []}, 400, "malformed request body"),
        (
            "/v2/models/resnet-light/infer",
            {"inputs": [{"name": "image", "shape": [1, 3, 2, 2], "datatype": "FP32", "data": [0.0] * 12}]},
            400,
            "shape [N, 3,",
        ),
        ("/v2/models/bert-light/infer", {**_text_body(["x"]), "outputs": [{"name": "nope"}]}, 400, "unknown requested outputs"),
        ("/v2/models/bert-light/infer", _text_body(["x"] * 65), 400, "at most 64"),
    ],
)
def test_bad_v2_requests_get_4xx_in_v2_shape(app_url, path, body, status, needle):
    resp = httpx.post(f"{app_url}{path}", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "bert-light", "prompt": "x"}, 404, "does not generate text"),
        ({"model": "gpt", "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens must be between"),
        ({"model": "gpt", "prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"model": "gpt"}, 400, "prompt"),
    ],
)
def test_bad_openai_requests_get_4xx_in_openai_shape(app_url, body, status, needle):
    resp = httpx.post(f"{app_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]["message"]


def test_a_bad_item_fails_alone_inside_a_batch(app_url):
    """Through the handle (the router would reject it first): one invalid payload in a
    batch gets its own error; the others in the same batch and in merged calls succeed."""
    handle = deployment_handle("bert-light", APP)

    async def go():
        calls = [handle.run.remote([[TEXTS[0]], [123], [TEXTS[1], TEXTS[2]]]) for _ in range(3)]
        return await asyncio.gather(*calls)

    for reply in asyncio.run(go()):
        good, bad, pair = reply.results
        assert isinstance(good, np.ndarray) and good.shape == (1, 2)
        assert isinstance(bad, InvalidInput)
        assert pair.shape == (2, 2)
        assert reply.exec_s > 0 and reply.wait_s >= 0
    assert httpx.post(f"{URL}/v2/models/bert-light/infer", json=_text_body(["still serving"])).status_code == 200


def test_replicas_without_a_gpu_run_the_cpu_provider(app_url):
    info = deployment_handle("resnet-light", APP).runtime_info.remote().result()
    assert info["gpu_ids"] == []
    assert info["providers"] == ["CPUExecutionProvider"]
    assert info["batching"]["max_batch_size"] == 8


def test_a_two_thread_cpu_model_runs_its_bulk_lane_as_two_sessions_side_by_side(app_url, tiny_model_dir):
    info = deployment_handle("bert-heavy", APP).runtime_info.remote().result()
    assert info["lane_sessions"] == {"bulk": [1, 1], "urgent": [2]}
    single = deployment_handle("bert-light", APP).runtime_info.remote().result()
    assert single["lane_sessions"] == {"bulk": [1], "urgent": [1]}
    # Without an urgent lane session, `bulk_sessions` still runs them side by side (and the image
    # test above checks their answers against ONNX Runtime's).
    no_session = deployment_handle("resnet-heavy", APP).runtime_info.remote().result()
    assert no_session["lane_sessions"] == {"bulk": [1, 1]}


# A second Serve application, as a user's own would be: it calls the models by handle with one input
# per call, from many tasks at once.
@serve.deployment
class _FanOut:
    async def classify_all(self, model: str, inputs: list[Any]) -> list[Prediction]:
        handle = serve.get_deployment_handle(model, APP)
        return list(await asyncio.gather(*(handle.classify.remote(x) for x in inputs)))


def _batch_sizes(model: str) -> Counter[int]:
    return Counter({int(k): v for k, v in deployment_handle(model, APP).runtime_info.remote().result()["batch_sizes"].items()})


@pytest.fixture(scope="module")
def fan_out(app_url):
    handle = serve.run(as_deployment(_FanOut).bind(), name="fan-out", route_prefix=None)
    try:
        yield handle
    finally:
        handle.shutdown()  # its metrics pusher would outlive the cluster (tests/integration/serving.py)
        serve.delete("fan-out")


def test_another_app_calls_a_text_model_by_handle_one_text_at_a_time(app_url, fan_out):
    texts = [f"{TEXTS[i % 4]} {i}" for i in range(64)]
    before = _batch_sizes("bert-heavy")
    answers = fan_out.classify_all.remote("bert-heavy", texts).result(timeout_s=120)
    grown = _batch_sizes("bert-heavy") - before
    assert any(size > 1 for size in grown), f"only one-row batches ran: {grown}"
    routed = asyncio.run(_post_many(app_url, "/v2/models/bert-heavy/infer", [_text_body([t]) for t in texts]))
    for answer, resp in zip(answers, routed, strict=True):
        assert isinstance(answer, Prediction)
        assert answer.label == _output(resp, "label")[0]
        np.testing.assert_allclose(answer.logits, _output(resp, "logits")[0], atol=1e-4)
        np.testing.assert_allclose(answer.probabilities, _output(resp, "probabilities")[0], atol=1e-5)


def test_another_app_calls_an_image_model_by_handle_one_image_at_a_time(app_url, fan_out):
    images, _ = shapes_dataset(64, seed=23)
    pngs = [_png(image) for image in images[:8]]
    before = _batch_sizes("resnet-heavy")
    answers = fan_out.classify_all.remote("resnet-heavy", [*images[8:], *pngs]).result(timeout_s=120)
    grown = _batch_sizes("resnet-heavy") - before
    assert any(size > 1 for size in grown), f"only one-row batches ran: {grown}"
    bodies = [_image_body(images[i : i + 1]) for i in range(8, 64)]
    encoded = [_encoded_image_body(p) for p in pngs]
    routed = asyncio.run(_post_many(app_url, "/v2/models/resnet-heavy/infer", bodies + encoded))
    for answer, resp in zip(answers, routed, strict=True):
        assert resp.status_code == 200, resp.text
        assert answer.label == _output(resp, "label")[0]
        np.testing.assert_allclose(answer.logits, _output(resp, "logits")[0], atol=1e-4)


def test_a_handle_caller_gets_the_typed_error_for_an_input_the_model_cannot_take(app_url):
    handle = deployment_handle("resnet-heavy", APP)
    with pytest.raises(InvalidInput, match="one image per call"):
        handle.classify.remote(np.zeros((3, 3), dtype=np.float32)).result(timeout_s=60)
    with pytest.raises(InvalidInput, match="not a PNG or JPEG"):
        handle.classify.remote(b"not an image").result(timeout_s=60)
    with pytest.raises(InvalidInput, match="one text"):
        deployment_handle("bert-light", APP).classify.remote(["a", "list"]).result(timeout_s=60)


def test_the_guides_composed_app_answers_through_serve(app_url):
    spec = importlib.util.spec_from_file_location("compose", Path(__file__).parents[3] / "docs/examples/compose.py")
    assert spec is not None and spec.loader is not None
    compose = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compose)
    serve.run(compose.Moderator.bind(APP), name="moderator", route_prefix="/moderate").shutdown()
    try:
        image = shapes_dataset(1, seed=3)[0][0]
        post = {"text": TEXTS[0], "picture": base64.b64encode(_png(image)).decode()}
        resp = httpx.post(f"{app_url}/moderate", json=post, timeout=60)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert set(answer) == {"text", "picture"} and 0 < answer["picture"]["confidence"] <= 1
    finally:
        serve.delete("moderator")


def _encoded_image_body(png: bytes) -> dict:
    return {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(png).decode()]}]}


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray((image.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_readmes_client_examples_run_as_written(app_url):
    """README's curl, Triton (HTTP and gRPC) and OpenAI examples, against this app: its ports, its tiny models."""
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    examples = [(kind, code) for kind, code in re.findall(r"```(bash|python)\n(.*?)```", readme, re.S) if "localhost:" in code]
    assert [kind for kind, _ in examples] == ["bash", "python", "python"]
    for kind, code in examples:
        code = code.replace("localhost:8000", f"127.0.0.1:{SHARED_PORT}").replace(
            "localhost:9000", f"127.0.0.1:{SHARED_GRPC_PORT}"
        )
        run = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(run, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        if kind == "bash":
            assert "HTTP/1.1 200" in done.stdout and '"label"' in done.stdout, done.stdout
            assert done.stdout.rstrip().endswith("data: [DONE]"), done.stdout
        else:
            assert re.search(r"\[b?'(positive|negative)'\]", done.stdout), done.stdout
