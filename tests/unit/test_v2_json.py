"""v2 JSON bodies decoded by msgspec with integer tensors straight into numpy
(serve_app.protocols.v2_json): every body gives what pydantic's full path gives, the same
array or the same 400."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from serve_app.errors import InvalidInput
from serve_app.protocols import v2

N = 600  # elements: every body below is past v2.FAST_JSON_BYTES


def body(data: Any, datatype: str = "UINT8", shape: list[int] | None = None, **extra: Any) -> bytes:
    tensor = {"name": "image", "shape": shape or [N], "datatype": datatype, "data": data}
    return json.dumps({"inputs": [tensor], **extra}).encode()


def outcome(raw: bytes) -> tuple[str, Any]:
    """What a body comes to: the decoded tensor, or the 400's message."""
    try:
        return "array", v2.decode_numeric(v2.parse_request(raw, None).inputs[0])
    except InvalidInput as e:
        return "error", e.message


PIXELS = [i % 256 for i in range(N)]


def _nested(depth: int) -> Any:
    value: Any = 7
    for _ in range(depth):
        value = [value]
    return value


BODIES = {
    "uint8 pixels": body(PIXELS),
    "spaced": json.dumps({"inputs": [{"name": "image", "shape": [N], "datatype": "UINT8", "data": PIXELS}]}, indent=2).encode(),
    "int32 token ids": body([i * 1000 - 5 for i in range(N)], "INT32"),
    "int16": body([-(2**15)] + [2**15 - 1] * (N - 1), "INT16"),
    "past uint8": body([300, *PIXELS[1:]]),
    "negative uint8": body([-1, *PIXELS[1:]]),
    "past int64": body([10**20, *PIXELS[1:]], "INT32"),
    "a fraction in an integer tensor": body([1.5, *PIXELS[1:]]),
    "an exponent": body([100.0, *PIXELS[1:]]),
    "a string": body(["7", *PIXELS[1:]]),
    "a boolean": body([True, *PIXELS[1:]]),
    "a null": body([None, *PIXELS[1:]]),
    "nested rows": body([PIXELS[:300], PIXELS[300:]], shape=[2, 300]),
    "nested with an empty row": body([[], PIXELS], shape=[N]),
    "too few": body(PIXELS[:-1]),
    "too many": body([*PIXELS, 1]),
    "shape mismatch": body(PIXELS, shape=[2, 2]),
    "negative dimension": body(PIXELS, shape=[-1, N]),
    "data not a list": body(5, id="x" * 1100),
    "data an object": body({"a": 1}, id="x" * 1100),
    "no data": json.dumps({"inputs": [{"name": "image", "shape": [N], "datatype": "UINT8"}], "id": "x" * 1100}).encode(),
    "null data": body(None, id="x" * 1100),
    "bool tensor": body([True, False] * (N // 2), "BOOL"),
    "int64 tensor": body(PIXELS, "INT64"),
    "shape of floats": body(PIXELS, shape=[float(N)]),  # type: ignore[list-item]
    "no inputs": json.dumps({"inputs": [], "id": "x" * 1100}).encode(),
    "not JSON": body(PIXELS)[:-3],
    "invalid UTF-8": body(PIXELS).replace(b'"image"', b'"im\xffage"'),
    "data nested deep": body(_nested(300), shape=[1], id="x" * 1100),
    "parameters nested deep": body(PIXELS, parameters={"p": _nested(300)}),
    "a number past every range": body(PIXELS).replace(b"[0, 1, 2", b"[1e400, 1, 2"),
    "past range in an int64 tensor": body(PIXELS, "INT64").replace(b"[0, 1, 2", b"[1e400, 1, 2"),
    "an empty array, spaced": body([], shape=[1], id="x" * 1100).replace(b'"data": []', b'"data": [ ]'),
    "with outputs and parameters": body(
        PIXELS, outputs=[{"name": "label", "parameters": {"binary_data": True}}], parameters={"x": 1}
    ),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_body_comes_to_what_the_full_path_gives(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = BODIES[name]
    assert len(raw) >= v2.FAST_JSON_BYTES
    fast = outcome(raw)
    monkeypatch.setattr(v2, "FAST_JSON_BYTES", len(raw) + 1)  # pydantic's path, as for a small body
    full = outcome(raw)
    assert fast[0] == full[0], (fast, full)
    if fast[0] == "array":
        assert fast[1].dtype == full[1].dtype and fast[1].shape == full[1].shape
        np.testing.assert_array_equal(fast[1], full[1])
    else:
        assert fast[1] == full[1]


def test_small_integer_tensors_skip_python_values() -> None:
    for name, dtype in (("uint8 pixels", np.uint8), ("spaced", np.uint8), ("int32 token ids", np.int32), ("int16", np.int16)):
        tensor = v2.parse_request(BODIES[name], None).inputs[0]
        assert tensor.data is None and tensor.array is not None and tensor.array.dtype == dtype, name
    # The rest of the request is the model pydantic would give.
    full = v2.parse_request(BODIES["with outputs and parameters"], None)
    assert full.outputs is not None and full.outputs[0].wants_binary(False) and full.parameters == {"x": 1}
    # Floats stay on pydantic's path: its parser reads them faster.
    floats = v2.parse_request(body([p / 255 for p in PIXELS], "FP32"), None)
    assert floats.inputs[0].array is None and floats.inputs[0].data is not None
