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


def labelled_logits(model_dir: Path, data: Path, precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """(N, C) logits and (N,) labels for a user's labelled data: an .npz of `inputs` (texts, or
    (N, 3, H, W) images in [0, 1]) and `labels` (class indices in the model's label order)."""
    manifest = Manifest.load(model_dir)
    with np.load(data, allow_pickle=False) as npz:
        inputs, labels = npz["inputs"], npz["labels"].astype(np.int64)
    texts = [str(t) for t in inputs] if manifest.family == "bert" else inputs
    return _logits(model_dir, manifest, model_dir / manifest.onnx_file_for(precision), texts), labels


def classifier_logits(
    model_dir: Path, n: int, seed: int, onnx_path: Path | None = None, precision: str = "fp32"
) -> tuple[np.ndarray, np.ndarray]:
    """(N, C) logits and (N,) labels for `n` generated items of this model's task, from the
    directory's graph of that precision, or from `onnx_path` when given."""
    manifest = Manifest.load(model_dir)
    path = onnx_path or model_dir / manifest.onnx_file_for(precision)
    if manifest.family == "bert":
        texts, labels = sentiment_dataset(n, seed)
        return _logits(model_dir, manifest, path, texts), np.asarray(labels)
    if manifest.family == "resnet":
        images, labels = shapes_dataset(n, seed, manifest.image_size or 32)
        return _logits(model_dir, manifest, path, images), np.asarray(labels)
    raise ValueError(f"{model_dir}: {manifest.family} is not a classifier")


def _logits(model_dir: Path, manifest: Manifest, graph: Path, inputs: list[str] | np.ndarray) -> np.ndarray:
    """(N, C) logits of texts (a text classifier) or (N, 3, H, W) images (an image classifier), in chunks."""
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    parts = []
    if manifest.family == "bert":
        tok = TextTokenizer.for_model(model_dir, manifest, truncate=True)
        seqs = tok.encode_rows(list(inputs))
        for i in range(0, len(seqs), CHUNK):
            ids, mask = pad_right(seqs[i : i + CHUNK], tok.pad_id)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in manifest.input_names:  # BERT exports take segment ids; a text is segment 0
                feeds["token_type_ids"] = np.zeros_like(ids)
            parts.append(session.run(None, feeds)[0])
    elif manifest.family == "resnet":
        name, images = manifest.inputs[0].name, np.asarray(inputs, dtype=np.float32)
        parts = [session.run(None, {name: images[i : i + CHUNK]})[0] for i in range(0, len(images), CHUNK)]
    else:
        raise ValueError(f"{model_dir}: {manifest.family} is not a classifier")
    return np.concatenate(parts)
