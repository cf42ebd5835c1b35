"""Model families, each registered once: the Serve deployment that runs it, how the router speaks
Open Inference Protocol v2 for it (its codec: the tensors clients send and get, a request's inputs
into the payload its deployment takes, the deployment's answer into v2 outputs), how an ordinary
export of it is read, and what the router may do with it (batch it through its queues, make it a
tier of a route, or stream its tokens).

A family is one `Family` in `BUILT_IN`: the config and the manifest accept its name, the app builder
binds its deployment, the router serves it over v2 (HTTP and gRPC), `serve-app models import` reads
and describes it. Nothing else names a family. Entries name their code by import path
("module:attribute"), imported on first use: this module imports nothing of the project, so the
config schema, the manifest and the app builder read the registry without loading a deployment (Ray,
ONNX Runtime) or the router, and nothing imports in a circle through it. What reads an entry's code
lives with what it serves: `codec_of` (serve_app.router.endpoints.codecs), `reader_of` and
`describe` (serve_app.exports), `deployment_plan` (serve_app.config). `register` adds a family in a
process (a test's); a replica knows only the families its own process registers, so a served family
belongs in `BUILT_IN`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

from pydantic import AfterValidator


class DeploymentPlan(NamedTuple):
    """The deployment the app builder binds for one model, and the calls one replica may hold."""

    target: str  # "module:attribute" of its @serve.deployment
    max_ongoing_requests: int
    max_queued_requests: int  # -1: unbounded


def load(ref: str) -> Any:
    """The object an import path ("package.module:attribute") names."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Family:
    """One model family, its code named by import path ("module:attribute")."""

    name: str
    deployment: str  # its @serve.deployment; its constructor takes (deployment name, model path, config)
    codec: str  # a serve_app.router.endpoints.codecs.Codec
    # A serve_app.exports.ExportReader: how a graph of the family is told apart from others and
    # its manifest read from its exporter's files. None: its model directories carry a manifest.json.
    export: str | None = None
    # Its deployment streams tokens from prompts (`generate`, the path OpenAI's endpoints share);
    # otherwise it answers batches of payloads that the router's queues form
    # (`run(payloads, router_id, queued, lane, traces) -> BatchReply`), a numeric array per payload
    # (which the response cache keeps as float32).
    generates: bool = False
    # Its answer is (N, C) logits a route's confidence signal reads: it may be a route's tier.
    cascades: bool = False
    request_scheduler: str | None = None  # generators: the deployment of `generation.scheduler: request`
    # A function of a Manifest: one line for `serve-app models import`. None: its inputs and labels.
    describe: str | None = None


BUILT_IN = (
    Family(
        "bert",
        deployment="serve_app.models.classifier:TextClassifier",
        codec="serve_app.router.endpoints.codecs:TEXT_CLASSIFIER",
        export="serve_app.exports:TEXT_CLASSIFIER",
        cascades=True,
        describe="serve_app.exports:describe_text_classifier",
    ),
    Family(
        "gpt",
        deployment="serve_app.models.generation.generator:TextGenerator",
        codec="serve_app.router.endpoints.codecs:TEXT_GENERATOR",
        export="serve_app.exports:DECODER",
        generates=True,
        request_scheduler="serve_app.models.generation.generator_static:RequestBatchGenerator",
        describe="serve_app.exports:describe_decoder",
    ),
    Family(
        "resnet",
        deployment="serve_app.models.classifier:ImageClassifier",
        codec="serve_app.router.endpoints.codecs:IMAGE_CLASSIFIER",
        export="serve_app.exports:IMAGE_CLASSIFIER",
        cascades=True,
        describe="serve_app.exports:describe_image_classifier",
    ),
)
FAMILIES: dict[str, Family] = {f.name: f for f in BUILT_IN}


def register(family: Family) -> Family:
    """Add a family to this process's registry."""
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def family(name: str) -> Family:
    """The registered family of that name; ValueError, naming the known ones, for any other."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known families: {sorted(FAMILIES)}") from None


def known(name: str) -> str:
    """`name`, once checked to be a registered family."""
    family(name)
    return name


# A family's name in the config and the manifest: a registered one, or a validation error naming them.
FamilyName = Annotated[str, AfterValidator(known)]
