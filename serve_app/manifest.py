"""The manifest that travels with every exported model directory.

Serving reads only this file, the ONNX graph and the tokenizer: never torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from serve_app.families import FamilyName

MANIFEST_FILE = "manifest.json"

Datatype = Literal["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"]


class TensorSpec(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="-1 marks a dynamic axis")


class GenerationSpec(BaseModel):
    """Shapes of a decoder's KV cache, in the layout Hugging Face exports (optimum) use: inputs
    `past_key_values.{i}.key` / `.value` of shape (B, n_heads, P, head_dim) per layer, outputs
    `present.{i}.key` / `.value` with the new positions appended. `n_heads` counts key/value heads
    (fewer than the query heads in grouped-query attention)."""

    n_layers: int
    n_heads: int
    head_dim: int
    block_size: int
    kv_dtype: Literal["float32", "float16"] = "float32"


class ImageSpec(BaseModel):
    """How pixels become the graph's input: scaled to [0, 1], then (x - mean) / std per channel.
    `resize`: an encoded image's shorter side is resized to this, then its centre cropped to the
    model's size (torchvision's Resize + CenterCrop); None stretches it to the size."""

    mean: list[float] = Field(default_factory=lambda: [0.0, 0.0, 0.0], min_length=3, max_length=3)
    std: list[float] = Field(default_factory=lambda: [1.0, 1.0, 1.0], min_length=3, max_length=3)
    resize: int | None = None

    @property
    def normalizes(self) -> bool:
        return any(self.mean) or any(s != 1.0 for s in self.std)


class Manifest(BaseModel):
    name: str
    family: FamilyName
    version: str = "1"
    onnx_file: str = "model.onnx"
    tokenizer_file: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    labels: list[str] = Field(default_factory=list)
    max_sequence_length: int | None = None
    image_size: int | None = None
    image: ImageSpec = Field(default_factory=ImageSpec)
    # The tokenizer's padding and end-of-sequence tokens; a classifier needs only the first.
    pad_token: str | None = "<pad>"
    eos_token: str | None = "<eos>"
    generation: GenerationSpec | None = None
    # Where the weights came from: preset, training figures, parity, fingerprint.
    source: dict[str, Any] = Field(default_factory=dict)
    # Cascade thresholds fitted with this model as the light tier, by heavy model name
    # (`serve-app calibrate`): signal, threshold, target, and the held-out scores.
    calibrations: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Lower-precision graphs beside the FP32 one, by precision (int8, fp16): file, method, and
    # how they compare with FP32 on held-out data (serve_app.zoo.quantize).
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def onnx_file_for(self, precision: str) -> str:
        """The graph to load for `precision`; fp32 is the model's own."""
        if precision == "fp32":
            return self.onnx_file
        if precision not in self.variants:
            raise FileNotFoundError(
                f"{self.name} has no {precision} variant; run `serve-app models build` for a config that asks for it"
            )
        return str(self.variants[precision]["file"])

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @classmethod
    def load(cls, model_dir: str | Path) -> Manifest:
        """The manifest file a build or an import wrote (`serve_app.exports.discover` also reads
        exports that have none)."""
        path = Path(model_dir) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST_FILE} in {model_dir}")
        return cls.model_validate_json(path.read_text())

    def save(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / MANIFEST_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        tmp.replace(path)  # atomic: a half-written manifest never looks like a finished build
