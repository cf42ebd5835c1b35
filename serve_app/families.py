"""Model families, each registered once: the Serve deployment that runs it, how the router speaks
Open Inference Protocol v2 for it (its codec: the tensors clients send and get, a request's inputs
into the payload its deployment takes, the deployment's answer into v2 outputs), how an ordinary
export of it is read, and what the router may do with it (batch it through its queues, make it a
tier of a route, or stream its tokens).

A family is one `Family` in `BUILT_IN`: the config and the manifest accept its name, the app
builder binds its deployment, the router serves it over v2 (HTTP and gRPC), `serve-app models
import` reads and describes it. Nothing else names a family. Entries name their code by import path
("module:attribute"), imported on first use: this module imports nothing of the project at run
time, so the config schema, the manifest and the app builder read the registry without loading a
deployment (Ray, ONNX Runtime) or the router. `register` adds a family in a process (a test's); a
replica knows only the families its own process registers, so a served family belongs in
`BUILT_IN`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, cast

from pydantic import AfterValidator

if TYPE_CHECKING:
    from serve_app.config import AppArgs, ModelConfig
    from serve_app.exports import ExportReader
    from serve_app.manifest import Manifest
    from serve_app.protocols.v2 import InferRequest, ResponseOutput, TensorMetadata


class Codec:
    """How the router speaks v2 for one family; the built-in ones are in
    serve_app.router.endpoints.codecs."""

    def served_io(self, manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        """The tensors clients send and get (model metadata, Triton's config), which may differ
        from the graph's: text is tokenized server-side, classifiers add probabilities and labels."""
        raise NotImplementedError

    async def decode(self, body: InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> Any:
        """One request's inputs as the payload `deployment` takes; `len(payload)` is its rows.
        Raises InvalidInput (400) for anything wrong, `check_count` past the model's row limit."""
        raise NotImplementedError

    def outputs(self, answer: Any, manifest: Manifest) -> list[ResponseOutput]:
        """The deployment's answer to one payload as v2 outputs, each of `served_io`'s."""
        raise NotImplementedError

    def decodes_apart(self, body: InferRequest) -> bool:
        """Whether the router's image decoder processes decode this request's inputs (encoded
        images): such a request waits on them, and is not the work they yield to."""
        return False


class DeploymentPlan(NamedTuple):
    """The deployment the app builder binds for one model, and the calls one replica may hold."""

    target: str  # "module:attribute" of its @serve.deployment
    max_ongoing_requests: int
    max_queued_requests: int  # -1: unbounded


def load(ref: str) -> Any:
    """The object an import path ("package.module:attribute") names."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _described(manifest: Manifest) -> str:
    return f"inputs {manifest.input_names}, {len(manifest.labels)} labels"


@dataclass(frozen=True)
class Family:
    """One model family, its code named by import path ("module:attribute")."""

    name: str
    deployment: str  # its @serve.deployment; its constructor takes (deployment name, model path, config)
    codec: str  # a Codec
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
    describe: Callable[[Manifest], str] = _described  # one line for `serve-app models import`

    @cached_property
    def v2_codec(self) -> Codec:
        codec = load(self.codec)
        assert isinstance(codec, Codec), f"{self.codec} is not a Codec"
        return codec

    @cached_property
    def export_reader(self) -> ExportReader | None:
        return None if self.export is None else cast("ExportReader", load(self.export))

    def plan(self, config: ModelConfig) -> DeploymentPlan:
        """The deployment to bind for a model of this family, and the calls its replicas hold."""
        if not self.generates:
            # The router sends whole batches, about two at a time per replica; the rest is
            # headroom for several routers.
            return DeploymentPlan(self.deployment, 16, -1)
        gen = config.generation
        if gen.scheduler == "request":
            if self.request_scheduler is None:
                raise ValueError(f"the {self.name} family has no deployment for generation.scheduler: request")
            # @serve.batch fills only when a replica may hold a full batch (ray-project/ray#43288).
            return DeploymentPlan(self.request_scheduler, max(2 * config.batching.max_batch_size, 8), -1)
        # Every sequence it can run or queue, plus a few that its scheduler refuses with a 503 and
        # Retry-After rather than leaving them queued, unbounded, at the caller. Past that, calls
        # wait in Serve's queue at the caller, in arrival order and without bound, until clients
        # time out: bound it, and refuse the rest there (503 + Retry-After,
        # serve_app.router.endpoints.generation). Every call passes through that queue on its way
        # to a replica, so the bound holds a burst as large as a replica's rows.
        rows = gen.kv_slots + gen.max_waiting
        return DeploymentPlan(self.deployment, rows + 8, rows)


def _text_classifier(m: Manifest) -> str:
    return f"text classifier: {len(m.labels)} labels {m.labels[:4]}, up to {m.max_sequence_length} tokens"


def _decoder(m: Manifest) -> str:
    assert m.generation is not None
    g = m.generation
    what = f"decoder: {g.n_layers} layers, {g.n_heads} key/value heads of {g.head_dim}, context {g.block_size}"
    return what + f", end {m.eos_token!r}"


def _image_classifier(m: Manifest) -> str:
    norm = f"mean {m.image.mean} std {m.image.std}" if m.image.normalizes else "no normalization"
    return f"image classifier: input {m.inputs[0].name!r} {m.image_size}x{m.image_size}, {len(m.labels)} labels, {norm}"


BUILT_IN = (
    Family(
        "bert",
        deployment="serve_app.models.classifier:TextClassifier",
        codec="serve_app.router.endpoints.codecs:TEXT_CLASSIFIER",
        export="serve_app.exports:TEXT_CLASSIFIER",
        cascades=True,
        describe=_text_classifier,
    ),
    Family(
        "gpt",
        deployment="serve_app.models.generation.generator:TextGenerator",
        codec="serve_app.router.endpoints.codecs:TEXT_GENERATOR",
        export="serve_app.exports:DECODER",
        generates=True,
        request_scheduler="serve_app.models.generation.generator_static:RequestBatchGenerator",
        describe=_decoder,
    ),
    Family(
        "resnet",
        deployment="serve_app.models.classifier:ImageClassifier",
        codec="serve_app.router.endpoints.codecs:IMAGE_CLASSIFIER",
        export="serve_app.exports:IMAGE_CLASSIFIER",
        cascades=True,
        describe=_image_classifier,
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
