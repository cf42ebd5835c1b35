"""Lower-precision variants of a built classifier, beside its FP32 graph in the model directory:
INT8 for CPUs with ONNX Runtime's quantization (dynamic for the transformer, whose activations
vary with the input; static QDQ with calibration images for the CNN, per channel), and FP16 for
GPUs (inputs and outputs kept FP32, so clients see no difference).

A variant is checked against the FP32 graph when it is built: logits' largest difference and
label agreement on held-out data, and for trained models the accuracy on the validation and test
splits. A variant that loses more than `MAX_ACCURACY_DROP` on either split is not written.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serve_app.manifest import Manifest
from serve_app.zoo.data import TEST_SEED, VAL_SEED, shapes_dataset
from serve_app.zoo.evaluate import classifier_logits

Precision = Literal["fp32", "int8", "fp16"]
LOWER: tuple[Precision, ...] = ("int8", "fp16")
MAX_ACCURACY_DROP = 0.005  # half a point on either held-out split
EVAL_SIZE = 2000
CALIBRATION_SEED = 11  # none of the training, validation or test draws
CALIBRATION_SIZE = 512


class QuantizationError(ValueError):
    """A variant lost more accuracy than allowed, or the family has no such variant."""


def variant_file(precision: Precision) -> str:
    return f"model.{precision}.onnx"


def _int8(manifest: Manifest, src: Path, dst: Path, scratch: Path) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = scratch / "prepared.onnx"
    quant_pre_process(str(src), str(prepared), skip_symbolic_shape=manifest.family != "bert")
    if manifest.family == "bert":
        quantize_dynamic(str(prepared), str(dst), weight_type=QuantType.QInt8)
        return {"method": "dynamic", "weights": "int8", "activations": "uint8, range per batch"}
    if manifest.family == "resnet":
        images, _ = shapes_dataset(CALIBRATION_SIZE, CALIBRATION_SEED, manifest.image_size or 32)

        class Images(CalibrationDataReader):  # type: ignore[misc]
            def __init__(self) -> None:
                self.batches = iter([{"image": images[i : i + 32].astype(np.float32)} for i in range(0, len(images), 32)])

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.batches, None)

        quantize_static(
            str(prepared),
            str(dst),
            Images(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        return {"method": "static QDQ, per channel", "calibration_images": CALIBRATION_SIZE}
    raise QuantizationError(f"{manifest.name}: no INT8 variant for the {manifest.family} family (classifiers only)")


def _fp16(manifest: Manifest, src: Path, dst: Path) -> dict[str, Any]:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save(model, str(dst))
    return {"method": "float16 weights and arithmetic, FP32 inputs and outputs"}


def compare(model_dir: Path, variant: Path, trained: bool, n: int = EVAL_SIZE) -> dict[str, Any]:
    """The variant against the directory's FP32 graph on the held-out splits."""
    out: dict[str, Any] = {}
    for split, seed in (("val", VAL_SEED), ("test", TEST_SEED)):
        ref, labels = classifier_logits(model_dir, n, seed)
        got, _ = classifier_logits(model_dir, n, seed, onnx_path=variant)
        out.setdefault("max_abs_logit_diff", 0.0)
        out["max_abs_logit_diff"] = max(out["max_abs_logit_diff"], float(np.abs(ref - got).max()))
        out.setdefault("label_agreement", {})[split] = float((ref.argmax(1) == got.argmax(1)).mean())
        if trained:
            out.setdefault("accuracy", {})[split] = float((got.argmax(1) == labels).mean())
            out.setdefault("fp32_accuracy", {})[split] = float((ref.argmax(1) == labels).mean())
    return out


def build_variant(model_dir: Path, precision: Precision) -> dict[str, Any]:
    """Write `model.<precision>.onnx` beside the FP32 graph, checked; returns what the manifest records."""
    manifest = Manifest.load(model_dir)
    if manifest.family not in ("bert", "resnet"):
        raise QuantizationError(f"{manifest.name}: precision variants are built for classifiers (bert, resnet) only")
    src = model_dir / manifest.onnx_file
    dst = model_dir / variant_file(precision)
    with tempfile.TemporaryDirectory(dir=model_dir) as scratch_name:
        scratch = Path(scratch_name)
        candidate = scratch / dst.name
        how = _int8(manifest, src, candidate, scratch) if precision == "int8" else _fp16(manifest, src, candidate)
        trained = bool(manifest.source.get("trained"))
        report = {"file": dst.name, **how, **compare(model_dir, candidate, trained)}
        report["size_bytes"], report["fp32_size_bytes"] = candidate.stat().st_size, src.stat().st_size
        if trained:
            for split, acc in report["accuracy"].items():
                drop = report["fp32_accuracy"][split] - acc
                if drop > MAX_ACCURACY_DROP:
                    raise QuantizationError(
                        f"{manifest.name} {precision}: {split} accuracy {acc:.4f} is {drop * 100:.2f} points below FP32 "
                        f"(at most {MAX_ACCURACY_DROP * 100:.1f} allowed)"
                    )
        candidate.replace(dst)
    manifest.variants[precision] = report
    manifest.save(model_dir)
    return report
