"""Ordinary exports served as they are: optimum's BERT, GPT-2 and Llama, a torchvision ResNet,
each given by nothing but a `path:` and a `family:` (the ResNet also its normalization, which a
torchvision export does not carry). Answers are checked against the torch models and Hugging
Face's tokenizer and `generate`, through real clients: v2 over HTTP (JSON and tritonclient) and
gRPC, and the openai SDK streaming completions. Broken model directories in the same app get
503 with the reason while the rest answers.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import openai
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton

from serve_app.zoo.hub import TorchvisionResNet
from tests.exports import IMAGE_SIZE, IMAGENET, Exports
from tests.integration.serving import SHARED_GRPC_PORT, SHARED_PORT, app_for_module

pytestmark = pytest.mark.integration
URL = f"http://127.0.0.1:{SHARED_PORT}"
TEXTS = ["The food was great", "terrible service, never again!", "ok " * 100]
PROMPTS = ["the food was", "never again will I eat here, said"]
BROKEN = ("broken-tokenizer", "broken-inputs", "broken-file")


def renamed_inputs(src: Path, out: Path) -> Path:
    """The BERT export with its graph inputs renamed, as a hand-rolled export might name them."""
    shutil.copytree(src, out)
    model = onnx.load(str(out / "model.onnx"))
    names = {"input_ids": "ids", "attention_mask": "mask", "token_type_ids": "segments"}
    for value in model.graph.input:
        value.name = names.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
    onnx.save(model, str(out / "model.onnx"))
    return out


@pytest.fixture(scope="module")
def app_url(exports: Exports, serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    broken = tmp_path_factory.mktemp("broken")
    shutil.copytree(exports.bert, broken / "no-tokenizer")
    (broken / "no-tokenizer" / "tokenizer.json").unlink()
    renamed_inputs(exports.bert, broken / "inputs")
    shutil.copytree(exports.gpt2, broken / "decoder")
    (broken / "decoder" / "model.onnx").write_bytes(b"not a graph")
    shutil.copytree(exports.resnet, broken / "file")
    graph = broken / "file" / "model.onnx"
    graph.write_bytes(graph.read_bytes()[:4096])
    one = {"max_batch_size": 8, "batch_wait_timeout_s": 0.01}
    generation = {"default_max_tokens": 8, "max_tokens_limit": 32, "kv_slots": 4}
    args = {
        "models": {
            "hf-bert": {"path": str(exports.bert), "family": "bert", "batching": one},
            "hf-gpt2": {"path": str(exports.gpt2), "family": "gpt", "generation": generation},
            "hf-llama": {"path": str(exports.llama), "family": "gpt", "generation": generation},
            "tv-resnet": {"path": str(exports.resnet / "model.onnx"), "family": "resnet", "image": IMAGENET, "batching": one},
            "broken-tokenizer": {"path": str(broken / "no-tokenizer"), "family": "bert"},
            "broken-inputs": {"path": str(broken / "inputs"), "family": "bert"},
            "broken-file": {"path": str(broken / "file"), "family": "resnet", "image": IMAGENET},
            "broken-decoder": {"path": str(broken / "decoder"), "family": "gpt"},
        },
        # A route whose light tier cannot load (nor its calibration be read): the heavy one answers.
        "routes": {"broken-route": {"light": "broken-tokenizer", "heavy": "hf-bert"}},
    }
    yield from app_for_module(args, serve_url)


def torch_bert_logits(exports: Exports, texts: list[str]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(exports.checkpoint("bert")).eval()
    batch = AutoTokenizer.from_pretrained(exports.bert)(texts, truncation=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.numpy()


def test_bert_over_v2_json_matches_the_torch_model_with_its_special_tokens(app_url: str, exports: Exports):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}]}
    r = httpx.post(f"{app_url}/v2/models/hf-bert/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    logits = np.asarray(outputs["logits"]["data"], dtype=np.float32).reshape(outputs["logits"]["shape"])
    np.testing.assert_allclose(logits, torch_bert_logits(exports, TEXTS), atol=1e-4)
    assert set(outputs["label"]["data"]) <= {"negative", "positive"}  # config.json's id2label


def test_bert_through_tritonclient_http(app_url: str, exports: Exports):
    client = triton.InferenceServerClient(f"127.0.0.1:{SHARED_PORT}")
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], dtype=np.object_), binary_data=True)
    result = client.infer("hf-bert", [text], outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
    np.testing.assert_allclose(result.as_numpy("logits"), torch_bert_logits(exports, TEXTS[:2]), atol=1e-4)


def test_torchvision_resnet_over_grpc_matches_torch_with_the_declared_normalization(app_url: str, exports: Exports):
    pixels = np.random.default_rng(1).random((2, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{SHARED_GRPC_PORT}")
    image = triton_grpc.InferInput("image", list(pixels.shape), "FP32")
    image.set_data_from_numpy(pixels)
    result = client.infer("tv-resnet", [image], outputs=[triton_grpc.InferRequestedOutput("logits")])
    net = TorchvisionResNet(18, 10).eval()
    net.load_state_dict(torch.load(exports.resnet / "weights.pt"))
    mean, std = (torch.tensor(IMAGENET[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        expected = net((torch.from_numpy(pixels) - mean) / std).numpy()
    np.testing.assert_allclose(result.as_numpy("logits"), expected, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_streamed_greedy_completions_equal_hugging_face_generate(app_url: str, exports: Exports, name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60)
    tok = AutoTokenizer.from_pretrained(getattr(exports, name))
    hf = AutoModelForCausalLM.from_pretrained(exports.checkpoint(name)).eval()
    for prompt in PROMPTS:
        stream = client.completions.create(model=f"hf-{name}", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        served = "".join(chunk.choices[0].text for chunk in stream)
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
        assert served == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), prompt


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("broken-tokenizer", "no tokenizer.json"),
        ("broken-inputs", "a text classifier's graph takes input_ids, attention_mask"),
        ("broken-file", "cannot be loaded by ONNX Runtime"),
    ],
)
def test_a_model_that_cannot_load_answers_503_with_the_reason_and_the_rest_serve(app_url: str, model: str, reason: str):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}
    r = httpx.post(f"{app_url}/v2/models/{model}/infer", json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert f"model {model} cannot load" in r.json()["error"] and reason in r.json()["error"]
    assert float(r.headers["retry-after"]) > 0
    assert httpx.get(f"{app_url}/v2/models/{model}/ready", timeout=30).status_code != 200
    # The server stays ready (a load balancer keeps sending traffic) and the other models answer.
    assert httpx.get(f"{app_url}/v2/health/ready", timeout=30).status_code == 200
    ok = httpx.post(f"{app_url}/v2/models/hf-bert/infer", json=body, timeout=30)
    assert ok.status_code == 200, ok.text


def test_a_decoder_that_cannot_load_answers_completions_with_503_and_the_reason(app_url: str):
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="broken-decoder", prompt="hello", max_tokens=4)
    assert caught.value.status_code == 503 and "cannot be loaded by ONNX Runtime" in caught.value.message
    assert float(caught.value.response.headers["retry-after"]) > 0
    assert {m.id for m in client.models.list()} == {"hf-gpt2", "hf-llama"}  # what can be asked for
    served = client.completions.create(model="hf-gpt2", prompt="hello", max_tokens=4, temperature=0)
    assert served.choices[0].finish_reason in ("stop", "length")


def test_a_route_whose_light_tier_cannot_load_is_answered_by_its_heavy_tier_degraded(app_url: str):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": TEXTS[:2]}]}
    r = httpx.post(f"{app_url}/v2/models/broken-route/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-degraded"), r.headers
