"""The clients users already have, unchanged, against a running application: Triton's
`tritonclient.http` (JSON and binary tensors), the `openai` SDK (plain and streaming),
a table of malformed requests, client disconnects, and an OpenAPI fuzzer.

One app for the module, tiny models, on the Serve instance this package shares (conftest.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import secrets
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import schemathesis
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from PIL import Image
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serve_app.router.routing.catalog import STATS_TTL_S
from serve_app.zoo.data import shapes_dataset
from tests.conftest import tiny_args
from tests.integration.reference import greedy_text, session
from tests.integration.serving import SHARED_GRPC_PORT, SHARED_PORT, app_for_module, deployment_handle
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, running_receiver, traceparent

pytestmark = pytest.mark.integration
URL = f"http://127.0.0.1:{SHARED_PORT}"
GRPC_PORT = SHARED_GRPC_PORT
TEXTS = ["the food was great", "i think the room was awful", "héllo wörld ✓"]
CLASSIFIERS = ["bert-light", "bert-heavy", "text-classify", "resnet-light", "resnet-heavy", "image-classify"]
SLOW_S = 0.4  # one batch of `bert-slow`, the model behind the disconnect test
MAX_BODY = 256 * 1024
STEP_S = 0.1  # one decode step of `gpt-slow`: long enough that its 60-token runs outlast a loaded machine's HTTP


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    """Where every process of the app exports its spans (OTLP over HTTP)."""
    with running_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def app_url(tiny_model_dir: Path, otlp: OtlpReceiver, serve_url: str):
    args = tiny_args(tiny_model_dir)
    args["tracing"] = {"otlp_endpoint": otlp.url, "export_interval_ms": 100}
    args["models"]["bert-slow"] = {
        "preset": "bert-tiny",
        "path": str(tiny_model_dir / "bert-light"),
        "batching": {"max_batch_size": 1, "batch_wait_timeout_s": 0.0},
        "faults": {"delay_s": SLOW_S},
    }
    args["models"]["gpt-slow"] = {
        **args["models"]["gpt"],
        "path": str(tiny_model_dir / "gpt"),
        # One KV slot and two waiting places: who holds the slot, who waits and who is refused is visible.
        "generation": {"default_max_tokens": 8, "max_tokens_limit": 60, "kv_slots": 1, "max_waiting": 2},
        "faults": {"delay_s": STEP_S},
    }
    # Admit the disconnect test's 16 queued requests (6 s of bert-slow) instead of refusing most:
    # normal may wait twice the delay target in a model's queue, and no class past max_queue_delay_s.
    args["scheduling"] = {"max_queue_delay_s": 10, "queue_delay_target_ms": 5000, "anonymous_max_priority": "high"}
    args["limits"] = {"max_request_bytes": MAX_BODY, "max_text_chars": 500}
    yield from app_for_module(args, serve_url)


@pytest.fixture(scope="module")
def client(app_url) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(app_url.removeprefix("http://"), network_timeout=60)


def _images(n: int = 3) -> np.ndarray:
    images, _ = shapes_dataset(n, seed=5)
    return images.astype(np.float32)


def _classifier_input(model: str, binary: bool) -> triton.InferInput:
    if model.startswith(("bert", "text")):
        tensor = triton.InferInput("text", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    else:
        images = _images()
        tensor = triton.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images, binary_data=binary)
    return tensor


# -- Triton's client ----------------------------------------------------------------------


def test_tritonclient_server_and_model_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    for name in [*CLASSIFIERS, "gpt"]:
        meta = client.get_model_metadata(name)
        assert meta["name"] == name and meta["versions"] == ["1"]
        assert client.get_model_metadata(name, model_version="1") == meta
        config = client.get_model_config(name)
        assert config["name"] == name and config["max_batch_size"] >= 1 and config["input"] and config["output"]
        assert client.is_model_ready(name) and client.is_model_ready(name, "1")
    assert not client.is_model_ready("bert-light", "2")


@pytest.mark.parametrize("model", CLASSIFIERS)
def test_tritonclient_json_and_binary_agree_with_onnx_runtime(client, tiny_model_dir, model):
    results = {}
    for binary in (False, True):
        outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "label")]
        result = client.infer(model, [_classifier_input(model, binary)], outputs=outputs, request_id="req-7")
        assert result.get_response()["id"] == "req-7"
        assert {o["name"] for o in result.get_response()["outputs"]} == {"logits", "label"}
        results[binary] = result
    np.testing.assert_allclose(results[True].as_numpy("logits"), results[False].as_numpy("logits"), atol=1e-6)
    labels = [v.decode() if isinstance(v, bytes) else v for v in results[True].as_numpy("label")]
    assert labels == [str(v) for v in results[False].as_numpy("label")]
    if model in ("resnet-light", "resnet-heavy"):  # a single model: compare with ORT itself
        (expected,) = session(tiny_model_dir, model).run(None, {"image": _images()})
        np.testing.assert_allclose(results[True].as_numpy("logits"), expected, atol=1e-4)


def test_tritonclient_binary_outputs_by_default_and_versioned_infer(client):
    # No requested outputs: tritonclient asks for every output in binary.
    result = client.infer("bert-light", [_classifier_input("bert-light", True)], model_version="1")
    assert result.as_numpy("probabilities").shape == (len(TEXTS), 2)
    with pytest.raises(triton.InferenceServerException, match="no version '9'"):
        client.infer("bert-light", [_classifier_input("bert-light", True)], model_version="9")


def test_tritonclient_encoded_png_and_jpeg_images(client):
    images = _images()
    pixels = (images * 255).round().astype(np.uint8)
    raw = triton.InferInput("image", list(pixels.shape), "UINT8")
    raw.set_data_from_numpy(pixels)
    expected = client.infer("resnet-light", [raw]).as_numpy("logits")
    for fmt in ("PNG", "JPEG"):
        blobs = []
        for img in pixels:
            buf = io.BytesIO()
            Image.fromarray(img.transpose(1, 2, 0)).save(buf, format=fmt, quality=100)
            blobs.append(buf.getvalue())
        encoded = triton.InferInput("image", [len(blobs)], "BYTES")
        encoded.set_data_from_numpy(np.array(blobs, dtype=object))
        got = client.infer("resnet-light", [encoded]).as_numpy("logits")
        if fmt == "PNG":  # lossless: the same pixels give the same logits
            np.testing.assert_allclose(got, expected, atol=1e-4)
        else:  # lossy at 16x16: decoded and answered, not equal
            assert got.shape == expected.shape and np.isfinite(got).all()


def test_tritonclient_generation_with_parameters(client, tiny_model_dir):
    prompts = ["the food", "a"]
    expected = [greedy_text(tiny_model_dir, p, 5) for p in prompts]
    for binary in (False, True):
        tensor = triton.InferInput("text_input", [2], "BYTES")
        tensor.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object), binary_data=binary)
        output = triton.InferRequestedOutput("text_output", binary_data=binary)
        result = client.infer("gpt", [tensor], outputs=[output], parameters={"max_tokens": 5, "temperature": 0})
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in result.as_numpy("text_output")]
        assert texts == expected, binary


# -- Triton's gRPC client, through Serve's gRPC proxy ------------------------------------------


@pytest.fixture(scope="module")
def grpc_client(app_url) -> triton_grpc.InferenceServerClient:
    return triton_grpc.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}")


def _grpc_input(model: str) -> triton_grpc.InferInput:
    if model.startswith(("bert", "text")):
        tensor = triton_grpc.InferInput("text", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    else:
        images = _images()
        tensor = triton_grpc.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
    return tensor


def test_tritonclient_grpc_health_and_metadata(grpc_client):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert "binary_tensor_data" in grpc_client.get_server_metadata().extensions
    meta = grpc_client.get_model_metadata("bert-light", as_json=True)
    assert meta["name"] == "bert-light" and meta["versions"] == ["1"]
    assert {t["name"] for t in meta["inputs"]} == {"text"}
    assert grpc_client.is_model_ready("text-classify") and not grpc_client.is_model_ready("bert-light", "2")
    with pytest.raises(triton_grpc.InferenceServerException, match=r"StatusCode\.NOT_FOUND"):
        grpc_client.get_model_metadata("no-such-model")


def test_tritonclient_grpc_model_config_is_the_http_config(grpc_client, client):
    for name in ("bert-light", "image-classify", "gpt"):
        got = grpc_client.get_model_config(name, as_json=True)["config"]
        want = client.get_model_config(name)
        assert got["name"] == want["name"] == name and int(got["max_batch_size"]) == want["max_batch_size"]
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in got["input"]] == [
            (t["name"], t["data_type"], t["dims"]) for t in want["input"]
        ]
        assert [t["name"] for t in got["output"]] == [t["name"] for t in want["output"]]
    with pytest.raises(triton_grpc.InferenceServerException, match=r"StatusCode\.NOT_FOUND"):
        grpc_client.get_model_config("bert-light", "2")


@pytest.mark.parametrize("model", ["bert-light", "text-classify", "resnet-heavy", "image-classify"])
def test_tritonclient_grpc_infer_matches_http(grpc_client, client, model):
    """Binary tensors over gRPC give what the same request over HTTP gives, with the same tiers."""
    got = grpc_client.infer(model, [_grpc_input(model)], request_id="g-1")
    want = client.infer(model, [_classifier_input(model, True)])
    np.testing.assert_allclose(got.as_numpy("logits"), want.as_numpy("logits"), atol=1e-6)
    assert got.as_numpy("label").tolist() == want.as_numpy("label").tolist()
    response = got.get_response()
    assert response.id == "g-1" and response.model_name == model
    assert response.parameters["served_by"].string_param == ",".join(want.get_response()["parameters"]["served_by"])


def test_tritonclient_grpc_errors_are_status_codes(grpc_client):
    with pytest.raises(triton_grpc.InferenceServerException, match=r"StatusCode\.INVALID_ARGUMENT"):
        grpc_client.infer("resnet-light", [_grpc_input("bert-light")])  # text for an image model
    # Below tritonclient's own checks, with the service's generated stub: raw bytes short of the shape.
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="resnet-light")
    size = _images(1).shape[-1]
    request.inputs.add(name="image", datatype="FP32", shape=[1, 3, size, size])
    request.raw_input_contents.append(np.zeros((1, 3, size // 2, size // 2), np.float32).tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "binary bytes" in e.value.details()
    with pytest.raises(triton_grpc.InferenceServerException, match=r"StatusCode\.NOT_FOUND"):
        grpc_client.infer("no-such-model", [_grpc_input("bert-light")])
    # The server is unharmed: the next request is answered.
    assert grpc_client.infer("bert-light", [_grpc_input("bert-light")]).as_numpy("logits").shape == (len(TEXTS), 2)


# -- tracing ---------------------------------------------------------------------------------


def _named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def _new_trace() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def test_a_callers_trace_follows_a_request_through_the_router_and_the_replicas_of_each_tier(app_url, otlp):
    trace_id, span_id = _new_trace()
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [f"traced {trace_id}"]}]}
    headers = {"traceparent": traceparent(trace_id, span_id), "Cache-Control": "no-cache"}
    r = httpx.post(f"{URL}/v2/models/text-classify/infer", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    tiers = r.headers["X-Served-By"].split(",")

    # Router and replicas export on their own schedules: wait for every span the test reads.
    def complete(spans: list[ReceivedSpan]) -> bool:
        served = bool(_named(spans, "POST /v2/models/{model}/infer"))
        return served and len(_named(spans, "model.run")) >= len(_named(spans, "model.batch")) >= 1

    spans = otlp.wait_for(trace_id, complete)
    (server,) = _named(spans, "POST /v2/models/{model}/infer")
    assert server.parent_span_id == span_id and server.service == "serve-app.router"
    assert server.attributes["serve_app.model"] == "text-classify" and server.attributes["http.response.status_code"] == 200
    batches, runs = _named(spans, "model.batch"), _named(spans, "model.run")
    assert {b.parent_span_id for b in batches + _named(spans, "router.queue")} == {server.span_id}
    # The replica's run, exported by the replica's own process, sits under the router's round trip.
    assert {r.parent_span_id for r in runs} <= {b.span_id for b in batches}
    assert tiers[-1] in {r.service.removeprefix("serve-app.") for r in runs}


def test_a_generation_is_traced_through_its_prefill_and_decode_steps(app_url, otlp):
    trace_id, span_id = _new_trace()
    headers = {"traceparent": traceparent(trace_id, span_id)}
    body = {"model": "gpt", "prompt": "the food", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    r = httpx.post(f"{URL}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text

    def complete(spans: list[ReceivedSpan]) -> bool:
        served = bool(_named(spans, "POST /v1/completions"))
        return served and bool(_named(spans, "generate")) and len(_named(spans, "decode")) >= 3

    spans = otlp.wait_for(trace_id, complete)
    (server,) = _named(spans, "POST /v1/completions")
    (generate,) = _named(spans, "generate")
    assert server.parent_span_id == span_id and generate.parent_span_id == server.span_id
    assert generate.service == "serve-app.gpt" and generate.attributes["serve_app.completion_tokens"] == 4
    steps = _named(spans, "prefill") + _named(spans, "decode")
    assert len(_named(spans, "decode")) == 3 and {s.parent_span_id for s in steps} == {generate.span_id}


def test_grpc_metadata_carries_the_trace_context_too(grpc_client, otlp):
    trace_id, span_id = _new_trace()
    headers = {"traceparent": traceparent(trace_id, span_id), "cache-control": "no-cache"}
    grpc_client.infer("bert-light", [_grpc_input("bert-light")], headers=headers)
    server_span = "inference.GRPCInferenceService/ModelInfer"
    spans = otlp.wait_for(trace_id, lambda s: bool(_named(s, "model.run")) and bool(_named(s, server_span)))
    (server,) = _named(spans, server_span)
    assert server.parent_span_id == span_id and server.attributes["rpc.system"] == "grpc"
    assert _named(spans, "model.run")[0].service == "serve-app.bert-light"


def test_tritonclient_grpc_streams_generation_and_classification(grpc_client, tiny_model_dir):
    """Triton's bidirectional stream: a generation arrives piece by piece and ends with an empty
    final response; a classification and a bad request on the same stream get their own answers."""
    import queue

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        prompt = triton_grpc.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"the food"], dtype=object))
        grpc_client.async_stream_infer(
            "gpt", [prompt], request_id="gen", parameters={"max_tokens": 8, "temperature": 0},
            enable_empty_final_response=True,
        )  # fmt: skip
        grpc_client.async_stream_infer("bert-light", [_grpc_input("bert-light")], request_id="cls")
        bad = triton_grpc.InferInput("text_input", [1], "BYTES")
        bad.set_data_from_numpy(np.array([b"x"], dtype=object))
        grpc_client.async_stream_infer("gpt", [bad], request_id="bad", parameters={"top_k": -3})
        pieces: list[str] = []
        errors: list[str] = []
        finals, classified = 0, None
        deadline = time.monotonic() + 60
        while finals == 0 or classified is None or not errors:
            assert time.monotonic() < deadline, (pieces, finals, classified, errors)
            result, error = results.get(timeout=30)
            if error is not None:
                errors.append(str(error))
                continue
            response = result.get_response()
            if response.id == "cls":
                classified = result.as_numpy("logits")
            elif response.parameters["triton_final_response"].bool_param:
                finals += 1
            else:
                pieces += [t.decode() for t in result.as_numpy("text_output")]
    finally:
        grpc_client.stop_stream()
    assert "".join(pieces) == greedy_text(tiny_model_dir, "the food", 8) and len(pieces) > 1
    assert classified is not None and classified.shape == (len(TEXTS), 2)
    assert len(errors) == 1 and "top_k" in errors[0]


# -- OpenAI's SDK ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_sdk_models_and_completions(oai, tiny_model_dir):
    assert [m.id for m in oai.models.list()] == ["gpt", "gpt-slow"]
    reply = oai.completions.create(model="gpt", prompt="the food", max_tokens=6, temperature=0)
    assert reply.choices[0].text == greedy_text(tiny_model_dir, "the food", 6)
    assert reply.usage.completion_tokens <= 6 and reply.usage.prompt_tokens > 0
    streamed = oai.completions.create(model="gpt", prompt="the food", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_openai_sdk_n_choices_are_seeded_and_reproducible(oai):
    kwargs = {"model": "gpt", "prompt": ["the food", "a"], "max_tokens": 5, "temperature": 1.0, "n": 2, "seed": 7}
    first, again = oai.completions.create(**kwargs), oai.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]


def test_openai_sdk_chat_plain_and_streaming(oai, tiny_model_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how was the food"}]
    reply = oai.chat.completions.create(model="gpt", messages=messages, max_tokens=6, temperature=0)
    prompt = "system: be brief\nuser: how was the food\nassistant:"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == greedy_text(tiny_model_dir, prompt, 6)
    chunks = list(
        oai.chat.completions.create(
            model="gpt", messages=messages, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_openai_sdk_errors_are_its_exceptions(oai):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be between"):
        oai.completions.create(model="gpt", prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError, match="does not generate text"):
        oai.chat.completions.create(model="bert-light", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="streaming takes exactly one prompt"):
        oai.completions.create(model="gpt", prompt=["a", "b"], stream=True)


# -- malformed input -----------------------------------------------------------------------


def _text(data: list, shape: list[int] | None = None, datatype: str = "BYTES", name: str = "text") -> dict:
    return {"inputs": [{"name": name, "shape": shape or [len(data)], "datatype": datatype, "data": data}]}


def _binary(header: dict, blob: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + blob, {"Inference-Header-Content-Length": str(len(head))}


S = 32  # resnet-tiny's image size
PROMPT = "text_input"  # the generator's v2 input
BAD_V2 = [
    # (what, path, json body or (raw bytes, headers), status, part of the message)
    ("unknown model", "/v2/models/nope/infer", _text(["x"]), 404, "unknown model 'nope'; available:"),
    ("unknown version", "/v2/models/bert-light/versions/3/infer", _text(["x"]), 404, "no version '3'"),
    ("not JSON", "/v2/models/bert-light/infer", (b"{oops", {}), 400, "not valid JSON"),
    ("invalid UTF-8 body", "/v2/models/bert-light/infer", (b'{"inputs": "\xff"}', {}), 400, "not valid JSON"),
    ("no inputs", "/v2/models/bert-light/infer", {"inputs": []}, 400, "inputs: List should have at least 1 item"),
    ("wrong input name", "/v2/models/bert-light/infer", _text(["x"], name="txt"), 400, "exactly one input named 'text'"),
    ("shape mismatch", "/v2/models/bert-light/infer", _text(["x"], shape=[2]), 400, "needs 2 elements, got 1"),
    ("wrong dtype", "/v2/models/bert-light/infer", _text([1.0], datatype="FP32"), 400, "must have datatype BYTES"),
    ("empty batch", "/v2/models/bert-light/infer", _text([], shape=[0]), 400, "empty batch"),
    ("too many items", "/v2/models/bert-light/infer", _text(["x"] * 65), 400, "at most 64 are allowed"),
    ("text too long", "/v2/models/bert-light/infer", _text(["x" * 501]), 400, "501 characters; at most 500"),
    (
        "invalid UTF-8 in binary BYTES",
        "/v2/models/bert-light/infer",
        _binary(
            {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]},
            b"\x02\0\0\0\xff\xfe",
        ),
        400,
        "not valid UTF-8",
    ),
    (
        "binary size past the body",
        "/v2/models/resnet-light/infer",
        _binary(
            {"inputs": [{"name": "image", "shape": [1, 3, S, S], "datatype": "FP32", "parameters": {"binary_data_size": 99}}]},
            b"\0" * 12,
        ),
        400,
        "declares 99 binary bytes, but only 12 follow",
    ),
    (
        "binary size not the shape's",
        "/v2/models/resnet-light/infer",
        _binary(
            {"inputs": [{"name": "image", "shape": [1, 3, S, S], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]},
            b"\0" * 8,
        ),
        400,
        f"needs {3 * S * S * 4} binary bytes, got 8",
    ),
    (
        "NaN pixels",
        "/v2/models/resnet-light/infer",
        # Python's json writes NaN (JavaScript's literal), as some clients do.
        (
            json.dumps(
                {"inputs": [{"name": "image", "shape": [1, 3, S, S], "datatype": "FP32", "data": [float("nan")] * 3 * S * S}]}
            ).encode(),
            {},
        ),
        400,
        "NaN or Inf",
    ),
    (
        "Inf pixels in binary",
        "/v2/models/resnet-light/infer",
        _binary(
            {
                "inputs": [
                    {
                        "name": "image",
                        "shape": [1, 3, S, S],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 3 * S * S * 4},
                    }
                ]
            },
            np.full(3 * S * S, np.inf, np.float32).tobytes(),
        ),
        400,
        "NaN or Inf",
    ),
    (
        "wrong image shape",
        "/v2/models/resnet-light/infer",
        {"inputs": [{"name": "image", "shape": [1, 3, 2, 2], "datatype": "FP32", "data": [0.0] * 12}]},
        400,
        f"shape [N, 3, {S}, {S}]",
    ),
    (
        "undecodable image",
        "/v2/models/resnet-light/infer",
        {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"]}]},
        400,
        "not a PNG or JPEG image",
    ),
    (
        "unknown output",
        "/v2/models/bert-light/infer",
        {**_text(["x"]), "outputs": [{"name": "nope"}]},
        400,
        "unknown requested outputs",
    ),
    ("bad priority", "/v2/models/bert-light/infer", {**_text(["x"]), "parameters": {"priority": "urgent"}}, 400, "bad priority"),
    ("float priority", "/v2/models/bert-light/infer", {**_text(["x"]), "parameters": {"priority": 1.5}}, 400, "bad priority"),
    ("huge timeout", "/v2/models/bert-light/infer", {**_text(["x"]), "parameters": {"timeout": 10**400}}, 400, "timeout"),
    ("huge max_tokens", "/v2/models/gpt/infer", {**_text(["x"], name=PROMPT), "parameters": {"max_tokens": 10**400}}, 400, "max"),
    ("body too large", "/v2/models/bert-light/infer", (b"x" * (MAX_BODY + 1), {}), 413, f"at most {MAX_BODY}"),
    ("unknown model metadata", "/v2/models/nope", None, 404, "unknown model 'nope'"),
    ("unknown version config", "/v2/models/gpt/versions/2/config", None, 404, "no version '2'"),
]


def _send(client: httpx.Client, path: str, body) -> httpx.Response:
    if body is None:
        return client.get(path)
    if isinstance(body, tuple):
        return client.post(path, content=body[0], headers=body[1])
    return client.post(path, json=body)


def test_malformed_v2_requests_get_4xx_in_v2_shape_and_harm_nobody(app_url):
    with httpx.Client(base_url=app_url, timeout=30) as http:
        before = http.post("/v2/models/text-classify/infer", json=_text(TEXTS)).json()
        for what, path, body, status, needle in BAD_V2:
            resp = _send(http, path, body)
            assert resp.status_code == status, f"{what}: {resp.status_code} {resp.text}"
            assert needle in resp.json()["error"], f"{what}: {resp.json()}"
        after = http.post("/v2/models/text-classify/infer", json=_text(TEXTS)).json()
    assert after["outputs"] == before["outputs"]


BAD_OPENAI = [
    ("/v1/completions", {"model": "gpt"}, 400, "prompt: Field required"),
    ("/v1/completions", {"model": "gpt", "prompt": "x", "temperature": 9}, 400, "temperature"),
    ("/v1/completions", {"model": "gpt", "prompt": "x", "n": 99}, 400, "n: Input should be less than or equal to 8"),
    ("/v1/completions", {"model": "gpt", "prompt": "x" * 501}, 400, "at most 500 are allowed"),
    ("/v1/completions", {"model": "gpt", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("/v1/chat/completions", {"model": "gpt", "messages": []}, 400, "messages: List should have at least 1 item"),
    ("/v1/chat/completions", {"model": "gpt", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "does not generate"),
    # Python's JSON parser takes an escaped lone surrogate, which no tokenizer can.
    ("/v1/completions", {"model": "gpt", "prompt": "a\ud800b"}, 400, "not valid Unicode"),
    ("/v1/chat/completions", {"model": "gpt", "messages": [{"role": "user", "content": "\udfff"}]}, 400, "not valid Unicode"),
    ("/v1/completions", {"model": "gpt", "prompt": "x", "max_tokens": 10**400}, 400, "max_tokens must be"),
]


def _post_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    """`body` as JSON with non-ASCII escaped, as many clients send it (httpx sends UTF-8, which a
    lone surrogate cannot be)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_malformed_openai_requests_get_4xx_in_openai_shape(app_url):
    with httpx.Client(base_url=app_url, timeout=30) as http:
        for path, body, status, needle in BAD_OPENAI:
            resp = _post_json(http, path, body)
            assert resp.status_code == status, f"{body}: {resp.text}"
            error = resp.json()["error"]
            assert needle in error["message"] and error["type"] == "invalid_request_error", error
        # Bad requests are the caller's fault, never the generator's: a run of them leaves its breaker
        # closed, and the next good request is served.
        for _ in range(6):
            assert _post_json(http, "/v1/completions", {"model": "gpt", "prompt": "\ud800"}).status_code == 400
        assert http.post("/v1/completions", json={"model": "gpt", "prompt": "the", "max_tokens": 2}).status_code == 200
        # FastAPI's own errors come in the protocol's shape too, not as {"detail": ...}.
        unparseable = http.post("/v1/chat/completions", content=b"\x18{", headers={"content-type": "application/json"})
        assert unparseable.status_code == 400 and "malformed request body" in unparseable.json()["error"]["message"]
        assert http.get("/v2/nothing-here").json() == {"error": "Not Found"}
        assert http.delete("/v2").json() == {"error": "Method Not Allowed"}
        # The body limit holds on /v1 as on v2, in the OpenAI shape.
        big = http.post("/v1/completions", json={"model": "gpt", "prompt": "x" * MAX_BODY})
        assert big.status_code == 413 and f"at most {MAX_BODY}" in big.json()["error"]["message"], big.text


