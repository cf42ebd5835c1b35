"""The generation endpoints' admission, without Ray: the caller's deadline (or the configured
generation timeout) and one rate-limit token per generation, however many prompts and choices.
Also, on v2 infer's shared path: which classifications the router's image decoders yield to."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.errors import InvalidInput, RateLimited
from serve_app.protocols.openai import SamplingFields
from serve_app.router.endpoints import endpoints_openai
from serve_app.router.endpoints.endpoints_openai import CallerHeaders
from serve_app.router.parts import RouterParts, build_parts
from serve_app.router.request_context import InferHeaders, RequestContext
from serve_app.scheduling.tenants import Tenant, TokenBucket
from tests.conftest import tiny_args


@pytest.fixture
def parts(tiny_model_dir: Path) -> RouterParts:
    args = AppArgs.model_validate({**tiny_args(tiny_model_dir), "limits": {"generation_timeout_s": 40}})
    return build_parts(args, {"gpt": object()}, "r", lambda model: None)  # type: ignore[arg-type,return-value]


def called(tenant: Tenant, name: str = "gpt") -> RequestContext:
    return RequestContext(name, None, tenant, Priority.NORMAL, None)


def test_a_generation_takes_the_callers_deadline_or_the_configured_timeout(parts: RouterParts):
    before = time.monotonic()
    deadline = endpoints_openai._admit(parts, CallerHeaders(None, None, "250"), "gpt").deadline
    assert deadline is not None and before + 0.25 <= deadline <= time.monotonic() + 0.25
    deadline = endpoints_openai._admit(parts, CallerHeaders(None, None, None), "gpt").deadline
    assert deadline is not None and before + 40 <= deadline <= time.monotonic() + 40


def test_every_prompt_and_choice_is_charged_to_the_tenant(parts: RouterParts):
    now = [0.0]
    tenant = Tenant("t", bucket=TokenBucket(rate_per_s=1, burst=10, clock=lambda: now[0]))
    tenant.admit()  # the token every request pays on arrival
    endpoints_openai._generator_for(parts, called(tenant), SamplingFields(model="gpt", n=4), ["a", "b"])  # 8 in all
    tenant.admit()  # 9 of 10 taken
    tenant.admit()
    with pytest.raises(RateLimited):
        endpoints_openai._generator_for(parts, called(tenant), SamplingFields(model="gpt", n=2), ["a"])


@pytest.mark.parametrize(
    ("fields", "prompts"),
    [
        (SamplingFields(model="gpt", n=4, max_tokens=10**9), ["a", "b"]),  # past the generation limit
        (SamplingFields(model="gpt", n=4), ["a", "\ud800"]),  # a lone surrogate
        (SamplingFields(model="gpt", n=4, stream=True), ["a", "b"]),  # streaming takes one prompt
    ],
)
def test_a_refused_request_costs_its_caller_only_the_arrival_token(
    parts: RouterParts, fields: SamplingFields, prompts: list[str]
):
    now = [0.0]
    tenant = Tenant("t", bucket=TokenBucket(rate_per_s=1, burst=10, clock=lambda: now[0]))
    tenant.admit()  # the token every request pays on arrival
    with pytest.raises(InvalidInput):
        endpoints_openai._generator_for(parts, called(tenant), fields, prompts)
    for _ in range(9):  # the other nine tokens are still there
        tenant.admit()
    with pytest.raises(RateLimited):
        tenant.admit()


def test_on_the_v2_path_too_a_refused_generation_costs_only_the_arrival_token(parts: RouterParts):
    from serve_app.families import family
    from serve_app.protocols import v2
    from serve_app.router.endpoints import infer_v2
    from serve_app.router.endpoints.codecs import codec_of

    now = [0.0]
    tenant = Tenant("t", bucket=TokenBucket(rate_per_s=1, burst=10, clock=lambda: now[0]))
    tenant.admit()  # the token every request pays on arrival
    body = v2.request_of(
        {
            "inputs": [{"name": "text_input", "shape": [4], "datatype": "BYTES", "data": ["a", "b", "c", "d"]}],
            "parameters": {"max_tokens": 10**9},
        }
    )
    manifest = asyncio.run(parts.catalog.manifest("gpt"))
    call = infer_v2._generate(parts, called(tenant), codec_of(family("gpt")), manifest, body)
    with pytest.raises(InvalidInput):
        asyncio.run(call)
    for _ in range(9):  # the other nine tokens are still there
        tenant.admit()
    with pytest.raises(RateLimited):
        tenant.admit()


@pytest.mark.parametrize(
    ("model", "tensor", "priority", "held"),
    [
        ("bert-heavy", {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a review"]}, "normal", 1),
        ("bert-heavy", {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a review"]}, "low", 0),
        ("resnet-heavy", {"name": "image", "shape": [1], "datatype": "BYTES", "data": ["a PNG"]}, "high", 0),
    ],
)
def test_v2_infer_marks_a_classification_as_work_the_image_decoders_yield_to(
    parts: RouterParts, monkeypatch: pytest.MonkeyPatch, model: str, tensor: dict[str, Any], priority: str, held: int
):
    from serve_app.process import cpu_priority
    from serve_app.protocols import v2
    from serve_app.router.endpoints import infer_v2

    seen: list[int] = []

    async def batched(*args: Any) -> infer_v2.Answer:  # in place of the queue and the model
        seen.append(cpu_priority.MODEL_WORK.count)
        return infer_v2.Answer([], [model], "1")

    monkeypatch.setattr(infer_v2, "_batched", batched)
    body = v2.request_of({"inputs": [tensor]})
    tenant = Tenant("t", bucket=TokenBucket(rate_per_s=1, burst=10, clock=lambda: 0.0))
    ctx = infer_v2.admitted(parts, model, None, body, InferHeaders(priority=priority), tenant)
    asyncio.run(infer_v2.infer(parts, ctx, body))
    assert seen == [held] and cpu_priority.MODEL_WORK.count == 0
