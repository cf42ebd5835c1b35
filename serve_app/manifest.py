"""The manifest that travels with every exported model directory.

Serving reads only this file, the ONNX graph and the tokenizer: never torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

MANIFEST_FILE = "manifest.json"

Datatype = Literal["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"]


class TensorSpec(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="-1 marks a dynamic axis")


class GenerationSpec(BaseModel):
    """Shapes of a decoder's KV cache: past is (n_layers, 2, B, n_heads, P, head_dim)."""

    n_layers: int
    n_heads: int
    head_dim: int
    block_size: int


class Manifest(BaseModel):
    name: str
    family: Literal["bert", "gpt", "resnet"]
    version: str = "1"
    onnx_file: str = "model.onnx"
    tokenizer_file: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    labels: list[str] = Field(default_factory=list)
    max_sequence_length: int | None = None
    image_size: int | None = None
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

    @classmethod
    def load(cls, model_dir: str | Path) -> Manifest:
        path = Path(model_dir) / MANIFEST_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST_FILE} in {model_dir}; run `serve-app models build` first")
        return cls.model_validate_json(path.read_text())

    def save(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / MANIFEST_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        tmp.replace(path)  # atomic: a half-written manifest never looks like a finished build
