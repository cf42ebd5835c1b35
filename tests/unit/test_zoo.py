"""Zoo: parity of every export, KV-cache correctness, idempotent builds, real skill."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from serve_app.manifest import Manifest
from serve_app.models.generation.kv_cache import past_names, present_names
from serve_app.presets import PRESETS, BertConfig, GPTConfig, ResNetConfig, get_preset
from serve_app.zoo import export
from serve_app.zoo.bert import BertClassifier
from serve_app.zoo.build import build_model, fingerprint, is_built
from serve_app.zoo.gpt import GPT
from serve_app.zoo.resnet import ResNet


@pytest.mark.parametrize("family", ["bert", "gpt", "resnet"])
def test_export_parity(family, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "m.onnx"
    if family == "bert":
        diff = export.export_bert(BertClassifier(BertConfig(64, 32, 16, 1, 2, 32)).eval(), path)
    elif family == "gpt":
        diff = export.export_gpt(GPT(GPTConfig(64, 32, 16, 2, 2)).eval(), path)
    else:
        diff = export.export_resnet(ResNet(ResNetConfig("bottleneck", (1, 1), (4, 8), 16, 3)).eval(), path)
    assert diff < export.PARITY_ATOL


def test_resnet_basic_and_bottleneck_blocks_both_export(tmp_path):
    for block in ("basic", "bottleneck"):
        net = ResNet(ResNetConfig(block, (1, 1), (4, 8), 16, 3)).eval()
        assert export.export_resnet(net, tmp_path / f"{block}.onnx") < export.PARITY_ATOL


def test_kv_cache_decode_matches_full_recompute(tmp_path):
    """One token per decode step through the cache gives the same logits as
    running the whole prefix again (the point of the cache)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(64, 32, 16, 2, 2)).eval()
    path = tmp_path / "gpt.onnx"
    export.export_gpt(model, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 14, 15, 9, 2, 6]], dtype=np.int64)
    names = past_names(2)
    outputs = ["logits", *present_names(2)]

    def run(tokens: np.ndarray, start: int, past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        n = tokens.shape[1]
        feeds = {
            "input_ids": tokens,
            "position_ids": np.arange(start, start + n)[None],
            "attention_mask": np.ones((1, start + n), np.int64),
        }
        logits, *present = sess.run(outputs, feeds | dict(zip(names, past, strict=True)))
        return logits, present

    empty = [p.numpy() for p in model.empty_past(1)]
    logits, past = run(ids[:, :3], 0, empty)
    for t in range(3, 6):
        logits, past = run(ids[:, t : t + 1], t, past)
        full, _ = run(ids[:, : t + 1], 0, empty)
        assert past[0].shape[2] == t + 1
        np.testing.assert_allclose(logits[:, -1], full[:, -1], atol=1e-4)


def test_padding_does_not_change_bert_answer():
    torch.manual_seed(0)
    model = BertClassifier(BertConfig(64, 32, 16, 1, 2, 32)).eval()
    ids = torch.tensor([[5, 6, 7]])
    padded = torch.tensor([[5, 6, 7, 0, 0]])
    with torch.no_grad():
        a = model(ids, torch.ones(1, 3, dtype=torch.long))
        b = model(padded, torch.tensor([[1, 1, 1, 0, 0]]))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_build_is_idempotent_and_writes_manifest(tiny_model_dir):
    path = tiny_model_dir / "bert-light"
    m = Manifest.load(path)
    assert m.family == "bert" and m.tokenizer_file and m.labels == ["negative", "positive"]
    assert m.source["parity_max_abs_diff"] < export.PARITY_ATOL
    assert is_built(path, get_preset("bert-tiny"))
    assert not is_built(path, get_preset("bert-light"))  # another preset's fingerprint


def test_build_replaces_stale_directory(tmp_path):
    target = tmp_path / "resnet"
    target.mkdir()
    (target / "junk").write_text("x")
    build_model("resnet", get_preset("resnet-tiny"), target)
    assert not (target / "junk").exists()
    assert Manifest.load(target).source["fingerprint"] == fingerprint(get_preset("resnet-tiny"))


def test_real_size_presets_have_published_shapes():
    assert PRESETS["bert-base"].model == BertConfig(30522, 512, 768, 12, 12, 3072, 2)
    assert PRESETS["gpt2-small"].model == GPTConfig(50257, 1024, 768, 12, 12)
    resnet50 = PRESETS["resnet-50"].model
    assert isinstance(resnet50, ResNetConfig) and resnet50.layers == (3, 4, 6, 3) and resnet50.block == "bottleneck"


def test_heavy_presets_are_bigger_than_light():
    def params(name):
        p = PRESETS[name]
        net = {"bert": BertClassifier, "gpt": GPT, "resnet": ResNet}[p.family](p.model)
        return sum(t.numel() for t in net.parameters())

    assert params("bert-heavy") > 5 * params("bert-light")
    assert params("resnet-heavy") > 5 * params("resnet-light")


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_zero_initialised_residual_branches_make_every_block_start_as_its_shortcut(block):
    net = ResNet(ResNetConfig(block, (2, 1), (8, 16), zero_init_residual=True))
    identity = next(b for b in net.stages if isinstance(b.shortcut, torch.nn.Identity))
    x = torch.rand(4, identity.body[0].in_channels, 8, 8)  # non-negative, as after a ReLU
    torch.testing.assert_close(identity(x), x)  # the branch adds nothing yet


def test_the_zero_init_option_leaves_every_earlier_resnet_fingerprint_as_it_was():
    """Off, the option is left out of the fingerprint (as seed 0 is): built demo models stay valid."""
    from dataclasses import replace

    light = get_preset("resnet-light")
    assert isinstance(light.model, ResNetConfig)
    assert fingerprint(light) == fingerprint(replace(light, model=replace(light.model, zero_init_residual=False)))
    assert fingerprint(light) != fingerprint(replace(light, model=replace(light.model, zero_init_residual=True)))
