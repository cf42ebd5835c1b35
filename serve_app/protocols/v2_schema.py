"""The v2 infer request and response as pydantic models: what `/openapi.json` documents, what
judges a body the fast decoders do not take whole (and says what is wrong with it), and what
writes an answer holding values only pydantic writes as Triton does (NaN and Infinity).

The router works on the plain classes of the same names in serve_app.protocols.v2, which carry
what a body's JSON cannot (the binary extension's bytes, values decoded straight into numpy) and
are cheap to build; `v2.request_from_schema` and `v2.response_to_schema` cross between the two.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(None, description="row-major values; omitted when the tensor travels as binary data")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    # NaN and Infinity as JavaScript literals (as Python's json and Triton write them), not null.
    model_config = ConfigDict(ser_json_inf_nan="constants")

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")

    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]
