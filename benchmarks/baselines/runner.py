"""The model work every baseline shares, written the way tutorials write it.

Plain dicts from `json.loads`, no schema validation, no error shapes: the
baselines pay only for parsing, tokenizing, the ONNX Runtime call and the
response, so a gap between them and ours is the cost of what ours adds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from serve_app.manifest import Manifest
from serve_app.models.runtime import select_providers, with_options
from serve_app.padding import pad_right
from serve_app.tokenization import TextTokenizer


def baseline_session(path: Path, threads: int, gpu_ids: list[str] | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session as every baseline opens one: `threads` intra-op threads, on CUDA
    when `gpu_ids` are given (and onnxruntime-gpu can), as ours does on a GPU replica."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=with_options(select_providers(gpu_ids or [])))


class ModelRunner:
    def __init__(self, model_dir: str | Path, threads: int, gpu_ids: list[str] | None = None) -> None:
        """`gpu_ids`: run on CUDA when given (and onnxruntime-gpu can), as ours does on a GPU replica."""
        self.model_dir = Path(model_dir)
        self.manifest = Manifest.load(self.model_dir)
        self.session = baseline_session(self.model_dir / self.manifest.onnx_file, threads, gpu_ids)
        self.providers = self.session.get_providers()
        self.text = self.manifest.family == "bert"
        self.tokenizer = None
        if self.text:
            self.tokenizer = TextTokenizer.for_model(self.model_dir, self.manifest, truncate=True)
        self.max_len = self.manifest.max_sequence_length or 512

    def decode_binary(self, raw: bytes, header_length: int) -> list[Any]:
        """A body in the binary tensor extension (a JSON header, then each input's raw bytes, as
        tritonclient sends it) -> its items, as `decode` gives them."""
        header = json.loads(raw[:header_length])
        tensor = header["inputs"][0]
        data = raw[header_length : header_length + tensor["parameters"]["binary_data_size"]]
        if tensor["datatype"] == "BYTES":
            texts, at = [], 0
            while at < len(data):
                (n,) = struct.unpack_from("<I", data, at)
                texts.append(data[at + 4 : at + 4 + n].decode())
                at += 4 + n
            return self.decode({"inputs": [{**tensor, "data": texts}]})
        uint8 = tensor["datatype"] == "UINT8"
        pixels: np.ndarray = np.frombuffer(data, dtype=np.uint8 if uint8 else np.float32).reshape(tensor["shape"])
        return list(pixels.astype(np.float32) / np.float32(255.0) if uint8 else pixels.astype(np.float32))

    def decode(self, body: dict[str, Any]) -> list[Any]:
        """A v2 JSON body -> its items (token id lists, or (3, H, W) arrays)."""
        tensor = body["inputs"][0]
        if self.text:
            assert self.tokenizer is not None
            return self.tokenizer.encode_rows(tensor["data"])
        pixels = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        return list(pixels / 255.0 if tensor["datatype"] == "UINT8" else pixels)

    def run(self, items: list[Any]) -> np.ndarray:
        """The model's logits, fed as the model's graph wants (the same encoding ours does)."""
        outputs = [self.manifest.outputs[0].name]
        if self.text:
            assert self.tokenizer is not None
            ids, mask = pad_right(items, self.tokenizer.pad_id)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self.manifest.input_names:
                feeds["token_type_ids"] = np.zeros_like(ids)
            return self.session.run(outputs, feeds)[0]
        images = np.stack(items).astype(np.float32, copy=False)
        if self.manifest.image.normalizes:
            spec = self.manifest.image
            images = (images - np.reshape(spec.mean, (1, 3, 1, 1))) / np.reshape(spec.std, (1, 3, 1, 1))
        return self.session.run(outputs, {self.manifest.inputs[0].name: images.astype(np.float32)})[0]

    def respond(self, name: str, logits: np.ndarray) -> dict[str, Any]:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        labels = [self.manifest.labels[i] for i in probs.argmax(axis=1)]
        return {
            "model_name": name,
            "outputs": [
                {"name": "probabilities", "shape": list(probs.shape), "datatype": "FP32", "data": probs.ravel().tolist()},
                {"name": "label", "shape": [len(labels)], "datatype": "BYTES", "data": labels},
            ],
        }
