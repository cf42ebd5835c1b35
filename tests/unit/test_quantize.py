"""INT8 and FP16 variants of the tiny classifiers: built beside the FP32 graph with ONNX Runtime's
own quantization, checked against it, recorded in the manifest, picked by the `precision` option;
a variant that loses too much accuracy is refused; `models build` builds what a config asks for."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from serve_app.config import AppArgs
from serve_app.manifest import Manifest
from serve_app.tools import catalog_build
from serve_app.zoo import quantize
from serve_app.zoo.data import TEST_SEED
from serve_app.zoo.evaluate import classifier_logits


@pytest.fixture
def models(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # The tiny models train for seconds and sit near chance, where the rounding of INT8 kernels
    # (which differ between CPUs) flips labels at random: half a point of accuracy is noise here.
    # The guard itself has its own test; label agreement is asserted below.
    monkeypatch.setattr(quantize, "MAX_ACCURACY_DROP", 0.05)
    for name in ("bert-light", "resnet-light", "gpt"):
        shutil.copytree(tiny_model_dir / name, tmp_path / name)
    return tmp_path


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_int8_text_model_is_dynamically_quantized_and_agrees_with_fp32(models: Path):
    report = quantize.build_variant(models / "bert-light", "int8")
    manifest = Manifest.load(models / "bert-light")
    assert manifest.variants["int8"] == report and report["file"] == "model.int8.onnx"
    assert "DynamicQuantizeLinear" in _ops(models / "bert-light" / "model.int8.onnx")
    assert report["size_bytes"] < report["fp32_size_bytes"]
    assert report["label_agreement"]["test"] > 0.9
    # What the manifest says is what the graph gives.
    got, _ = classifier_logits(models / "bert-light", 200, TEST_SEED, precision="int8")
    ref, _ = classifier_logits(models / "bert-light", 200, TEST_SEED)
    assert not np.array_equal(got, ref) and np.abs(got - ref).max() <= report["max_abs_logit_diff"]
    assert set(report["accuracy"]) == {"val", "test"}


def test_int8_image_model_is_statically_quantized_per_channel(models: Path):
    report = quantize.build_variant(models / "resnet-light", "int8")
    ops = _ops(models / "resnet-light" / "model.int8.onnx")
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert report["method"].startswith("static") and report["calibration_images"] == quantize.CALIBRATION_SIZE
    assert report["label_agreement"]["test"] > 0.8


def test_fp16_keeps_fp32_inputs_and_outputs(models: Path):
    report = quantize.build_variant(models / "bert-light", "fp16")
    graph = onnx.load(str(models / "bert-light" / "model.fp16.onnx")).graph
    out_type = graph.output[0].type.tensor_type.elem_type
    assert out_type == onnx.TensorProto.FLOAT
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in graph.initializer)
    assert report["max_abs_logit_diff"] < 0.05


def test_a_variant_that_loses_accuracy_is_not_written(models: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(quantize, "MAX_ACCURACY_DROP", -1.0)  # any variant now "loses" accuracy
    with pytest.raises(quantize.QuantizationError, match="below FP32"):
        quantize.build_variant(models / "bert-light", "int8")
    assert not (models / "bert-light" / "model.int8.onnx").exists()
    assert "int8" not in Manifest.load(models / "bert-light").variants
    assert sorted(p.name for p in (models / "bert-light").iterdir() if p.is_dir()) == []  # no scratch left


def test_generators_have_no_variant(models: Path):
    with pytest.raises(quantize.QuantizationError, match="classifiers"):
        quantize.build_variant(models / "gpt", "int8")


def test_serving_an_unbuilt_variant_says_how_to_build_it(models: Path):
    with pytest.raises(FileNotFoundError, match="models build"):
        Manifest.load(models / "bert-light").onnx_file_for("int8")


def test_models_build_adds_the_variant_a_config_asks_for_without_retraining(models: Path):
    args = AppArgs.model_validate(
        {"model_dir": str(models), "models": {"bert-light": {"preset": "bert-tiny", "precision": "int8"}}}
    )
    trained = (models / "bert-light" / "model.onnx").stat().st_mtime_ns
    [step] = catalog_build.plan(args)
    assert step.built and not step.variant_built and step.precision == "int8"
    logged: list[str] = []
    assert catalog_build.build_missing(args, log=logged.append) == ["bert-light"]
    assert (models / "bert-light" / "model.onnx").stat().st_mtime_ns == trained
    assert "int8 variant (dynamic)" in logged[0]
    assert catalog_build.plan(args)[0].variant_built
    assert catalog_build.build_missing(args, log=logged.append) == []


def test_a_route_with_a_quantized_light_tier_is_calibrated_as_served(models: Path):
    from serve_app.tools.catalog_calibrate import calibrate_route, needs_calibration

    shutil.copytree(models / "bert-light", models / "bert-heavy")
    catalog = {
        "bert-light": {"preset": "bert-tiny", "precision": "int8"},
        "bert-heavy": {"preset": "bert-tiny"},
    }
    args = AppArgs.model_validate(
        {"model_dir": str(models), "models": catalog, "routes": {"text": {"light": "bert-light", "heavy": "bert-heavy"}}}
    )
    catalog_build.build_missing(args, log=lambda _: None)
    assert needs_calibration(args, "text")
    record = calibrate_route(args, "text", n=200)
    assert record["precisions"] == {"light": "int8", "heavy": "fp32"}
    assert not needs_calibration(args, "text")
    # Served in FP32 again: the threshold was fitted to the INT8 light model's confidences.
    fp32 = AppArgs.model_validate({**args.model_dump(), "models": {**catalog, "bert-light": {"preset": "bert-tiny"}}})
    assert needs_calibration(fp32, "text")


def test_a_route_of_your_own_models_is_calibrated_on_your_data_only(models: Path, tmp_path: Path):
    from serve_app.tools.catalog_calibrate import calibrate_missing, calibrate_route, describe
    from serve_app.zoo.data import sentiment_dataset

    catalog = {
        "mine-light": {"path": str(models / "bert-light"), "family": "bert"},
        "mine-heavy": {"path": str(models / "bert-light"), "family": "bert"},
    }
    args = AppArgs.model_validate({"models": catalog, "routes": {"mine": {"light": "mine-light", "heavy": "mine-heavy"}}})
    logged: list[str] = []
    assert calibrate_missing(args, log=logged.append) == []
    assert "not calibrated" in logged[0] and "--data" in logged[0]
    with pytest.raises(ValueError, match="not demo presets"):
        calibrate_route(args, "mine")
    texts, labels = sentiment_dataset(200, seed=99)
    data = tmp_path / "mine.npz"
    np.savez(data, inputs=np.array(texts), labels=np.array(labels))
    record = calibrate_route(args, "mine", data=data)
    assert record["data"] == str(data) and record["test"]["n"] == 100
    assert f"(on {data})" in describe(record)
