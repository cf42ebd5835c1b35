"""ONNX export with dynamic batch/sequence axes and a torch-vs-ORT parity check."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from serve_app.zoo.bert import BertClassifier
from serve_app.zoo.gpt import GPT
from serve_app.zoo.resnet import ResNet

OPSET = 17
PARITY_ATOL = 1e-3
PARITY_RTOL = 1e-3


class ParityError(AssertionError):
    """Torch and ONNX Runtime disagree beyond tolerance: the export is wrong."""


def _export(
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    axes: dict[str, dict[int, str]],
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        torch.onnx.export(
            model, args, str(path), input_names=inputs, output_names=outputs, dynamic_axes=axes, opset_version=OPSET, dynamo=False
        )


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _check(name: str, torch_out: torch.Tensor, ort_out: np.ndarray) -> float:
    t = torch_out.detach().numpy()
    diff = float(np.abs(t - ort_out).max()) if t.size else 0.0
    # The absolute tolerance scales with the output's magnitude: untrained deep nets (the
    # real-size presets) give logits in the thousands, where float32 reassociation alone
    # moves a near-zero element by more than a fixed atol.
    scale = max(1.0, float(np.abs(t).max())) if t.size else 1.0
    if not np.allclose(t, ort_out, atol=PARITY_ATOL * scale, rtol=PARITY_RTOL):
        raise ParityError(f"{name}: torch vs ONNX Runtime max abs diff {diff:.2e} exceeds tolerance")
    return diff


@torch.no_grad()
def export_bert(model: BertClassifier, path: Path) -> float:
    B, T = 2, 7
    ids = torch.randint(0, model.cfg.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    _export(
        model,
        (ids, mask),
        path,
        ["input_ids", "attention_mask"],
        ["logits"],
        {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}, "logits": {0: "batch"}},
    )
    # Parity on a different batch and length than the trace, with padding.
    ids = torch.randint(0, model.cfg.vocab_size, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 6:] = 0
    (out,) = _session(path).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    return _check("bert logits", model(ids, mask), out)


@torch.no_grad()
def export_resnet(model: ResNet, path: Path) -> float:
    s = model.cfg.image_size
    x = torch.rand(2, 3, s, s)
    _export(model, (x,), path, ["image"], ["logits"], {"image": {0: "batch"}, "logits": {0: "batch"}})
    x = torch.rand(3, 3, s, s)
    (out,) = _session(path).run(None, {"image": x.numpy()})
    return _check("resnet logits", model(x), out)


@torch.no_grad()
def export_gpt(model: GPT, path: Path) -> float:
    """In the layout optimum exports decoders with: past_key_values.{i}.key/value in, present.{i}.key/value out."""
    V, L = model.cfg.vocab_size, model.cfg.n_layers
    past_names = [f"past_key_values.{i}.{kind}" for i in range(L) for kind in ("key", "value")]
    present_names = [f"present.{i}.{kind}" for i in range(L) for kind in ("key", "value")]
    # Trace with a non-empty past so the concat along the cache axis stays dynamic.
    B, P, T = 2, 3, 2
    hs = model.cfg.d_model // model.cfg.n_heads
    past = [torch.randn(B, model.cfg.n_heads, P, hs) for _ in range(2 * L)]
    args = (torch.randint(0, V, (B, T)), torch.arange(P, P + T).expand(B, T), torch.ones(B, P + T, dtype=torch.long), *past)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch_size", 1: "sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"},
    }
    axes |= {n: {0: "batch_size", 2: "past_sequence_length"} for n in past_names}
    axes |= {n: {0: "batch_size", 2: "total_sequence_length"} for n in present_names}
    _export(model, args, path, ["input_ids", "position_ids", "attention_mask", *past_names], ["logits", *present_names], axes)
    sess = _session(path)

    def run(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor]) -> list[np.ndarray]:
        feeds = {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "attention_mask": mask.numpy()}
        feeds |= {n: p.numpy() for n, p in zip(past_names, past, strict=True)}
        return sess.run(["logits", *present_names], feeds)

    # Parity: left-padded prefill with an empty cache, then one decode step.
    B, T = 3, 5
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits, *present = run(ids, pos, mask, model.empty_past(B))
    t_logits, *t_present = model(ids, pos, mask, *model.empty_past(B))
    checks = [_check("gpt present", t, o) for t, o in zip(t_present, present, strict=True)]
    worst = max(_check("gpt prefill logits", t_logits, logits), *checks)
    nxt = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]
    mask2 = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
    past2 = [torch.from_numpy(p) for p in present]
    logits, *_ = run(nxt, pos[:, -1:] + 1, mask2, past2)
    t_logits, *_ = model(nxt, pos[:, -1:] + 1, mask2, *past2)
    return max(worst, _check("gpt decode logits", t_logits, logits))
