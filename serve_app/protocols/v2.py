"""Open Inference Protocol v2 (KServe v2 / Triton HTTP), JSON tensor form."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from serve_app.errors import InvalidInput

# v2 datatype -> numpy dtype (BYTES is handled apart: a list of str).
NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


def _flatten(data: list[Any]) -> list[Any]:
    out: list[Any] = []
    stack = [data]
    while stack:  # iterative, so a deeply nested body cannot blow the stack
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def decode_bytes(tensor: RequestInput) -> list[str]:
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input {tensor.name!r} must have datatype BYTES, got {tensor.datatype}")
    values = _flatten(tensor.data)
    if len(values) != int(np.prod(tensor.shape)):
        raise InvalidInput(
            f"input {tensor.name!r}: shape {tensor.shape} needs {int(np.prod(tensor.shape))} elements, got {len(values)}"
        )
    if not all(isinstance(v, str) for v in values):
        raise InvalidInput(f"input {tensor.name!r}: BYTES elements must be strings in JSON")
    return values


def decode_numeric(tensor: RequestInput) -> np.ndarray:
    dtype = NUMPY_DTYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidInput(f"input {tensor.name!r}: unsupported datatype {tensor.datatype}; use one of {sorted(NUMPY_DTYPES)}")
    if any(d < 0 for d in tensor.shape):
        raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} has a negative dimension")
    values = _flatten(tensor.data)
    n = int(np.prod(tensor.shape))
    if len(values) != n:
        raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} needs {n} elements, got {len(values)}")
    try:
        arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"input {tensor.name!r}: data is not {tensor.datatype}: {e}") from None
    return arr.reshape(tensor.shape)


def encode(name: str, value: np.ndarray | list[str]) -> ResponseOutput:
    if isinstance(value, list):
        return ResponseOutput(name=name, shape=[len(value)], datatype="BYTES", data=value)
    datatype = next((k for k, v in NUMPY_DTYPES.items() if np.dtype(v) == value.dtype), None)
    assert datatype is not None, f"no v2 datatype for {value.dtype}"
    return ResponseOutput(name=name, shape=list(value.shape), datatype=datatype, data=value.ravel().tolist())
