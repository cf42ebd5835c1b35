"""The Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`, the service Triton's
and KServe's gRPC clients speak): its messages to and from the v2 models the HTTP endpoints use,
so both wire formats share one request path. No Ray, no server: plain conversions.

Messages are tritonclient's generated ones (`tritonclient.grpc.service_pb2`), the same module
Ray Serve's gRPC proxy registers the service from (`grpc_servicer_functions` in the configs).
"""

from __future__ import annotations

import sys
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from serve_app.errors import InvalidInput, ServeAppError
from serve_app.protocols import v2

# tritonclient's generated messages name their modules as protoc wrote them (`grpc_service_pb2`,
# `model_config_pb2`), not by where tritonclient put them. Serve pickles each message between its
# proxy and the router, and pickle finds a class by its module's name: register those names in
# every process that loads this module (the proxy does, through SERVICER).
sys.modules.setdefault(pb.ServerLiveRequest.__module__, pb)
sys.modules.setdefault(model_config_pb2.ModelConfig.__module__, model_config_pb2)

SERVICER = "serve_app.protocols.grpc_v2.add_servicer"


def add_servicer(servicer: Any, server: Any) -> None:
    """What `grpc_options.grpc_servicer_functions` names: Triton's service, registered on Serve's proxy."""
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


# Which typed field of InferTensorContents holds each datatype (Triton's layout).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def parameter_value(p: pb.InferParameter) -> Any:
    choice = p.WhichOneof("parameter_choice")
    return getattr(p, choice) if choice else None


def parameters(params: Any) -> dict[str, Any] | None:
    """A protobuf parameter map as the plain dict the HTTP path reads (None when empty)."""
    return {k: parameter_value(v) for k, v in params.items()} or None


def set_parameter(target: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value if isinstance(value, str) else ",".join(map(str, value))


def request_from_proto(req: pb.ModelInferRequest) -> v2.InferRequest:
    """A ModelInferRequest as the HTTP path's InferRequest: raw contents become the tensors'
    binary data (read in place, as the binary extension's are), typed contents their `data`."""
    if not req.inputs:
        raise InvalidInput("the request has no inputs")
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs; send one per input")
    inputs = []
    for i, t in enumerate(req.inputs):
        tensor = v2.RequestInput(t.name, list(t.shape), t.datatype, parameters(t.parameters))
        if raw:
            tensor.raw = raw[i]
        else:
            field = CONTENTS_FIELD.get(t.datatype)
            if field is None:
                raise InvalidInput(f"input {t.name!r}: datatype {t.datatype} cannot travel in typed contents; use raw")
            tensor.data = list(getattr(t.contents, field))
        inputs.append(tensor)
    outputs = [v2.RequestOutput(o.name, parameters(o.parameters)) for o in req.outputs] or None
    return v2.InferRequest(inputs, req.id or None, parameters(req.parameters), outputs)


def response_to_proto(resp: v2.InferResponse) -> pb.ModelInferResponse:
    """Every output's bytes in raw_output_contents, as Triton answers its gRPC clients."""
    out = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version or "", id=resp.id or "")
    for key, value in (resp.parameters or {}).items():
        set_parameter(out.parameters[key], value)
    for o in resp.outputs:
        tensor = out.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
        for key, value in (o.parameters or {}).items():
            set_parameter(tensor.parameters[key], value)
        out.raw_output_contents.append(v2.binary_blob(o))
    return out


def status_of(error: ServeAppError) -> grpc.StatusCode:
    return STATUS.get(error.status_code, grpc.StatusCode.INTERNAL)


def trailing_metadata(error: ServeAppError) -> list[tuple[str, str]]:
    """What HTTP says in headers: when to come back after an overload."""
    retry = error.retry_after_s
    return [("retry-after", str(max(1, round(retry))))] if retry else []


def config_to_proto(config: dict[str, Any]) -> pb.ModelConfigResponse:
    """Triton's model config (the dict HTTP's `/config` returns) as its protobuf message; an
    unknown field or data type raises, so the two wire formats cannot drift apart silently."""
    return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))
