"""How the built-in families speak Open Inference Protocol v2 (serve_app.families names them): the
tensors their clients send and get, inputs checked and decoded into the payload a deployment
takes, and outputs built from its answer; and the checks every codec shares."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.errors import InvalidInput
from serve_app.families import Family, load
from serve_app.manifest import Manifest
from serve_app.models.prediction import softmax_rows
from serve_app.process.cpu_priority import MODEL_WORK
from serve_app.protocols import v2
from serve_app.protocols.decoders import DECODERS
from serve_app.protocols.v2 import TensorMetadata

TEXT_INPUT = "text"
IMAGE_INPUT = "image"
PROMPT_INPUT = "text_input"
GENERATED_OUTPUT = "text_output"


class Codec:
    """How the router speaks v2 for one family (a Family's `codec`)."""

    def served_io(self, manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        """The tensors clients send and get (model metadata, Triton's config), which may differ
        from the graph's: text is tokenized server-side, classifiers add probabilities and labels."""
        raise NotImplementedError

    async def decode(self, body: v2.InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> Any:
        """One request's inputs as the payload `deployment` takes; `len(payload)` is its rows.
        Raises InvalidInput (400) for anything wrong, `check_count` past the model's row limit."""
        raise NotImplementedError

    def outputs(self, answer: Any, manifest: Manifest) -> list[v2.ResponseOutput]:
        """The deployment's answer to one payload as v2 outputs, each of `served_io`'s."""
        raise NotImplementedError

    def decodes_apart(self, body: v2.InferRequest) -> bool:
        """Whether the router's image decoder processes decode this request's inputs (encoded
        images): such a request waits on them, and is not the work they yield to."""
        return False


@functools.cache
def codec_of(family: Family) -> Codec:
    """The family's codec, imported once."""
    codec = load(family.codec)
    assert isinstance(codec, Codec), f"{family.codec} is not a Codec"
    return codec


def single_input(body: v2.InferRequest, expected: str) -> v2.RequestInput:
    match = [t for t in body.inputs if t.name == expected]
    if len(body.inputs) != 1 or not match:
        raise InvalidInput(f"expected exactly one input named {expected!r}, got {[t.name for t in body.inputs]}")
    return match[0]


def check_count(args: AppArgs, model: str, n: int) -> None:
    limit = args.deployment_config(model).max_items_per_request
    if n == 0:
        raise InvalidInput("empty batch: the input tensor has no items")
    if n > limit:
        raise InvalidInput(f"{n} items in one request; at most {limit} are allowed")


def urgent(codec: Codec, body: v2.InferRequest, priority: Priority) -> AbstractContextManager[object]:
    """Held while a batched request is handled, from before its input is decoded until its
    outputs are built (its queueing included): work the image decoders yield to when no core is
    free (cpu_priority.MODEL_WORK), not only while its batch is out. Not for a request of encoded
    images, which waits on the decoders itself, nor for low priority, which yields to images of
    any class."""
    if priority == Priority.LOW or codec.decodes_apart(body):
        return nullcontext()
    return MODEL_WORK.held()


class Classifier(Codec):
    """What both classifier families answer: logits, probabilities and the label of each item."""

    def served_io(self, manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        n = len(manifest.labels)
        outputs = [
            TensorMetadata(name="logits", datatype="FP32", shape=[-1, n]),
            TensorMetadata(name="probabilities", datatype="FP32", shape=[-1, n]),
            TensorMetadata(name="label", datatype="BYTES", shape=[-1]),
        ]
        return [self.served_input(manifest)], outputs

    def served_input(self, manifest: Manifest) -> TensorMetadata:
        raise NotImplementedError

    def outputs(self, answer: Any, manifest: Manifest) -> list[v2.ResponseOutput]:
        """(N, C) logits -> logits, probabilities and the label of each item."""
        logits = answer.astype(np.float32, copy=False)
        probs, best = softmax_rows(logits)
        labels = manifest.labels
        return [
            v2.encode("logits", logits),
            v2.encode("probabilities", probs),
            v2.encode("label", [labels[i] for i in best]),
        ]


class TextClassifier(Classifier):
    """BYTES texts in, tokenized in the replica."""

    def served_input(self, manifest: Manifest) -> TensorMetadata:
        return TensorMetadata(name=TEXT_INPUT, datatype="BYTES", shape=[-1])

    async def decode(self, body: v2.InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> list[str]:
        texts = v2.decode_bytes(single_input(body, TEXT_INPUT), args.limits.max_text_chars)
        check_count(args, deployment, len(texts))
        return texts


class ImageClassifier(Classifier):
    """(N, 3, S, S) images in, FP32 in [0, 1] or UINT8, or encoded PNG/JPEG as BYTES."""

    def served_input(self, manifest: Manifest) -> TensorMetadata:
        s = manifest.image_size or 0
        return TensorMetadata(name=IMAGE_INPUT, datatype="FP32", shape=[-1, 3, s, s])

    def decodes_apart(self, body: v2.InferRequest) -> bool:
        return any(t.datatype == "BYTES" for t in body.inputs)

    async def decode(self, body: v2.InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> np.ndarray:
        tensor = single_input(body, IMAGE_INPUT)
        s = manifest.image_size or 0
        if tensor.datatype == "BYTES":
            # Encoded PNG/JPEG, one per element: decoded and resized in the router's decoder processes,
            # sent on as uint8 pixels.
            if len(tensor.shape) != 1:
                raise InvalidInput(f"input 'image' as BYTES (encoded PNG/JPEG) must have shape [N], got {tensor.shape}")
            check_count(args, deployment, tensor.element_count())
            return await DECODERS.decode(v2.decode_raw_bytes(tensor), s, manifest.image.resize)
        if tensor.datatype not in ("FP32", "UINT8"):
            raise InvalidInput(f"input 'image' must be FP32 in [0, 1], UINT8, or BYTES (encoded PNG/JPEG), got {tensor.datatype}")
        if len(tensor.shape) != 4 or tensor.shape[1:] != [3, s, s]:
            raise InvalidInput(f"input 'image' must have shape [N, 3, {s}, {s}], got {tensor.shape}")
        check_count(args, deployment, tensor.shape[0])
        images = v2.decode_numeric(tensor)
        # uint8 travels to the replica as is (4x fewer bytes); it scales to [0, 1] there.
        if images.dtype != np.uint8 and not np.isfinite(images).all():
            raise InvalidInput("input 'image' contains NaN or Inf")
        return images


class TextGenerator(Codec):
    """BYTES prompts in, BYTES texts out, one per prompt (over v2; OpenAI's endpoints and gRPC's
    stream take the same prompts)."""

    def served_io(self, manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        return (
            [TensorMetadata(name=PROMPT_INPUT, datatype="BYTES", shape=[-1])],
            [TensorMetadata(name=GENERATED_OUTPUT, datatype="BYTES", shape=[-1])],
        )

    async def decode(self, body: v2.InferRequest, manifest: Manifest, args: AppArgs, deployment: str) -> list[str]:
        prompts = v2.decode_bytes(single_input(body, PROMPT_INPUT), args.limits.max_text_chars)
        check_count(args, deployment, len(prompts))
        return prompts

    def outputs(self, answer: Any, manifest: Manifest) -> list[v2.ResponseOutput]:
        return [v2.encode(GENERATED_OUTPUT, answer)]


TEXT_CLASSIFIER = TextClassifier()
IMAGE_CLASSIFIER = ImageClassifier()
TEXT_GENERATOR = TextGenerator()
