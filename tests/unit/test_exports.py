"""Ordinary exports read as they are: what discovery finds, and that serving's code paths give the
answers the torch models give (tokens, logits, greedy generation) on them, without Ray."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from serve_app.exports import Declared, ExportProblems, discover
from serve_app.manifest import Manifest
from serve_app.models.classifier import Normalize, image_feed
from serve_app.models.generation.continuous import ContinuousScheduler
from serve_app.models.generation.decoder_graph import DecoderGraph
from serve_app.models.generation.kv_cache import KVCache
from serve_app.models.generation.sampling import GenerationParams
from serve_app.models.generation.sequence import Sequence
from serve_app.padding import pad_right
from serve_app.tokenization import TextTokenizer
from serve_app.zoo.hub import TorchvisionResNet
from tests.exports import IMAGE_SIZE, IMAGENET, Exports

TEXTS = ["The food was great", "terrible service, never again!", "", "ok " * 200]


def session(model_dir: Path, manifest: Manifest) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_dir / manifest.onnx_file), providers=["CPUExecutionProvider"])


def test_an_optimum_text_classifier_is_read_with_its_labels_special_tokens_and_length(exports: Exports):
    _, m = discover(exports.bert, Declared("bert"))
    assert (m.family, m.pad_token, m.labels, m.max_sequence_length) == ("bert", "[PAD]", ["negative", "positive"], 64)
    assert "token_type_ids" in m.input_names


def test_text_is_tokenized_as_the_models_own_tokenizer_does_special_tokens_and_truncation(exports: Exports):
    from transformers import AutoTokenizer

    model_dir, m = discover(exports.bert, Declared("bert"))
    ours = TextTokenizer.for_model(model_dir, m, truncate=True).encode_rows(TEXTS)
    theirs = AutoTokenizer.from_pretrained(exports.bert)(TEXTS, truncation=True, max_length=64)["input_ids"]
    assert ours == theirs
    assert ours[0][0] == theirs[0][0] and len(ours[3]) == 64  # [CLS] first; a long text cut to the model's length


def test_bert_logits_through_the_replicas_feeds_match_the_torch_model(exports: Exports):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir, m = discover(exports.bert, Declared("bert"))
    tok = TextTokenizer.for_model(model_dir, m, truncate=True)
    ids, mask = pad_right(tok.encode_rows(TEXTS), tok.pad_id)
    (ours,) = session(model_dir, m).run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    torch_model = AutoModelForSequenceClassification.from_pretrained(exports.checkpoint("bert")).eval()
    batch = AutoTokenizer.from_pretrained(exports.bert)(TEXTS, truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = torch_model(**batch).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_continuous_batching_matches_hugging_face_generate(exports: Exports, name: str):
    """Prompts of different lengths arrive at different steps and share decode batches (each row's
    past left-aligned, a masked gap to the longest): every output equals `generate` alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, m = discover(getattr(exports, name), Declared(name))
    assert m.generation is not None
    tok = TextTokenizer.for_model(model_dir, m, truncate=False)
    graph = DecoderGraph(session(model_dir, m), m.generation)
    sched = ContinuousScheduler(graph, KVCache(graph.shape, 3), tok.eos_id, tok.pad_id, tok.decode)
    prompts = ["the food", "service was slow and the waiter", "a", "never again will I eat here, said the critic"]
    seqs = []
    for i, prompt in enumerate(prompts):
        params = GenerationParams(max_tokens=12, temperature=0.0)
        seqs.append(Sequence(i + 1, tok.encode(prompt), params, 12))
    for step in range(200):
        if step < len(seqs):
            sched.submit(seqs[step])  # one new prompt per step, while the earlier ones decode
        sched.step()
        if all(s.finished for s in seqs):
            break
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(exports.checkpoint(name)).eval()
    for prompt, seq in zip(prompts, seqs, strict=True):
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
        assert seq.prompt == ids[0].tolist()  # the tokenizer's own special tokens (Llama's <s>)
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_id)[0, ids.shape[1] :].tolist()
        assert seq.tokens == (out[:-1] if out[-1] == tok.eos_id else out), prompt  # ours ends at EOS without sending it


def test_a_torchvision_export_needs_its_normalization_declared_and_then_matches_torch(exports: Exports):
    with pytest.raises(ExportProblems, match="no normalization declared"):
        discover(exports.resnet, Declared("resnet"))
    model_dir, m = discover(exports.resnet, Declared("resnet", image=IMAGENET))
    assert (m.family, m.inputs[0].name, m.image_size, len(m.labels)) == ("resnet", "input", IMAGE_SIZE, 10)
    pixels = np.random.default_rng(0).integers(0, 256, (3, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    feed = image_feed([pixels], 0, 3, 3, Normalize.of(m.image))
    (ours,) = session(model_dir, m).run(None, {"input": feed})
    net = TorchvisionResNet(18, 10).eval()
    net.load_state_dict(torch.load(exports.resnet / "weights.pt"))
    mean, std = (torch.tensor(IMAGENET[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        theirs = net((torch.from_numpy(pixels).float() / 255 - mean) / std).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_preprocessor_config_gives_the_normalization_and_the_crop(exports: Exports, tmp_path: Path):
    shutil.copytree(exports.resnet, tmp_path / "r")
    (tmp_path / "r" / "preprocessor_config.json").write_text(
        '{"do_normalize": true, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], '
        '"do_center_crop": true, "size": {"shortest_edge": 73}, "crop_size": {"height": 64, "width": 64}}'
    )
    _, m = discover(tmp_path / "r", Declared("r"))
    assert (m.image.mean, m.image.std, m.image.resize, m.image_size) == ([0.5] * 3, [0.5] * 3, 73, 64)


def broken(src: Path, tmp_path: Path, damage: str) -> Path:
    out = tmp_path / damage
    shutil.copytree(src, out)
    if damage == "no-tokenizer":
        (out / "tokenizer.json").unlink()
    elif damage == "truncated":
        data = (out / "model.onnx").read_bytes()
        (out / "model.onnx").write_bytes(data[: len(data) // 3])
    return out


@pytest.mark.parametrize(
    ("damage", "line"),
    [
        ("no-tokenizer", "no tokenizer.json in .*: save the model's fast tokenizer beside the graph"),
        ("truncated", "model.onnx cannot be loaded by ONNX Runtime .*: re-export it"),
    ],
)
def test_a_broken_export_is_one_line_per_problem_saying_how_to_fix_it(exports: Exports, tmp_path: Path, damage: str, line: str):
    with pytest.raises(ExportProblems) as caught:
        discover(broken(exports.bert, tmp_path, damage), Declared("bert"))
    assert len(caught.value.problems) == 1
    assert "\n" not in caught.value.problems[0]
    assert pytest.importorskip("re").search(line, caught.value.problems[0])


def test_a_graph_whose_inputs_fit_no_family_or_contradict_the_config_is_refused(exports: Exports):
    with pytest.raises(ExportProblems, match="looks like a bert model"):
        discover(exports.bert, Declared("x", family="resnet"))
    with pytest.raises(ExportProblems, match="no such directory"):
        discover(exports.root / "nowhere", Declared("x"))
