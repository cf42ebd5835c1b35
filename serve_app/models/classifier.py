"""Classifier deployments: BERT-style text and ResNet-style image models.

A batch returns exactly one result per request; a request that fails
validation fails alone (its slot holds the exception) while the rest run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from ray import serve

from serve_app.errors import InvalidInput, ServeAppError
from serve_app.models.base import OnnxModel
from serve_app.models.batching import length_buckets, pad_right
from serve_app.tokenization import TextTokenizer


def _raise_if_error(result: np.ndarray | ServeAppError) -> np.ndarray:
    if isinstance(result, ServeAppError):
        raise result
    return result


@serve.deployment(max_ongoing_requests=64)
class TextClassifier(OnnxModel):
    """BYTES text in, (N, C) logits out; tokenizes server-side, pads per length bucket."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        self.tokenizer: TextTokenizer | None = None
        super().__init__(name, model_path, config)

    def warm_up(self) -> None:
        assert self.manifest.tokenizer_file, f"{self.name}: text model manifest names no tokenizer"
        self.tokenizer = TextTokenizer.from_file(self.model_dir / self.manifest.tokenizer_file)
        self._forward([[self.tokenizer.pad_id]])

    @property
    def max_len(self) -> int:
        return self.manifest.max_sequence_length or 512

    def _forward(self, seqs: list[list[int]]) -> np.ndarray:
        assert self.tokenizer is not None
        ids, mask = pad_right(seqs, self.tokenizer.pad_id)
        (logits,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
        return logits

    def _encode(self, texts: list[str]) -> list[list[int]]:
        assert self.tokenizer is not None
        if not texts:
            raise InvalidInput("empty batch: send at least one text")
        if not all(isinstance(t, str) for t in texts):
            raise InvalidInput("text inputs must be strings")
        # Truncate like BERT tokenizers do; an empty text still gets one (pad) token.
        return [ids[: self.max_len] or [self.tokenizer.pad_id] for ids in self.tokenizer.encode_batch(texts)]

    async def classify(self, texts: list[str]) -> np.ndarray:
        return _raise_if_error(await self._run_batch(texts))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _run_batch(self, requests: list[list[str]]) -> list[np.ndarray | ServeAppError]:
        results: list[np.ndarray | ServeAppError] = []
        seqs: list[list[int]] = []
        owners: list[int] = []  # request index of each flattened sequence
        for r, texts in enumerate(requests):
            try:
                encoded = self._encode(texts)
            except ServeAppError as e:
                results.append(e)
                continue
            results.append(np.empty(0))
            seqs.extend(encoded)
            owners.extend([r] * len(encoded))
        if seqs:
            started = time.perf_counter()
            logits = await asyncio.to_thread(self._bucketed_forward, seqs)
            self.record_batch(len(seqs), started)
            owner_arr = np.array(owners)
            for r, res in enumerate(results):
                if not isinstance(res, ServeAppError):
                    results[r] = logits[owner_arr == r]
        return results

    def _bucketed_forward(self, seqs: list[list[int]]) -> np.ndarray:
        out: np.ndarray | None = None
        for bucket in length_buckets([len(s) for s in seqs]):
            logits = self._forward([seqs[i] for i in bucket])
            if out is None:
                out = np.empty((len(seqs), logits.shape[1]), dtype=logits.dtype)
            out[bucket] = logits
        assert out is not None, "at least one bucket"
        return out


@serve.deployment(max_ongoing_requests=64)
class ImageClassifier(OnnxModel):
    """(N, 3, H, W) float32 pixels in [0, 1] in, (N, C) logits out."""

    def warm_up(self) -> None:
        s = self.manifest.image_size or 32
        self.session.run(None, {"image": np.zeros((1, 3, s, s), dtype=np.float32)})

    def _validate(self, images: Any) -> np.ndarray:
        s = self.manifest.image_size
        if not isinstance(images, np.ndarray) or images.ndim != 4 or images.shape[1:] != (3, s, s):
            shape = getattr(images, "shape", None)
            raise InvalidInput(f"image must be a float32 tensor of shape [N, 3, {s}, {s}], got {shape}")
        if images.shape[0] == 0:
            raise InvalidInput("empty batch: send at least one image")
        if not np.isfinite(images).all():
            raise InvalidInput("image contains NaN or Inf")
        return images.astype(np.float32, copy=False)

    async def classify(self, images: np.ndarray) -> np.ndarray:
        return _raise_if_error(await self._run_batch(images))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _run_batch(self, requests: list[np.ndarray]) -> list[np.ndarray | ServeAppError]:
        results: list[np.ndarray | ServeAppError] = []
        valid: list[np.ndarray] = []
        for images in requests:
            try:
                valid.append(self._validate(images))
                results.append(np.empty(0))
            except ServeAppError as e:
                results.append(e)
        if valid:
            started = time.perf_counter()
            batch = np.concatenate(valid)
            (logits,) = await asyncio.to_thread(self.session.run, None, {"image": batch})
            self.record_batch(len(batch), started)
            splits = np.split(logits, np.cumsum([len(v) for v in valid])[:-1])
            it = iter(splits)
            results = [r if isinstance(r, ServeAppError) else next(it) for r in results]
        return results
