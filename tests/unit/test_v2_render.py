"""v2 response bodies (serve_app.protocols.v2_render): the msgspec writer gives what pydantic's
model dump gives, and hands pydantic the answers where the two would differ."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from serve_app.protocols import v2, v2_render, v2_schema


def _pydantic_body(response: v2.InferResponse, binary: set[str]) -> tuple[bytes, dict[str, str]]:
    """The body as pydantic writes it, from the schema's models (serve_app.protocols.v2_schema)."""
    blobs, outputs = [], []
    for out in response.outputs:
        parameters, data = out.parameters, out.data
        if out.name in binary:
            blob = v2.binary_blob(out)
            blobs.append(blob)
            parameters, data = {**(out.parameters or {}), "binary_data_size": len(blob)}, None
        elif data is None and out.array is not None:
            data = out.array.ravel().tolist()
        outputs.append(
            v2_schema.ResponseOutput.model_construct(
                name=out.name, shape=out.shape, datatype=out.datatype, parameters=parameters, data=data
            )
        )
    whole = v2_schema.InferResponse.model_construct(
        model_name=response.model_name, model_version=response.model_version, id=response.id,
        parameters=response.parameters, outputs=outputs,
    )  # fmt: skip
    head = whole.model_dump_json(exclude_none=True).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream", v2.HEADER_LENGTH: str(len(head))}


def _split(body: bytes, headers: dict[str, str]) -> tuple[Any, bytes]:
    n = int(headers.get(v2.HEADER_LENGTH, len(body)))
    return json.loads(body[:n]), body[n:]


def _response(**fields: Any) -> v2.InferResponse:
    logits = np.array([[0.3, -0.2], [1.5, 2.25]], dtype=np.float32)
    defaults: dict[str, Any] = {
        "model_name": "bert-heavy",
        "outputs": [v2.encode("logits", logits), v2.encode("label", ["negative", "positivé"])],
    }
    return v2.InferResponse(**{**defaults, **fields})


CASES = {
    "plain": _response(),
    "every field": _response(model_version="2", id="req-1", parameters={"served_by": ["a", "b"], "degraded": None}),
    "output parameters": _response(
        outputs=[v2.ResponseOutput(name="x", shape=[2], datatype="INT64", data=[1, 2**62], parameters={"k": None, "n": 3})]
    ),
    "ints, bools and small floats": _response(
        outputs=[
            v2.encode("i", np.array([[-(2**63), 2**63 - 1]], dtype=np.int64)),
            v2.encode("b", np.array([True, False])),
            v2.encode("h", np.array([1e-7, 65504.0], dtype=np.float16)),
            v2.encode("d", np.array([1e-300, 1e300, -0.0])),
        ]
    ),
    "a list of numbers": _response(outputs=[v2.ResponseOutput(name="x", shape=[3], datatype="FP64", data=[1, 0.5, True])]),
    "no data": _response(outputs=[v2.ResponseOutput(name="x", shape=[0], datatype="FP32")]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("binary", [False, True])
def test_the_body_reads_as_pydantics_does(name: str, binary: bool) -> None:
    response = CASES[name]
    asked = {o.name for o in response.outputs} if binary else set()
    body, headers = v2_render.render_response(response, asked)
    expected_body, expected_headers = _pydantic_body(response, asked)
    assert set(headers) == set(expected_headers) and headers["content-type"] == expected_headers["content-type"]
    assert _split(body, headers) == _split(expected_body, expected_headers)


def test_the_key_order_is_pydantics():
    response = CASES["every field"]
    body, _ = v2_render.render_response(response, set())
    expected, _ = _pydantic_body(response, set())
    assert list(json.loads(body)) == list(json.loads(expected))
    assert [list(o) for o in json.loads(body)["outputs"]] == [list(o) for o in json.loads(expected)["outputs"]]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_written_as_triton_writes_them(bad: float):
    response = _response(outputs=[v2.encode("logits", np.array([[0.5, bad]], dtype=np.float32))])
    body, _ = v2_render.render_response(response, set())
    literal = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}[repr(bad)]
    assert b"[0.5," + literal + b"]" in body
    # As a list of values too, and whatever the sum of the values says.
    listed = _response(outputs=[v2.ResponseOutput(name="x", shape=[2], datatype="FP64", data=[1.0, bad])])
    assert literal in v2_render.render_response(listed, set())[0]


def test_values_only_pydantic_writes_go_to_pydantic():
    for data in ([b"raw"], [[1, 2], [3, 4]], [None]):
        response = _response(outputs=[v2.ResponseOutput(name="x", shape=[len(data)], datatype="BYTES", data=data)])
        body, _ = v2_render.render_response(response, set())
        assert body == _pydantic_body(response, set())[0], data
    odd = _response(parameters={"t": v2.TensorMetadata(name="a", datatype="FP32", shape=[1])})  # msgspec refuses it
    assert v2_render.render_response(odd, set())[0] == _pydantic_body(odd, set())[0]


def test_a_sum_past_floats_range_is_still_written_right():
    """Each value is finite but their sum is not: the answer is right either way."""
    values = np.array([1.7e308, 1.7e308])
    body, _ = v2_render.render_response(_response(outputs=[v2.encode("x", values)]), set())
    assert json.loads(body)["outputs"][0]["data"] == values.tolist()


def test_rendering_leaves_the_outputs_as_they_were():
    response = _response()
    v2_render.render_response(response, set())
    v2_render.render_response(response, {"logits"})
    assert all(o.data is None for o in response.outputs if o.array is not None)


@pytest.mark.parametrize(
    "parameters",
    [{"score": math.nan}, {"s": [1.0, math.inf]}, {"b": b"hi"}, {"n": {"deep": -math.inf}}, {"t": (1, 2)}],
    ids=["nan", "inf in a list", "bytes", "nested", "tuple"],
)
@pytest.mark.parametrize("where", ["response", "output", "binary output"])
def test_parameters_msgspec_would_write_otherwise_go_to_pydantic(parameters: dict[str, Any], where: str):
    if where == "response":
        response = _response(parameters=parameters)
    else:
        out = v2.encode("logits", np.array([[0.5, 0.25]], dtype=np.float32))
        out.parameters = parameters
        response = _response(outputs=[out])
    binary = {"logits"} if where == "binary output" else set()
    assert v2_render.render_response(response, binary) == _pydantic_body(response, binary)
