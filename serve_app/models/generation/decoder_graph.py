"""A decoder's ONNX graph as the scheduler calls it: ids, positions, mask and past in; logits and
present out, by the input and output names Hugging Face exports use (serve_app.models.generation.kv_cache).
Our demo GPT is exported with the same names, so every decoder runs through this one path."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from serve_app.manifest import GenerationSpec
from serve_app.models.generation.kv_cache import CacheShape, Past, past_names, present_names


class DecoderGraph:
    def __init__(self, session: ort.InferenceSession, spec: GenerationSpec) -> None:
        self.session = session
        self.shape = CacheShape(spec.n_layers, spec.n_heads, spec.head_dim, spec.block_size, spec.kv_dtype)
        self._past = past_names(spec.n_layers)
        self._outputs = ["logits", *present_names(spec.n_layers)]

    def empty_past(self, batch: int) -> Past:
        return self.shape.empty_past(batch)

    def __call__(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: Past) -> tuple[np.ndarray, Past]:
        """(B, T, V) logits and the present: each layer's past with the T new positions appended."""
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, **dict(zip(self._past, past, strict=True))}
        logits, *present = self.session.run(self._outputs, feeds)
        return logits, present
