"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): tensors in JSON or in the binary extension.

The binary tensor data extension (Triton's `binary_tensor_data`): the body is a
JSON header of `Inference-Header-Content-Length` bytes followed by raw tensor
bytes, one blob per input that names its `parameters.binary_data_size`, in
input order. Numbers are little-endian and row-major; a BYTES element is a
4-byte little-endian length and then its bytes. Outputs come back the same way
when the request asks (`parameters.binary_data_output`, or per output
`parameters.binary_data`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from serve_app.errors import InvalidInput
from serve_app.protocols import v2_json, v2_schema

HEADER_LENGTH = "inference-header-content-length"
EXTENSIONS = ["binary_tensor_data", "parameters", "model_configuration"]

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
# The reverse, looked up once per output tensor of every answer.
DATATYPE_OF: dict[np.dtype[Any], str] = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}


# Far above any tensor a request may carry (the body limit comes first); they keep shape
# arithmetic, and every array it sizes, within int64.
MAX_DIMS = 8
MAX_ELEMENTS = 2**40


@dataclass(slots=True, eq=False)
class RequestInput:
    """One input tensor of a request (its documented shape: serve_app.protocols.v2_schema)."""

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None  # row-major values, when they came in JSON (or gRPC's typed contents)
    # The tensor's bytes when it came in the binary extension, not in `data`: a view of the
    # request's body (no copy of it).
    raw: bytes | memoryview | None = None
    # The tensor's values, flat, when its JSON `data` was numbers decoded straight into numpy
    # (serve_app.protocols.v2_json); `data` is then None.
    array: np.ndarray | None = None

    def has_data(self) -> bool:
        return self.data is not None or self.array is not None

    def binary_size(self) -> int | None:
        size = (self.parameters or {}).get("binary_data_size")
        if size is None:
            return None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"input {self.name!r}: parameters.binary_data_size must be a non-negative integer")
        return size

    def element_count(self) -> int:
        """Elements the shape declares, refused past MAX_ELEMENTS. The product is taken in Python's
        exact integers: in int64, a dimension past its range raises and a huge product wraps."""
        if any(d < 0 for d in self.shape):
            raise InvalidInput(f"input {self.name!r}: shape {self.shape} has a negative dimension")
        if len(self.shape) > MAX_DIMS:
            raise InvalidInput(f"input {self.name!r}: shape has {len(self.shape)} dimensions; at most {MAX_DIMS}")
        n = math.prod(self.shape)
        if n > MAX_ELEMENTS:
            raise InvalidInput(f"input {self.name!r}: shape {self.shape} declares {n} elements; at most {MAX_ELEMENTS}")
        return n


@dataclass(slots=True)
class RequestOutput:
    name: str
    parameters: dict[str, Any] | None = None

    def wants_binary(self, default: bool) -> bool:
        return bool((self.parameters or {}).get("binary_data", default))


@dataclass(slots=True, eq=False)
class InferRequest:
    """A request, once parsed and its fields' types checked: by msgspec's typed decoders, by
    pydantic's validation (v2_schema), or by gRPC's message types."""

    inputs: list[RequestInput]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[RequestOutput] | None = None


@dataclass(slots=True, eq=False)
class ResponseOutput:
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None
    # A numeric output's values as computed (`encode`): the binary extension and gRPC send their
    # bytes as they are, and the Python list in `data` is built only for a JSON body (`with_data`).
    array: np.ndarray | None = None

    def with_data(self) -> ResponseOutput:
        """This output with its values in `data`, for a JSON body."""
        if self.data is None and self.array is not None:
            self.data = self.array.ravel().tolist()
        return self


@dataclass(slots=True, eq=False)
class InferResponse:
    model_name: str
    outputs: list[ResponseOutput]
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None


def request_from_schema(body: v2_schema.InferRequest) -> InferRequest:
    """The request pydantic validated, as the router works on it."""
    inputs = [RequestInput(t.name, t.shape, t.datatype, t.parameters, t.data) for t in body.inputs]
    outputs = None if body.outputs is None else [RequestOutput(o.name, o.parameters) for o in body.outputs]
    return InferRequest(inputs, body.id, body.parameters, outputs)


def request_of(data: Any) -> InferRequest:
    """A request from its JSON as Python values, validated as a body would be (tests and tools)."""
    return request_from_schema(v2_schema.InferRequest.model_validate(data))


def response_to_schema(response: InferResponse) -> v2_schema.InferResponse:
    """The response as pydantic's model, to write what only pydantic writes as Triton does."""
    # As the router made them: written as they are, not validated again.
    made = v2_schema.ResponseOutput.model_construct
    outputs = [
        made(name=o.name, shape=o.shape, datatype=o.datatype, parameters=o.parameters, data=o.data) for o in response.outputs
    ]
    return v2_schema.InferResponse.model_construct(
        model_name=response.model_name, model_version=response.model_version, id=response.id,
        parameters=response.parameters, outputs=outputs,
    )  # fmt: skip


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


