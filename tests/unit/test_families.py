"""A model family is one registry entry (serve_app.families). A toy family registered here, whose
model adds up each row of its float inputs, is accepted by the config, bound by the app builder,
described by the v2 metadata and served a v2 infer request through the router's own request path
(the edge, admission, its context, the model's queue, a batch, the answer), without Ray: its
replica is the entry's deployment class, called in place of Serve's handle."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ray import serve

from serve_app import families
from serve_app.app import as_deployment, build_app
from serve_app.config import AppArgs, deployment_plan
from serve_app.contract import BULK, BatchReply
from serve_app.errors import InvalidInput
from serve_app.exports import reader_of
from serve_app.families import Family
from serve_app.manifest import Manifest, TensorSpec
from serve_app.protocols import v2
from serve_app.protocols.v2 import TensorMetadata
from serve_app.router.endpoints import codecs
from serve_app.router.endpoints.codecs import Codec, codec_of
from serve_app.router.http import RouterApp, build_http_app
from serve_app.router.parts import build_parts

TOY = "toy-sum"


class SumCodec(Codec):
    """Rows of FP32 numbers in (`x`, shape [N, K]), each row's sum out (`sum`, shape [N])."""

    def served_io(self, manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        x = TensorMetadata(name="x", datatype="FP32", shape=[-1, -1])
        return [x], [TensorMetadata(name="sum", datatype="FP32", shape=[-1])]

    async def decode(self, body: v2.InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> np.ndarray:
        tensor = codecs.single_input(body, "x")
        if tensor.datatype != "FP32" or len(tensor.shape) != 2:
            raise InvalidInput(f"input 'x' must be FP32 of shape [N, K], got {tensor.datatype} {tensor.shape}")
        codecs.check_count(args, deployment, tensor.shape[0])
        return v2.decode_numeric(tensor)

    def outputs(self, answer: Any, manifest: Manifest) -> list[v2.ResponseOutput]:
        return [v2.encode("sum", answer)]


SUM_CODEC = SumCodec()


@serve.deployment
class Adder:
    """The toy family's deployment: one sum per row of each payload, a result per payload."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        self.name = name

    async def run(
        self, payloads: list[Any], router: str = "", router_queued: int = 0, lane: str = BULK, traces: Any = None
    ) -> BatchReply:
        return BatchReply([np.asarray(p, np.float32).sum(axis=1) for p in payloads], 0.0, 0.0)


# The whole of what adding the family takes.
TOY_FAMILY = Family(TOY, deployment=f"{__name__}:Adder", codec=f"{__name__}:SUM_CODEC")


@pytest.fixture
def toy_args(tmp_path: Path) -> Iterator[AppArgs]:
    """The registered toy family, and an app of one model of it."""
    families.register(TOY_FAMILY)
    try:
        model_dir = tmp_path / "adder"
        model_dir.mkdir()
        x, total = TensorSpec(name="x", datatype="FP32", shape=[-1, -1]), TensorSpec(name="sum", datatype="FP32", shape=[-1])
        Manifest(name="adder", family=TOY, inputs=[x], outputs=[total]).save(model_dir)
        (model_dir / "model.onnx").write_bytes(b"")  # what the app builder looks for; the toy replica reads nothing
        yield AppArgs.model_validate({"models": {"adder": {"family": TOY, "path": str(model_dir)}}})
    finally:
        del families.FAMILIES[TOY]


def toy_router(args: AppArgs) -> RouterApp:
    """The router's app, its batches sent to a replica of the deployment the registry names."""
    config = args.deployment_config("adder")
    deployment = families.load(deployment_plan(args.family_of("adder"), config).target)
    replica = deployment.func_or_class("adder", args.model_source("adder"), config.model_dump(mode="json"))

    async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        reply: BatchReply = await replica.run(payloads, "r", queued, lane, traces)
        return reply

    async def nothing() -> None:
        return None

    return build_http_app(build_parts(args, {}, "r", lambda model: send), nothing, nothing)


async def call(app: RouterApp, method: str, path: str, body: bytes = b"") -> tuple[int, dict[bytes, bytes], Any]:
    chunks = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(chunks, {"type": "http.disconnect"})

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}  # fmt: skip
    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def infer_body(rows: list[list[float]], datatype: str = "FP32") -> bytes:
    x = {"name": "x", "shape": [len(rows), len(rows[0])], "datatype": datatype, "data": [v for r in rows for v in r]}
    return json.dumps({"inputs": [x]}).encode()


def test_a_family_registered_in_one_entry_is_served_over_v2(toy_args: AppArgs) -> None:
    app = toy_router(toy_args)

    async def run() -> list[tuple[int, dict[bytes, bytes], Any]]:
        return [
            await call(app, "POST", "/v2/models/adder/infer", infer_body([[1.0, 2.0, 3.0], [0.5, 0.25, -4.0]])),
            await call(app, "GET", "/v2/models/adder"),
            await call(app, "POST", "/v2/models/adder/infer", infer_body([[1, 2]], "INT64")),
        ]

    (status, headers, answer), (_, _, metadata), (bad, _, refusal) = asyncio.run(run())
    assert status == 200 and headers[b"x-served-by"] == b"adder" and b"server-timing" in headers
    assert answer["model_name"] == "adder" and answer["parameters"]["served_by"] == ["adder", "adder"]
    assert answer["outputs"] == [{"name": "sum", "datatype": "FP32", "shape": [2], "data": [6.0, -3.25]}]
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]
    assert metadata["outputs"] == [{"name": "sum", "datatype": "FP32", "shape": [-1]}]
    assert bad == 400 and "input 'x' must be FP32" in refusal["error"]


def test_the_app_builder_binds_the_deployment_the_entry_names(toy_args: AppArgs) -> None:
    router: Any = build_app(toy_args)._bound_deployment
    handles = router.init_args[1]  # the router's (args, handles)
    adder = handles["adder"]._bound_deployment
    assert adder.func_or_class is as_deployment(Adder).func_or_class and adder.max_queued_requests == -1


def test_without_its_entry_the_family_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unknown model family '{TOY}'; known families"):
        AppArgs.model_validate({"models": {"adder": {"family": TOY, "path": str(tmp_path)}}})
    with pytest.raises(ValueError, match="unknown model family"):
        Manifest(name="adder", family=TOY, inputs=[], outputs=[])
    assert TOY not in families.FAMILIES


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.FAMILIES["bert"])


def test_every_built_in_family_names_code_that_loads() -> None:
    for entry in families.BUILT_IN:
        assert isinstance(codec_of(entry), Codec)
        assert reader_of(entry) is not None
        for target in (entry.deployment, entry.request_scheduler):
            if target is not None:
                assert callable(getattr(families.load(target), "bind", None)), target
