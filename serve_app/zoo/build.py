"""Build model directories: train (briefly) -> export ONNX -> parity -> manifest.

Idempotent: a directory whose manifest carries the same fingerprint is kept.
Each build happens in a scratch directory that is renamed into place, so an
interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from serve_app.manifest import MANIFEST_FILE, GenerationSpec, Manifest, TensorSpec
from serve_app.models.generation.kv_cache import past_names, present_names
from serve_app.presets import DEMO_VOCAB, BertConfig, ExportConfig, GPTConfig, Preset, ResNetConfig
from serve_app.tokenization import TextTokenizer, train_byte_level_bpe
from serve_app.zoo import data, export, train
from serve_app.zoo.bert import BertClassifier
from serve_app.zoo.gpt import GPT

# Bump when training data, code or export change in a way that alters outputs.
BUILD_VERSION = "2"
TOKENIZER_CORPUS_SIZE = 6000
EVAL_SIZE = 2000

Progress = Callable[[int], None]


def fingerprint(preset: Preset) -> str:
    described = asdict(preset)
    if not preset.train.seed:  # seed 0 is what every build used before seeds were a setting: those builds stay valid
        del described["train"]["seed"]
    if described["model"].get("zero_init_residual") is False:  # likewise for ResNets from before the option
        del described["model"]["zero_init_residual"]
    blob = json.dumps({"v": BUILD_VERSION, "preset": described}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_built(model_dir: Path, preset: Preset) -> bool:
    try:
        m = Manifest.load(model_dir)
    except (FileNotFoundError, ValueError):
        return False
    return m.source.get("fingerprint") == fingerprint(preset) and (model_dir / m.onnx_file).is_file()


def _demo_tokenizer(path: Path) -> TextTokenizer:
    texts = data.sentiment_dataset(TOKENIZER_CORPUS_SIZE, seed=0)[0]
    return train_byte_level_bpe(texts, DEMO_VOCAB, path)


def build_model(name: str, preset: Preset, model_dir: Path, progress: Progress = lambda n: None) -> Manifest:
    """Build one model directory at `model_dir` (replacing what is there)."""
    scratch = model_dir.with_name(model_dir.name + ".building")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    torch.manual_seed(preset.train.seed)
    started = time.perf_counter()
    source: dict[str, object] = {
        "preset": preset.name,
        "fingerprint": fingerprint(preset),
        "config": asdict(preset.model),
        "train": asdict(preset.train),
        "trained": preset.trained,
    }
    cfg = preset.model
    if isinstance(cfg, BertConfig):
        manifest = _build_bert(name, cfg, preset, scratch, source, progress)
    elif isinstance(cfg, GPTConfig):
        manifest = _build_gpt(name, cfg, preset, scratch, source, progress)
    elif isinstance(cfg, ResNetConfig):
        manifest = _build_resnet(name, cfg, preset, scratch, source, progress)
    elif isinstance(cfg, ExportConfig):
        manifest = _build_export(name, cfg, preset, scratch, source)
    else:  # pragma: no cover - presets are a closed set
        raise TypeError(f"unknown model config {type(cfg).__name__}")
    manifest.source["build_seconds"] = round(time.perf_counter() - started, 1)
    manifest.save(scratch)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    scratch.rename(model_dir)
    assert (model_dir / MANIFEST_FILE).is_file(), "manifest missing after build"
    return manifest


def _build_bert(
    name: str, cfg: BertConfig, preset: Preset, scratch: Path, source: dict[str, object], progress: Progress
) -> Manifest:
    onnx_path = scratch / "model.onnx"
    tok = _demo_tokenizer(scratch / "tokenizer.json")
    bert = BertClassifier(cfg)
    if preset.trained:
        train.train_bert(bert, tok, preset.train, progress)
        source["accuracy"] = {
            "test": train.accuracy_bert(bert, tok, EVAL_SIZE, data.TEST_SEED),
            "val": train.accuracy_bert(bert, tok, EVAL_SIZE, data.VAL_SEED),
        }
    source["parity_max_abs_diff"] = export.export_bert(bert, onnx_path)
    return Manifest(
        name=name,
        family="bert",
        tokenizer_file="tokenizer.json",
        max_sequence_length=cfg.max_len,
        inputs=[
            TensorSpec(name="input_ids", datatype="INT64", shape=[-1, -1]),
            TensorSpec(name="attention_mask", datatype="INT64", shape=[-1, -1]),
        ],
        outputs=[TensorSpec(name="logits", datatype="FP32", shape=[-1, cfg.n_classes])],
        labels=data.SENTIMENT_LABELS if cfg.n_classes == 2 else [str(i) for i in range(cfg.n_classes)],
        source=source,
    )


def _build_gpt(
    name: str, cfg: GPTConfig, preset: Preset, scratch: Path, source: dict[str, object], progress: Progress
) -> Manifest:
    onnx_path = scratch / "model.onnx"
    tok = _demo_tokenizer(scratch / "tokenizer.json")
    gpt = GPT(cfg)
    if preset.trained:
        train.train_gpt(gpt, tok, preset.train, progress)
        source["val_loss"] = train.gpt_loss(gpt, tok, 300, data.VAL_SEED)
    source["parity_max_abs_diff"] = export.export_gpt(gpt, onnx_path)
    hd = cfg.d_model // cfg.n_heads
    return Manifest(
        name=name,
        family="gpt",
        tokenizer_file="tokenizer.json",
        max_sequence_length=cfg.block_size,
        inputs=[
            TensorSpec(name="input_ids", datatype="INT64", shape=[-1, -1]),
            TensorSpec(name="position_ids", datatype="INT64", shape=[-1, -1]),
            TensorSpec(name="attention_mask", datatype="INT64", shape=[-1, -1]),
            *(TensorSpec(name=n, datatype="FP32", shape=[-1, cfg.n_heads, -1, hd]) for n in past_names(cfg.n_layers)),
        ],
        outputs=[
            TensorSpec(name="logits", datatype="FP32", shape=[-1, -1, cfg.vocab_size]),
            *(TensorSpec(name=n, datatype="FP32", shape=[-1, cfg.n_heads, -1, hd]) for n in present_names(cfg.n_layers)),
        ],
        generation=GenerationSpec(n_layers=cfg.n_layers, n_heads=cfg.n_heads, head_dim=hd, block_size=cfg.block_size),
        source=source,
    )


def _build_export(name: str, cfg: ExportConfig, preset: Preset, scratch: Path, source: dict[str, object]) -> Manifest:
    """The export as its tool writes it, and the manifest `serve-app models import --write` would
    add (with the build's fingerprint): served exactly as a user's import of the same export."""
    from serve_app.exports import Declared, discover
    from serve_app.zoo import hub

    hub.build_export(cfg.kind, cfg.size, scratch)
    image = hub.IMAGENET if preset.family == "resnet" else None  # torchvision's weights' normalization
    _, manifest = discover(scratch, Declared(name, preset.family, image))
    manifest.source.update(source, exported_by="torch.onnx.export" if preset.family == "resnet" else "optimum")
    return manifest


def _build_resnet(
    name: str, cfg: ResNetConfig, preset: Preset, scratch: Path, source: dict[str, object], progress: Progress
) -> Manifest:
    onnx_path = scratch / "model.onnx"
    from serve_app.zoo.resnet import ResNet, calibrate_batchnorm

    net = ResNet(cfg)
    if preset.trained:
        train.train_resnet(net, preset.train, progress)
        source["accuracy"] = {
            "test": train.accuracy_resnet(net, EVAL_SIZE, data.TEST_SEED),
            "val": train.accuracy_resnet(net, EVAL_SIZE, data.VAL_SEED),
        }
    else:
        calibrate_batchnorm(net, cfg.image_size)
        source["batchnorm"] = "running statistics estimated on generated images (untrained weights)"
    source["parity_max_abs_diff"] = export.export_resnet(net, onnx_path)
    s = cfg.image_size
    return Manifest(
        name=name,
        family="resnet",
        image_size=s,
        inputs=[TensorSpec(name="image", datatype="FP32", shape=[-1, 3, s, s])],
        outputs=[TensorSpec(name="logits", datatype="FP32", shape=[-1, cfg.n_classes])],
        labels=data.SHAPE_LABELS if cfg.n_classes == len(data.SHAPE_LABELS) else [str(i) for i in range(cfg.n_classes)],
        source=source,
    )
