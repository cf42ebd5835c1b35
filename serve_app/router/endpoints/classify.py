"""Classification over Open Inference Protocol v2: inputs checked and decoded, outputs built."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from serve_app.config import AppArgs
from serve_app.contract import Priority
from serve_app.errors import InvalidInput
from serve_app.manifest import Manifest
from serve_app.process.cpu_priority import MODEL_WORK
from serve_app.protocols import v2
from serve_app.protocols.decoders import DECODERS
from serve_app.router.routing import catalog
from serve_app.router.routing.cascade import ClassifierResult, Payload


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


def carries_encoded_images(manifest: Manifest, body: v2.InferRequest) -> bool:
    """Whether the request's images are PNG/JPEG, for the router's decoder processes."""
    return manifest.family != "bert" and any(t.datatype == "BYTES" for t in body.inputs)


def urgent(manifest: Manifest, body: v2.InferRequest, priority: Priority) -> AbstractContextManager[object]:
    """Held while a classification is handled, from before its input is decoded until its outputs
    are built (its queueing included): work the image decoders yield to when no core is free
    (cpu_priority.MODEL_WORK), not only while its batch is out. Not for a request of encoded
    images, which waits on the decoders itself, nor for low priority, which yields to images of
    any class."""
    if priority == Priority.LOW or carries_encoded_images(manifest, body):
        return nullcontext()
    return MODEL_WORK.held()


async def decode_input(args: AppArgs, model: str, manifest: Manifest, body: v2.InferRequest) -> Payload:
    """Texts for a text model; (N, 3, H, W) images for an image model."""
    if manifest.family == "bert":
        texts = v2.decode_bytes(single_input(body, catalog.TEXT_INPUT), args.limits.max_text_chars)
        check_count(args, model, len(texts))
        return texts
    tensor = single_input(body, catalog.IMAGE_INPUT)
    s = manifest.image_size or 0
    if tensor.datatype == "BYTES":
        # Encoded PNG/JPEG, one per element: decoded and resized in the router's decoder processes,
        # sent on as uint8 pixels.
        if len(tensor.shape) != 1:
            raise InvalidInput(f"input 'image' as BYTES (encoded PNG/JPEG) must have shape [N], got {tensor.shape}")
        check_count(args, model, tensor.element_count())
        return await DECODERS.decode(v2.decode_raw_bytes(tensor), s, manifest.image.resize)
    if tensor.datatype not in ("FP32", "UINT8"):
        raise InvalidInput(f"input 'image' must be FP32 in [0, 1], UINT8, or BYTES (encoded PNG/JPEG), got {tensor.datatype}")
    if len(tensor.shape) != 4 or tensor.shape[1:] != [3, s, s]:
        raise InvalidInput(f"input 'image' must have shape [N, 3, {s}, {s}], got {tensor.shape}")
    check_count(args, model, tensor.shape[0])
    images = v2.decode_numeric(tensor)
    # uint8 travels to the replica as is (4x fewer bytes); it scales to [0, 1] there.
    if images.dtype != np.uint8 and not np.isfinite(images).all():
        raise InvalidInput("input 'image' contains NaN or Inf")
    return images


# Up to this many logits in an answer, its softmax runs on Python floats: numpy's cost per call is
# fixed, and on the one-row answers that most requests get it is most of the work.
SMALL_ANSWER = 64


def outputs(result: ClassifierResult, labels: list[str]) -> list[v2.ResponseOutput]:
    """logits, probabilities and the label of each item."""
    logits = result.logits.astype(np.float32, copy=False)
    probs, best = softmax_rows(logits)
    return [
        v2.encode("logits", logits),
        v2.encode("probabilities", probs),
        v2.encode("label", [labels[i] for i in best]),
    ]


def softmax_rows(logits: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(N, C) float32 logits -> their softmax in float32, and each row's most probable class."""
    table = logits.tolist() if logits.size <= SMALL_ANSWER else None
    # NaN or an infinity (a sum is finite only when every value is) takes numpy's path, which
    # answers them as before.
    if table is not None and all(math.isfinite(sum(row)) for row in table):
        rows, best = [], []
        for row in table:
            top = max(row)
            e = [math.exp(v - top) for v in row]
            total = sum(e)
            rows.append([v / total for v in e])
            best.append(row.index(top))  # exp is monotonic: the top logit is the top probability
        return np.array(rows, dtype=np.float32).reshape(logits.shape), best
    # The softmax in place, in the answer's float32: every temporary saved counts.
    probs = logits - logits.max(axis=1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs, probs.argmax(axis=1).tolist()