def test_bad_requests_mixed_into_a_burst_never_fail_the_good_ones(app_url):
    good = [_text([TEXTS[i % 3]]) for i in range(24)]
    bad = [_text(["x"], shape=[3]), {"inputs": []}, _text([7], datatype="INT32")] * 8

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=app_url, timeout=60) as http:
            calls = [http.post("/v2/models/bert-light/infer", json=b) for pair in zip(good, bad, strict=True) for b in pair]
            return await asyncio.gather(*calls)

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses[0::2]] == [200] * 24
    assert [r.status_code for r in responses[1::2]] == [400] * 24


def test_high_priority_images_run_in_batches_of_their_own_on_the_bulk_sessions(app_url, tiny_model_dir):
    """resnet-heavy keeps its urgent lane without a session of its own (as configs/local.yaml): the
    router sends high priority in batches of its own, which the replica runs next on the bulk
    sessions. Mixed with normal priority, every answer is still the model's own for its image."""
    images = _images(16)

    def body(i: int) -> dict[str, Any]:
        image = images[i : i + 1]
        return {"inputs": [{"name": "image", "shape": list(image.shape), "datatype": "FP32", "data": image.ravel().tolist()}]}

    async def mixed() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=app_url, timeout=60) as http:
            calls = [
                http.post("/v2/models/resnet-heavy/infer", json=body(i), headers={"x-priority": "high" if i % 2 else "normal"})
                for i in range(len(images))
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(mixed())
    (expected,) = session(tiny_model_dir, "resnet-heavy").run(None, {"image": images})
    for i, resp in enumerate(responses):
        assert resp.status_code == 200, resp.text
        (logits,) = [o for o in resp.json()["outputs"] if o["name"] == "logits"]
        np.testing.assert_allclose(np.array(logits["data"]).reshape(logits["shape"])[0], expected[i], atol=1e-4)
    lanes = _status(app_url, "resnet-heavy")["lanes"]
    assert lanes["urgent"]["recent_ms"] and lanes["bulk"]["recent_ms"], lanes  # both lanes ran batches
    info = deployment_handle("resnet-heavy", "default").runtime_info.remote().result()
    assert info["lane_sessions"] == {"bulk": [1, 1]}  # no session of the urgent lane's own


# -- client disconnects ----------------------------------------------------------------------


def _status(app_url: str, model: str) -> dict:
    return httpx.get(f"{app_url}/router/status", timeout=30).json()["models"].get(model, {})


def test_a_client_that_disconnects_frees_its_queued_work(app_url):
    """Sixteen requests queue behind one slow batch; the clients give up while it runs.
    Their work is dropped from the router queue and never runs."""
    n = 16

    async def impatient() -> None:
        async with httpx.AsyncClient(base_url=app_url, timeout=30) as http:
            calls = [asyncio.ensure_future(http.post("/v2/models/bert-slow/infer", json=_text([f"t{i}"]))) for i in range(n)]
            # The clients leave once the router queues their work, however long a loaded machine
            # takes to bring it there (a fixed client timeout could fire before it arrived).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                bulk = (await http.get("/router/status")).json()["models"]["bert-slow"]["lanes"]["bulk"]
                if bulk["queued_items"] >= n // 2 + 2:
                    break
                await asyncio.sleep(0.02)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    with httpx.Client(base_url=app_url, timeout=30) as http:  # let the in-flight limit learn the batch time
        for i in range(4):
            assert http.post("/v2/models/bert-slow/infer", json=_text([f"warm {i}"])).status_code == 200
    before = _status(app_url, "bert-slow")
    asyncio.run(impatient())
    deadline = time.monotonic() + 30
    while (bulk := _status(app_url, "bert-slow")["lanes"]["bulk"])["inflight_batches"] or bulk["queued_items"]:
        assert time.monotonic() < deadline, bulk
        time.sleep(0.1)
    status = _status(app_url, "bert-slow")
    cancelled = status["cancelled_items"] - before["cancelled_items"]
    completed = status["completed_items"] - before["completed_items"]
    # What the replica already had when a client left runs (the learned limit is ~3 batches, and the
    # proxy notices a disconnect within about a batch); nothing queued behind it does. Without
    # cancellation all 16 would run, ~6 s of model time for nobody.
    assert cancelled >= n // 2 and completed <= n // 2, (cancelled, completed, status["lanes"])
    assert httpx.post(f"{app_url}/v2/models/bert-slow/infer", json=_text(["ok"]), timeout=30).status_code == 200


def _generator(app_url: str, model: str = "gpt-slow") -> dict:
    """The generator's stats, fresh. /router/status reuses a generator's answer for STATS_TTL_S
    (waited out here), and gives None for one that did not answer in time (asked again)."""
    deadline = time.monotonic() + 30
    while True:
        time.sleep(STATS_TTL_S + 0.1)
        # The router waits seconds for a generator's answer: the client's timeout is longer.
        stats = httpx.get(f"{app_url}/router/status", timeout=30).json()["generators"][model]
        if stats is not None:
            return stats
        assert time.monotonic() < deadline, f"{model} gave no stats"


def _stream_first_token(app_url: str, body: dict, headers: dict | None = None) -> tuple[httpx.Client, httpx.Response]:
    """Open a streaming completion and read up to its first token; the caller closes it."""
    client = httpx.Client(timeout=30)
    resp = client.send(client.build_request("POST", f"{app_url}/v1/completions", json=body, headers=headers), stream=True)
    assert resp.status_code == 200, resp.read()
    lines = resp.iter_lines()
    while not (first := next(lines)).startswith("data: "):
        pass
    resp.lines = lines  # type: ignore[attr-defined]  # the rest of the stream, for the caller
    resp.first = json.loads(first[6:])  # type: ignore[attr-defined]
    return client, resp


def test_a_client_that_leaves_a_stream_frees_its_kv_slot(app_url):
    """gpt-slow has one KV slot and decodes one step per STEP_S: a request that arrived while an
    abandoned 60-token generation kept its slot would wait ~6 s for it."""
    before = _generator(app_url)["cancelled"]
    body = {"model": "gpt-slow", "prompt": "the", "max_tokens": 60, "temperature": 1.0, "seed": 1, "stream": True,
            "ignore_eos": True}  # fmt: skip
    client, resp = _stream_first_token(app_url, body)
    resp.close()  # hang up after one token
    client.close()
    left = time.monotonic()
    short = {"model": "gpt-slow", "prompt": "a", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{app_url}/v1/completions", json=short, timeout=30).status_code == 200
    # Well under the ~5.9 s the abandoned generation had left, with room for a loaded machine.
    assert time.monotonic() - left < 60 * STEP_S * 0.75, "the next request waited for a generation nobody reads"
    status = _generator(app_url)
    assert status["cancelled"] == before + 1 and status["kv_slots_used"] == 0, status


def test_high_priority_generation_preempts_a_low_priority_one_which_then_completes_unchanged(app_url, tiny_model_dir):
    """The only slot runs a 40-token low-priority generation (4 s); a high-priority request takes
    the slot at the next step (the low one is swapped out) and the low one resumes afterwards
    with exactly the tokens it would have had alone."""
    low = {"model": "gpt-slow", "prompt": "the food", "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    before = _generator(app_url)["preemptions"]
    client, resp = _stream_first_token(app_url, low, {"x-priority": "low"})
    try:
        high = {"model": "gpt-slow", "prompt": "a", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{app_url}/v1/completions", json=high, headers={"x-priority": "high"}, timeout=30)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == greedy_text(tiny_model_dir, "a", 3)
        rest = [json.loads(line[6:]) for line in resp.lines if line.startswith("data: {")]  # type: ignore[attr-defined]
    finally:
        resp.close()
        client.close()
    # The high request took the low one's slot (not waited for it to end): one preemption.
    assert _generator(app_url)["preemptions"] == before + 1
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in [resp.first, *rest])  # type: ignore[attr-defined]
    assert text == greedy_text(tiny_model_dir, "the food", 40, ignore_eos=True)


def test_a_generator_with_every_slot_and_waiting_place_taken_answers_503_with_retry_after(app_url):
    """One slot and two waiting places: the fourth concurrent generation is refused at once, and the
    two that waited run when the slot frees."""
    body = {"model": "gpt-slow", "prompt": "the", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
    client, resp = _stream_first_token(app_url, body)
    short = {**body, "stream": False, "max_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            waiters = [pool.submit(httpx.post, f"{app_url}/v1/completions", json=short, timeout=30) for _ in range(2)]
            deadline = time.monotonic() + 10
            while _generator(app_url)["waiting"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(f"{app_url}/v1/completions", json=short, timeout=30)
            assert refused.status_code == 503 and float(refused.headers["retry-after"]) > 0
            assert refused.json()["error"]["code"] == "overloaded", refused.json()
        finally:
            resp.close()  # the long one leaves: its slot goes to the waiters
            client.close()
        assert [w.result().status_code for w in waiters] == [200, 200]
    assert _generator(app_url)["kv_slots_used"] == 0


# -- OpenAPI fuzzing ------------------------------------------------------------------------


FUZZ_NAMES = ["bert-light", "text-classify", "resnet-light", "image-classify", "gpt", "nope"]


@schemathesis.check
def no_server_fault(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis' `not_a_server_error`, less the documented refusal: a 503 that says when to
    retry is how the router turns away work it cannot serve in time. The fuzzer sends a valid
    body with `X-Request-Timeout-Ms: 1` now and then, shorter than one batch of the model: that
    request is refused, correctly, and is no fault of the server's."""
    if response.status_code == 503 and response.headers.get("retry-after"):
        return None
    return not_a_server_error(ctx, response, case)


# No 5xx but the documented refusals, and /openapi.json is accurate: every status, body and
# content type returned is the documented one.
CHECKS = [no_server_fault, response_schema_conformance, status_code_conformance, content_type_conformance]
FUZZ_EXAMPLES = 10  # per operation and generation mode


def test_openapi_fuzz_finds_no_server_error(app_url):
    """Schemathesis generates valid and invalid requests for every operation in /openapi.json;
    none may get a 5xx (which is also how a crashed replica would show)."""
    schema = schemathesis.openapi.from_url(f"{app_url}/openapi.json")
    # An Err (a schema the fuzzer cannot read) has no .ok(): the AttributeError fails the test, as it should.
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 15
    failures: list[str] = []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def run(case) -> None:
                # Random names would only ever reach the 404 branch: aim most cases at real models.
                if "name" in (case.path_parameters or {}):
                    case.path_parameters["name"] = FUZZ_NAMES[zlib.crc32(repr(case.body).encode()) % len(FUZZ_NAMES)]
                if "version" in (case.path_parameters or {}) and zlib.crc32(repr(case.query).encode()) % 2:
                    case.path_parameters["version"] = "1"
                case.call_and_validate(base_url=app_url, checks=CHECKS, timeout=60)

            try:
                run()
            except Unsatisfiable:  # no invalid request exists for an operation without inputs
                continue
            except Exception as e:  # collect every operation's failure, not only the first
                failures.append(f"{op.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)


def test_an_open_server_lets_nobody_load_or_unload_a_model(app_url):
    """With no keys configured there is no operator: taking a model out of service is refused."""
    for action in ("unload", "load"):
        r = httpx.post(f"{app_url}/v2/repository/models/bert-heavy/{action}", timeout=30)
        assert r.status_code == 403 and "operator" in r.json()["error"], r.text
    assert httpx.post(f"{app_url}/v2/models/bert-heavy/infer", json=_text(TEXTS), timeout=60).status_code == 200


def test_after_fuzzing_every_replica_still_answers(app_url):
    with httpx.Client(base_url=app_url, timeout=60) as http:
        assert http.get("/v2/health/ready").status_code == 200
        for name in CLASSIFIERS:
            body = (
                _text(TEXTS)
                if name.startswith(("bert", "text"))
                else {
                    "inputs": [{"name": "image", "shape": [1, 3, S, S], "datatype": "FP32", "data": _images(1).ravel().tolist()}]
                }
            )
            assert http.post(f"/v2/models/{name}/infer", json=body).status_code == 200, name
        completion = http.post("/v1/completions", json={"model": "gpt", "prompt": "a", "max_tokens": 2})
        assert completion.status_code == 200
