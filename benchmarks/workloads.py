"""Request mixes for the load generator, built from the project's own test data.

A workload is JSON: weighted streams, each with a path, headers and a list of
request bodies that the load generator cycles through. Bodies are held-out test
items (TEST_SEED), so every setup sees the same inputs; by rule (`v2_infer`) at
least `DISTINCT_INPUTS` of them a stream, with the response cache off
(`Cache-Control: no-cache`): a figure from a few cycled inputs measures the light
tier's luck on them and the cache, not the server.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.manifest import Manifest
from serve_app.protocols.v2 import NUMPY_DTYPES
from serve_app.zoo.data import TEST_SEED, sentiment_dataset, shapes_dataset

DISTINCT_INPUTS = 1000  # held-out inputs a load stream cycles through, at least
NO_CACHE = {"Cache-Control": "no-cache"}


def held_out_texts(n: int) -> tuple[list[str], list[int]]:
    """`n` distinct held-out texts and their labels (the generator repeats a text now and then)."""
    texts, truth = sentiment_dataset(n + n // 8 + 8, TEST_SEED)
    first = {text: i for i, text in reversed(list(enumerate(texts)))}
    keep = sorted(first.values())[:n]
    if len(keep) < n:
        raise ValueError(f"the held-out split has only {len(keep)} distinct texts here, {n} wanted")
    return [texts[i] for i in keep], [int(truth[i]) for i in keep]


def text_bodies(n: int, items_per_request: int = 1) -> list[dict[str, Any]]:
    texts, _ = held_out_texts(n * items_per_request)
    return [
        {
            "inputs": [
                {"name": "text", "shape": [items_per_request], "datatype": "BYTES", "data": texts[i : i + items_per_request]}
            ]
        }
        for i in range(0, len(texts), items_per_request)
    ]


def image_bodies(n: int, size: int = 32, items_per_request: int = 1) -> list[dict[str, Any]]:
    """UINT8 pixels, as cameras and decoders produce them (and 4x smaller JSON than FP32)."""
    images, _ = shapes_dataset(n * items_per_request, TEST_SEED, size)
    pixels = np.round(images * 255).astype(np.uint8)
    return [
        {"inputs": [{"name": "image", "shape": list(b.shape), "datatype": "UINT8", "data": b.ravel().tolist()}]}
        for b in (pixels[i : i + items_per_request] for i in range(0, len(pixels), items_per_request))
    ]


def bodies_for(model_dir: Path, n: int = 64) -> list[dict[str, Any]]:
    """Held-out inputs for the model in `model_dir`, shaped by its manifest."""
    manifest = Manifest.load(model_dir)
    if manifest.family == "resnet":
        return image_bodies(n, manifest.image_size or 32)
    if manifest.family == "bert":
        return text_bodies(n)
    raise ValueError(f"{model_dir}: no classifier workload for family {manifest.family!r}")


def labels_for(model_dir: Path, n: int = 64) -> list[str]:
    """The true label of each of `bodies_for`'s inputs (one item a request), by the model's label names."""
    manifest = Manifest.load(model_dir)
    truth: list[int]
    if manifest.family == "resnet":
        truth = [int(i) for i in shapes_dataset(n, TEST_SEED, manifest.image_size or 32)[1]]
    elif manifest.family == "bert":
        truth = held_out_texts(n)[1]
    else:
        raise ValueError(f"{model_dir}: no labels for family {manifest.family!r}")
    return [manifest.labels[i] for i in truth]


def binary_body(body: dict[str, Any]) -> tuple[bytes, int]:
    """A JSON v2 infer body in the binary tensor extension, as tritonclient sends it: the JSON
    header (every input's `data` replaced by `parameters.binary_data_size`, outputs asked for
    as binary) followed by the raw tensors; and the header's length."""
    blobs, inputs = [], []
    for t in body["inputs"]:
        if t["datatype"] == "BYTES":
            raw = b"".join(struct.pack("<I", len(e)) + e for e in (v.encode() for v in t["data"]))
        else:
            raw = np.asarray(t["data"], dtype=NUMPY_DTYPES[t["datatype"]]).tobytes()
        blobs.append(raw)
        meta = {k: v for k, v in t.items() if k != "data"}
        inputs.append({**meta, "parameters": {**t.get("parameters", {}), "binary_data_size": len(raw)}})
    header = json.dumps(
        {**body, "inputs": inputs, "parameters": {**body.get("parameters", {}), "binary_data_output": True}},
        separators=(",", ":"),
    ).encode()
    return header + b"".join(blobs), len(header)


@dataclass
class StreamSpec:
    name: str
    path: str
    bodies: list[dict[str, Any]]
    weight: float = 1.0
    headers: dict[str, str] = field(default_factory=dict)
    binary: bool = False  # send the bodies in the binary tensor extension
    order: list[int] | None = None  # the order to send bodies in (indices, cycled); None: as listed
    labels: list[str] | None = None  # each body's true label: the load generator scores the answers

    def to_json(self) -> dict[str, Any]:
        if self.binary:
            encoded: list[Any] = []
            for b in self.bodies:
                raw, header_length = binary_body(b)
                encoded.append({"base64": base64.b64encode(raw).decode(), "header_length": header_length})
        else:
            encoded = [json.dumps(b, separators=(",", ":")) for b in self.bodies]
        spec: dict[str, Any] = {
            "name": self.name, "path": self.path, "weight": self.weight, "headers": self.headers, "bodies": encoded,
        }  # fmt: skip
        if self.labels is not None:
            spec["labels"] = self.labels
        return spec if self.order is None else {**spec, "order": self.order}


def v2_infer(
    model: str,
    model_dir: Path,
    priority: str | None = None,
    weight: float = 1.0,
    n: int | None = None,
    binary: bool = False,
    scored: bool = False,
) -> StreamSpec:
    """Inference on `model` (a model or a route) with `n` distinct held-out inputs for the model in
    `model_dir` (default `DISTINCT_INPUTS`, read at the call: a smoke run lowers it), the response
    cache off. `scored`: with the inputs' true labels, so that the load generator scores the answers."""
    n = n or DISTINCT_INPUTS
    headers = {**NO_CACHE, **({"X-Priority": priority} if priority else {})}
    name = f"{model}/{priority}" if priority else model
    labels = labels_for(model_dir, n) if scored else None
    return StreamSpec(name, f"/v2/models/{model}/infer", bodies_for(model_dir, n), weight, headers, binary, labels=labels)


def write(streams: list[StreamSpec], path: Path) -> Path:
    path.write_text(json.dumps({"streams": [s.to_json() for s in streams]}))
    return path
