"""Classifier logits on generated, labelled data, through ONNX Runtime (no torch, no Ray):
what `serve-app calibrate` fits and checks cascade thresholds on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from serve_app.manifest import Manifest
from serve_app.padding import pad_right
from serve_app.tokenization import TextTokenizer
from serve_app.zoo.data import sentiment_dataset, shapes_dataset

CHUNK = 64


def classifier_logits(
    model_dir: Path, n: int, seed: int, onnx_path: Path | None = None, precision: str = "fp32"
) -> tuple[np.ndarray, np.ndarray]:
    """(N, C) logits and (N,) labels for `n` generated items of this model's task, from the
    directory's graph of that precision, or from `onnx_path` when given."""
    manifest = Manifest.load(model_dir)
    path = onnx_path or model_dir / manifest.onnx_file_for(precision)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if manifest.family == "bert":
        texts, labels = sentiment_dataset(n, seed)
        tok = TextTokenizer.for_model(model_dir, manifest, truncate=True)
        seqs = tok.encode_rows(texts)
        parts = []
        for i in range(0, n, CHUNK):
            ids, mask = pad_right(seqs[i : i + CHUNK], tok.pad_id)
            parts.append(session.run(None, {"input_ids": ids, "attention_mask": mask})[0])
        return np.concatenate(parts), np.asarray(labels)
    if manifest.family == "resnet":
        images, labels = shapes_dataset(n, seed, manifest.image_size or 32)
        parts = [session.run(None, {"image": images[i : i + CHUNK].astype(np.float32)})[0] for i in range(0, n, CHUNK)]
        return np.concatenate(parts), np.asarray(labels)
    raise ValueError(f"{model_dir}: {manifest.family} is not a classifier")
