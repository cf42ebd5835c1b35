"""OIP v2 gRPC messages to and from the HTTP path's models: what tritonclient.grpc builds arrives as
the binary extension's tensors do, typed contents as JSON data; responses carry raw bytes that
tritonclient reads back; errors map to gRPC status codes with Retry-After in trailing metadata."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb

from serve_app.errors import InvalidInput, NotFound, Overloaded, RateLimited
from serve_app.protocols import grpc_v2, v2


def _request(*inputs: triton.InferInput, outputs: list[str] | None = None, **params: object) -> pb.ModelInferRequest:
    """The request message tritonclient.grpc sends for these inputs (its own builder)."""
    from tritonclient.grpc._utils import _get_inference_request

    requested = [triton.InferRequestedOutput(o) for o in outputs] if outputs else None
    return _get_inference_request(
        model_name="m", inputs=list(inputs), model_version="2", request_id="r1", outputs=requested,
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters=params or None,
    )  # fmt: skip


def test_raw_tensors_become_the_binary_extensions_tensors():
    image = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    tensor = triton.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    body = grpc_v2.request_from_proto(_request(tensor, outputs=["probabilities"], cache=False))
    assert body.id == "r1" and body.parameters == {"cache": False}
    assert body.outputs is not None and [o.name for o in body.outputs] == ["probabilities"]
    decoded = v2.decode_numeric(body.inputs[0])
    assert decoded.dtype == np.float32 and np.array_equal(decoded, image)


def test_bytes_tensors_keep_their_length_prefixes():
    texts = np.array([b"the food was great", "naïve".encode()], dtype=np.object_)
    tensor = triton.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(texts)
    body = grpc_v2.request_from_proto(_request(tensor))
    assert v2.decode_bytes(body.inputs[0]) == ["the food was great", "naïve"]


def test_typed_contents_are_read_like_json_data():
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="INT64", shape=[2, 2])
    t.contents.int64_contents.extend([1, 2, 3, 4])
    body = grpc_v2.request_from_proto(req)
    assert v2.decode_numeric(body.inputs[0]).tolist() == [[1, 2], [3, 4]]
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="text", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"hello", "naïve".encode()])
    assert v2.decode_bytes(grpc_v2.request_from_proto(req).inputs[0]) == ["hello", "naïve"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.raw_input_contents.append(b"extra"), "one per input"),
        (lambda r: r.ClearField("inputs"), "no inputs"),
    ],
)
def test_malformed_requests_are_invalid_input(mutate, message):
    tensor = triton.InferInput("x", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))
    req = _request(tensor)
    mutate(req)
    with pytest.raises(InvalidInput, match=message):
        grpc_v2.request_from_proto(req)


def test_a_wrong_size_raw_tensor_is_refused_where_http_refuses_it():
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="FP32", shape=[4])
    req.raw_input_contents.append(b"\0" * 12)  # 3 floats for a shape of 4
    body = grpc_v2.request_from_proto(req)
    with pytest.raises(InvalidInput, match="needs 16 binary bytes"):
        v2.decode_numeric(body.inputs[0])


def test_responses_carry_raw_bytes_that_tritonclient_reads():
    probs = np.array([[0.25, 0.75]], dtype=np.float32)
    response = v2.InferResponse(
        model_name="m",
        model_version="2",
        id="r1",
        parameters={"served_by": ["m-v2"], "degraded": "light"},
        outputs=[v2.encode("probabilities", probs), v2.encode("label", ["positive"])],
    )
    message = grpc_v2.response_to_proto(response)
    result = triton.InferResult(message)
    assert np.array_equal(result.as_numpy("probabilities"), probs)
    assert result.as_numpy("label").tolist() == [b"positive"]
    assert message.model_version == "2" and message.parameters["degraded"].string_param == "light"
    assert message.parameters["served_by"].string_param == "m-v2"


def test_errors_map_to_status_codes_with_retry_after():
    assert grpc_v2.status_of(InvalidInput("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_v2.status_of(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert grpc_v2.status_of(RateLimited("x", retry_after_s=2.4)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    overloaded = Overloaded("busy", retry_after_s=3.6)
    assert grpc_v2.status_of(overloaded) == grpc.StatusCode.UNAVAILABLE
    assert grpc_v2.trailing_metadata(overloaded) == [("retry-after", "4")]
    assert grpc_v2.trailing_metadata(InvalidInput("x")) == []


def test_the_triton_config_http_shows_is_the_model_config_message_tritonclient_reads():
    from google.protobuf import json_format

    from serve_app.manifest import Manifest
    from serve_app.router.routing.catalog import triton_config

    manifest = Manifest.model_validate(
        {"name": "m", "family": "resnet", "inputs": [], "outputs": [], "version": "1", "labels": ["a", "b"], "image_size": 8}
    )
    config = triton_config("m", manifest, 32)
    proto = grpc_v2.config_to_proto(config).config
    assert proto.name == "m" and proto.max_batch_size == 32 and proto.backend == "onnxruntime"
    assert [(i.name, i.data_type, list(i.dims)) for i in proto.input] == [("image", model_config_pb2.TYPE_FP32, [3, 8, 8])]
    assert [o.name for o in proto.output] == ["logits", "probabilities", "label"]
    assert proto.output[2].data_type == model_config_pb2.TYPE_STRING
    back = json_format.MessageToDict(proto, preserving_proto_field_name=True)
    assert back["input"][0]["dims"] == ["3", "8", "8"]  # int64 dims, as Triton's own gRPC answer shows them
    with pytest.raises(json_format.ParseError):
        grpc_v2.config_to_proto({**config, "no_such_field": 1})


def test_grpc_requests_share_the_routers_in_flight_byte_budget_with_http_bodies(tiny_model_dir):
    import asyncio

    from serve_app.config import AppArgs
    from serve_app.router.endpoints.grpc_service import GrpcInference
    from serve_app.router.endpoints.infer_v2 import InferHeaders
    from serve_app.router.parts import build_parts
    from tests.conftest import tiny_args

    parts = build_parts(AppArgs.model_validate(tiny_args(tiny_model_dir)), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    service = GrpcInference(parts)
    request = pb.ModelInferRequest(model_name="bert-heavy")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])  # no contents: malformed
    parts.inflight_bytes.held = parts.inflight_bytes.limit - 1  # HTTP bodies hold all but a byte
    with pytest.raises(Overloaded, match="bytes of requests") as refused:
        asyncio.run(service.model_infer(request, InferHeaders()))
    assert refused.value.retry_after_s == 1.0
    parts.inflight_bytes.held = 0
    with pytest.raises(InvalidInput):
        asyncio.run(service.model_infer(request, InferHeaders()))
    assert parts.inflight_bytes.held == 0  # given back after a refused parse
