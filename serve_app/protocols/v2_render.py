"""A v2 infer response's body: JSON, or the binary extension's JSON header and raw tensors.

Nearly every answer the router gives passes through here, and most are a few small tensors,
so building pydantic copies of each output and running pydantic's serializer cost more
than the values themselves. The response is written from its fields as a plain dict through
msgspec's encoder instead: the same keys in the same order as pydantic's model dump with
`exclude_none`, the same numbers. Where the two writers would differ, the answer goes
through pydantic as before: a float that is NaN or infinite (pydantic writes the JavaScript
literals Triton writes, msgspec writes null), and data or parameters holding anything but
JSON's own kinds (bytes, which msgspec writes as base64; numpy scalars; nested tensors).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from serve_app.protocols import v2

_ENCODER = msgspec.json.Encoder()
_SCALARS = {str, int, bool, type(None)}
# Outputs the pydantic path must write (see the module docstring).
_FALLBACK = object()


def render_response(response: v2.InferResponse, binary: set[str]) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers; outputs named in `binary` travel as raw bytes after the JSON."""
    blobs: list[bytes] = []
    outputs: list[dict[str, Any]] = []
    for out in response.outputs:
        if not _plain(out.parameters):
            return _by_pydantic(response, binary)
        if out.name in binary:
            blob = v2.binary_blob(out)
            blobs.append(blob)
            outputs.append(_output(out, {**(out.parameters or {}), "binary_data_size": len(blob)}, None))
            continue
        data = _json_data(out)
        if data is _FALLBACK:
            return _by_pydantic(response, binary)
        outputs.append(_output(out, out.parameters, data))
    if not _plain(response.parameters):
        return _by_pydantic(response, binary)
    head: dict[str, Any] = {"model_name": response.model_name}
    for key, value in (("model_version", response.model_version), ("id", response.id), ("parameters", response.parameters)):
        if value is not None:
            head[key] = value
    head["outputs"] = outputs
    text = _ENCODER.encode(head)
    if not blobs:
        return text, {"content-type": "application/json"}
    return text + b"".join(blobs), {"content-type": "application/octet-stream", v2.HEADER_LENGTH: str(len(text))}


def _output(out: v2.ResponseOutput, parameters: dict[str, Any] | None, data: Any) -> dict[str, Any]:
    described: dict[str, Any] = {"name": out.name, "shape": out.shape, "datatype": out.datatype}
    if parameters is not None:
        described["parameters"] = parameters
    if data is not None:
        described["data"] = data
    return described


def _json_data(out: v2.ResponseOutput) -> Any:
    """An output's values as JSON will carry them (None: no data), or _FALLBACK."""
    array = out.array
    if out.data is None and array is not None:
        values = array.ravel().tolist()
        # A sum is NaN or infinite when any value is; a sum past float's range reads as not finite
        # too, and pydantic then writes those values, as correctly.
        return values if array.dtype.kind != "f" or math.isfinite(sum(values)) else _FALLBACK
    return out.data if _plain(out.data) else _FALLBACK


def _plain(value: Any) -> bool:
    """Whether msgspec writes `value` as pydantic does: str, int, bool, None and finite floats,
    in lists and in dicts with str keys."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is list:
        return all(_plain(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    return False


def _by_pydantic(response: v2.InferResponse, binary: set[str]) -> tuple[bytes, dict[str, str]]:
    blobs: list[bytes] = []
    outputs = []
    for out in response.outputs:
        if out.name in binary:
            blob = v2.binary_blob(out)
            blobs.append(blob)
            params = {**(out.parameters or {}), "binary_data_size": len(blob)}
            out = v2.ResponseOutput(out.name, out.shape, out.datatype, params)
        else:
            data = out.data if out.data is not None or out.array is None else out.array.ravel().tolist()
            out = v2.ResponseOutput(out.name, out.shape, out.datatype, out.parameters, data)
        outputs.append(out)
    shown = v2.InferResponse(response.model_name, outputs, response.model_version, response.id, response.parameters)
    head = v2.response_to_schema(shown).model_dump_json(exclude_none=True).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream", v2.HEADER_LENGTH: str(len(head))}
