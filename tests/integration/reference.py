"""What the served answers must equal: the same ONNX files run directly, one request at a time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from serve_app.models.generation.kv_cache import past_names, present_names
from serve_app.padding import pad_left
from serve_app.tokenization import TextTokenizer


def session(model_dir: Path, name: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / name / "model.onnx"), providers=["CPUExecutionProvider"])


def greedy_tokens(model_dir: Path, prompt: str, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy decoding of one prompt alone, with the KV cache: the batch-independent reference."""
    tok = TextTokenizer.from_file(model_dir / "gpt" / "tokenizer.json")
    meta = json.loads((model_dir / "gpt" / "manifest.json").read_text())["generation"]
    sess = session(model_dir, "gpt")
    ids, mask = pad_left([tok.encode(prompt) or [tok.eos_id]], tok.pad_id)
    n = meta["n_layers"]
    past = [np.zeros((1, meta["n_heads"], 0, meta["head_dim"]), np.float32) for _ in range(2 * n)]

    def run(ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, **dict(zip(past_names(n), past, strict=True))}
        logits, *present = sess.run(["logits", *present_names(n)], feeds)
        return logits, present

    pos = np.arange(ids.shape[1])[None]
    out: list[int] = []
    logits, past = run(ids, pos, mask, past)
    limit = min(max_tokens, meta["block_size"] - ids.shape[1])
    while len(out) < limit:
        nxt = int(logits[0, -1].argmax())
        if nxt == tok.eos_id and not ignore_eos:
            break
        out.append(nxt)
        mask = np.concatenate([mask, [[1]]], axis=1)
        pos = pos[:, -1:] + 1
        logits, past = run(np.array([[nxt]]), pos, mask, past)
    return out


def greedy_text(model_dir: Path, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    tok = TextTokenizer.from_file(model_dir / "gpt" / "tokenizer.json")
    return tok.decode(greedy_tokens(model_dir, prompt, max_tokens, ignore_eos))
