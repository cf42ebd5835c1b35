"""How each model family looks on the wire: served inputs/outputs and Triton config."""

from __future__ import annotations

from typing import Any

from serve_app.manifest import Manifest
from serve_app.protocols.v2 import ModelMetadata, TensorMetadata

TEXT_INPUT = "text"
IMAGE_INPUT = "image"
PROMPT_INPUT = "text_input"
GENERATED_OUTPUT = "text_output"
CLASSIFIER_OUTPUTS = ("logits", "probabilities", "label")


def served_io(manifest: Manifest) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
    """The tensors clients send and get, which differ from the ONNX graph's:
    text models tokenize server-side, classifiers add probabilities and labels."""
    n = len(manifest.labels)
    if manifest.family == "gpt":
        return (
            [TensorMetadata(name=PROMPT_INPUT, datatype="BYTES", shape=[-1])],
            [TensorMetadata(name=GENERATED_OUTPUT, datatype="BYTES", shape=[-1])],
        )
    outputs = [
        TensorMetadata(name="logits", datatype="FP32", shape=[-1, n]),
        TensorMetadata(name="probabilities", datatype="FP32", shape=[-1, n]),
        TensorMetadata(name="label", datatype="BYTES", shape=[-1]),
    ]
    if manifest.family == "bert":
        return [TensorMetadata(name=TEXT_INPUT, datatype="BYTES", shape=[-1])], outputs
    s = manifest.image_size or 0
    return [TensorMetadata(name=IMAGE_INPUT, datatype="FP32", shape=[-1, 3, s, s])], outputs


def model_metadata(name: str, manifest: Manifest, platform: str = "onnxruntime_onnx") -> ModelMetadata:
    inputs, outputs = served_io(manifest)
    return ModelMetadata(name=name, versions=[manifest.version], platform=platform, inputs=inputs, outputs=outputs)


def triton_config(name: str, manifest: Manifest, max_batch_size: int, platform: str = "onnxruntime_onnx") -> dict[str, Any]:
    """Triton's model config subset that its client tools read; dims exclude the batch axis."""
    inputs, outputs = served_io(manifest)

    def dims(t: TensorMetadata) -> dict[str, Any]:
        return {
            "name": t.name,
            "data_type": f"TYPE_{'STRING' if t.datatype == 'BYTES' else t.datatype}",
            "dims": t.shape[1:] or [1],
        }

    return {
        "name": name,
        "platform": platform,
        "backend": "onnxruntime",
        "max_batch_size": max_batch_size,
        "input": [dims(t) for t in inputs],
        "output": [dims(t) for t in outputs],
    }