def _flatten_typed(data: list[Any]) -> tuple[list[Any], set[type]]:
    """The elements in row-major order, and their types. Data usually comes flat: then one
    type scan in C replaces a Python loop over every element, which is far slower on an
    image-sized tensor."""
    kinds = set(map(type, data))
    if list not in kinds:
        return data, kinds
    flat = _flatten(data)
    return flat, set(map(type, flat))


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


def parse_request(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """An infer request from its raw body, JSON or binary-extension; every fault is an InvalidInput.

    Binary tensors are views of `body`, not copies: a body of megabytes (a request of images)
    would otherwise be copied once per slice on the router's event loop, holding up every other
    request meanwhile."""
    view = memoryview(body).toreadonly()  # what is made of it cannot write into the body
    json_part: bytes | bytearray = body
    rest = view[len(body) :]
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidInput(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        if not 0 < n <= len(body):
            raise InvalidInput(f"Inference-Header-Content-Length is {n}, but the body has {len(body)} bytes")
        json_part, rest = bytes(view[:n]), view[n:]
    # Only for a body with a tensor worth decoding apart, and none of floats (see v2_json).
    if len(json_part) < FAST_JSON_BYTES:
        request = _decoded_small(json_part)
    else:
        request = _decoded_fast(json_part) if b'"FP' not in json_part else None
    if request is None:
        request = _validated(json_part)
    offset = 0
    for tensor in request.inputs:
        size = tensor.binary_size()
        if size is None:
            if not tensor.has_data():
                raise InvalidInput(f"input {tensor.name!r} has neither `data` nor parameters.binary_data_size")
            continue
        if tensor.has_data():
            raise InvalidInput(f"input {tensor.name!r} has both `data` and parameters.binary_data_size; send one")
        if offset + size > len(rest):
            raise InvalidInput(
                f"input {tensor.name!r} declares {size} binary bytes, but only {len(rest) - offset} follow the JSON header"
            )
        tensor.raw = rest[offset : offset + size]
        offset += size
    if offset != len(rest):
        raise InvalidInput(f"{len(rest) - offset} bytes after the JSON header belong to no input (binary_data_size)")
    return request


# Below this, a body carries no tensor worth decoding apart (a few texts, a small tensor): it is
# decoded in one pass, values and all (`_decoded_small`).
FAST_JSON_BYTES = 1024


def _decoded_small(json_part: bytes | bytearray) -> InferRequest | None:
    """A small body through msgspec's typed decoder, which has checked every field's type; a body
    it does not take whole, None, goes to pydantic, which says what is wrong with it."""
    small = v2_json.decode_small(json_part)
    if small is None:
        return None
    inputs = [RequestInput(t.name, t.shape, t.datatype, t.parameters, t.data) for t in small.inputs]
    outputs = None if small.outputs is None else [RequestOutput(o.name, o.parameters) for o in small.outputs]
    return InferRequest(inputs, small.id, small.parameters, outputs)


def _decoded_fast(json_part: bytes | bytearray) -> InferRequest | None:
    """The request with its integer `data` decoded straight into numpy; None for a body only
    pydantic's validation should judge (it then says what is wrong)."""
    fast = v2_json.decode(json_part)
    if fast is None:
        return None
    inputs = []
    for t in fast.inputs:
        tensor = RequestInput(t.name, t.shape, t.datatype, t.parameters)
        dtype = NUMPY_DTYPES.get(t.datatype)
        try:
            count = tensor.element_count()
        except InvalidInput:  # pydantic's path gives the same refusal, in decode_numeric
            count = 0
        if dtype is not None and len(t.data) and (array := v2_json.numbers(t.data, np.dtype(dtype), count)) is not None:
            tensor.array = array
        else:
            ok, data = v2_json.data_of(t.data)
            if not ok or (data is not None and not isinstance(data, list)):
                return None
            tensor.data = data
        inputs.append(tensor)
    outputs = None if fast.outputs is None else [RequestOutput(o.name, o.parameters) for o in fast.outputs]
    return InferRequest(inputs, fast.id, fast.parameters, outputs)


def _validated(json_part: bytes | bytearray) -> InferRequest:
    # One pass in pydantic-core's parser, straight into the model: no intermediate Python objects
    # from a separate json.loads.
    try:
        return request_from_schema(v2_schema.InferRequest.model_validate_json(json_part))
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise InvalidInput(f"request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}") from None
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise InvalidInput(f"malformed request body: {problems}") from None


def _split_bytes_elements(name: str, raw: bytes | memoryview) -> list[memoryview]:
    """The elements of a binary BYTES tensor, each a view of `raw` (no copy)."""
    view, out, i = memoryview(raw), [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise InvalidInput(f"input {name!r}: binary BYTES data ends inside a 4-byte length prefix")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise InvalidInput(f"input {name!r}: a BYTES element declares {n} bytes, past the end of its data")
        out.append(view[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def decode_raw_bytes(tensor: RequestInput) -> list[memoryview | bytes | str]:
    """BYTES elements as sent: views of the body's bytes from the binary extension, str from JSON,
    bytes from gRPC's typed contents."""
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input {tensor.name!r} must have datatype BYTES, got {tensor.datatype}")
    n = tensor.element_count()
    raw = tensor.raw
    values: list[Any] = _split_bytes_elements(tensor.name, raw) if raw is not None else _flatten_typed(tensor.data or [])[0]
    if len(values) != n:
        raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} needs {n} elements, got {len(values)}")
    if raw is None and not all(isinstance(v, str | bytes) for v in values):
        raise InvalidInput(f"input {tensor.name!r}: BYTES elements must be strings in JSON")
    return values


def decode_bytes(tensor: RequestInput, max_chars: int | None = None) -> list[str]:
    """BYTES elements as text: binary elements must be valid UTF-8."""
    texts: list[str] = []
    for i, v in enumerate(decode_raw_bytes(tensor)):
        if not isinstance(v, str):
            try:
                v = str(v, "utf-8")
            except UnicodeDecodeError as e:
                raise InvalidInput(
                    f"input {tensor.name!r}: element {i} is not valid UTF-8 ({e.reason} at byte {e.start})"
                ) from None
        if max_chars is not None and len(v) > max_chars:
            raise InvalidInput(f"input {tensor.name!r}: element {i} has {len(v)} characters; at most {max_chars} are allowed")
        texts.append(v)
    return texts


def decode_numeric(tensor: RequestInput) -> np.ndarray:
    dtype = NUMPY_DTYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidInput(f"input {tensor.name!r}: unsupported datatype {tensor.datatype}; use one of {sorted(NUMPY_DTYPES)}")
    n = tensor.element_count()
    raw, array = tensor.raw, tensor.array
    if raw is not None:
        want = n * np.dtype(dtype).itemsize
        if len(raw) != want:
            raise InvalidInput(
                f"input {tensor.name!r}: shape {tensor.shape} of {tensor.datatype} needs {want} binary bytes, got {len(raw)}"
            )
        # A read-only view of the body where the byte order is already native (no copy).
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False).reshape(tensor.shape)
    if array is not None:  # decoded for this datatype and shape (v2_json.numbers)
        return array.reshape(tensor.shape)
    values, kinds = _flatten_typed(tensor.data or [])
    if len(values) != n:
        raise InvalidInput(f"input {tensor.name!r}: shape {tensor.shape} needs {n} elements, got {len(values)}")
    # numpy would take "1.5" or True as numbers: refuse them by type (a set of types, built in C).
    if tensor.datatype != "BOOL" and not kinds <= {int, float}:
        raise InvalidInput(f"input {tensor.name!r}: data is not {tensor.datatype}: found a string, boolean or null")
    try:
        arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidInput(f"input {tensor.name!r}: data is not {tensor.datatype}: {e}") from None
    return arr.reshape(tensor.shape)


def encode(name: str, value: np.ndarray | list[str]) -> ResponseOutput:
    if isinstance(value, list):
        return ResponseOutput(name, [len(value)], "BYTES", data=value)
    datatype = DATATYPE_OF.get(value.dtype)
    assert datatype is not None, f"no v2 datatype for {value.dtype}"
    return ResponseOutput(name, list(value.shape), datatype, array=value)


def made_response(
    name: str, version: str | None, request_id: str | None, parameters: dict[str, Any] | None, outputs: list[ResponseOutput]
) -> InferResponse:
    """A response the router made itself."""
    return InferResponse(name, outputs, version, request_id, parameters)


def binary_blob(output: ResponseOutput) -> bytes:
    if output.datatype == "BYTES":
        parts = []
        for v in output.data or []:
            b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    wire = np.dtype(NUMPY_DTYPES[output.datatype]).newbyteorder("<")
    array = output.array
    values: np.ndarray | list[Any] = array if array is not None else (output.data or [])
    return np.ascontiguousarray(values, dtype=wire).tobytes()


def binary_outputs(request: InferRequest, produced: list[str]) -> set[str]:
    """Which outputs the client asked to get as binary data."""
    default = bool((request.parameters or {}).get("binary_data_output", False))
    if request.outputs is None:
        return set(produced) if default else set()
    return {o.name for o in request.outputs if o.wants_binary(default)}
