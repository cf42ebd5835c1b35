"""Model exports made the way users make them, with random weights (no download reaches this
machine): Hugging Face architectures built with `from_config`, exported by optimum; a ResNet in
torchvision's own layout, exported with `torch.onnx.export`. Tokenizers are trained locally
with `tokenizers` and saved through transformers, so their files are the ordinary ones
(tokenizer.json, tokenizer_config.json, special_tokens_map.json).

The tests serve these as a user's exports (tests/unit/test_exports.py, the integration tests),
and `configs/bench-realsize.yaml` builds its real-size models with them (`source:` presets).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve_app.zoo import data

# Sizes: "tiny" for tests, the real architectures for benchmarks.
BERT_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522),
}
GPT2_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_embd=32, n_layer=2, n_head=2, n_positions=128),
    "small": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257),
}
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
}
RESNET_LAYERS = {18: ("basic", (2, 2, 2, 2)), 50: ("bottleneck", (3, 4, 6, 3))}
SENTIMENT = {0: "negative", 1: "positive"}
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def _corpus() -> list[str]:
    return data.sentiment_dataset(2000, seed=0)[0]


@contextlib.contextmanager
def _workdir(checkpoint: Path | None) -> Iterator[Path]:
    """Where the torch checkpoint is saved before export: `checkpoint` when the caller keeps it
    (parity tests load it), else a scratch directory."""
    if checkpoint is not None:
        checkpoint.mkdir(parents=True, exist_ok=True)
        yield checkpoint
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield Path(scratch) / "checkpoint"


def _save_and_export(model_class: Any, config: Any, tokenizer: Any, work: Path, out: Path, task: str, seed: int) -> None:
    """The model built from its config with seeded random weights, saved with its tokenizer as
    `save_pretrained` writes a checkpoint, and exported from there by optimum for `task`."""
    from optimum.exporters.onnx import main_export

    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(work)
    tokenizer.save_pretrained(work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(work), output=str(out), task=task, do_validation=False)


def hf_text_classifier(out: Path, size: str = "tiny", seed: int = 0, checkpoint: Path | None = None) -> Path:
    """BertForSequenceClassification (WordPiece, [CLS]/[SEP], token_type_ids) exported by optimum."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    with _workdir(checkpoint) as work:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        trainer = trainers.WordPieceTrainer(vocab_size=1000, special_tokens=specials, show_progress=False)
        tok.train_from_iterator(_corpus(), trainer)
        vocab = tok.get_vocab()
        vocab_file = work.parent / f"{work.name}-vocab.txt"
        vocab_file.write_text("\n".join(sorted(vocab, key=vocab.__getitem__)) + "\n")
        shape = dict(BERT_SIZES[size])
        tokenizer = BertTokenizerFast(vocab_file=str(vocab_file), model_max_length=shape.get("max_position_embeddings", 512))
        shape.setdefault("vocab_size", tokenizer.vocab_size)
        config = BertConfig(**shape, id2label=SENTIMENT, label2id={v: k for k, v in SENTIMENT.items()})
        _save_and_export(BertForSequenceClassification, config, tokenizer, work, out, "text-classification", seed)
    return out


def _byte_level_bpe(vocab_size: int, specials: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def hf_gpt2(out: Path, size: str = "tiny", seed: int = 0, checkpoint: Path | None = None) -> Path:
    """GPT2LMHeadModel with its byte-level BPE (<|endoftext|>, no pad token), exported by optimum
    for text generation with past key values."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    end = "<|endoftext|>"
    with _workdir(checkpoint) as work:
        shape = dict(GPT2_SIZES[size])
        tokenizer = GPT2TokenizerFast(
            tokenizer_object=_byte_level_bpe(400, [end]),
            bos_token=end,
            eos_token=end,
            unk_token=end,
            model_max_length=shape["n_positions"],
        )
        shape.setdefault("vocab_size", tokenizer.vocab_size)
        eos = tokenizer.eos_token_id
        config = GPT2Config(**shape, bos_token_id=eos, eos_token_id=eos)
        _save_and_export(GPT2LMHeadModel, config, tokenizer, work, out, "text-generation-with-past", seed)
    return out


def hf_llama(out: Path, size: str = "tiny", seed: int = 0, checkpoint: Path | None = None) -> Path:
    """LlamaForCausalLM (rotary positions, grouped-query attention, <s> added by the tokenizer's
    post-processor), exported by optimum for text generation with past key values."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    with _workdir(checkpoint) as work:
        tok = _byte_level_bpe(400, ["<unk>", "<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        shape = dict(LLAMA_SIZES[size])
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            model_max_length=shape["max_position_embeddings"],
        )
        config = LlamaConfig(
            **shape, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        )
        _save_and_export(LlamaForCausalLM, config, tokenizer, work, out, "text-generation-with-past", seed)
    return out


# -- torchvision's ResNet, module for module (its state_dict loads torchvision's weights) --------


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class TorchvisionResNet(nn.Module):
    """torchvision.models.resnet{18,50}(weights=None), without torchvision (whose PyPI wheel does
    not import beside a CPU build of torch)."""

    def __init__(self, depth: int = 50, num_classes: int = 1000) -> None:
        super().__init__()
        kind, counts = RESNET_LAYERS[depth]
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), counts, strict=True)):
            layers: list[nn.Module] = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                c_out = width * block.expansion
                down = None
                if stride != 1 or c_in != c_out:
                    down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                layers.append(block(c_in, width, stride, down))
                c_in = c_out
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_resnet(
    out: Path, depth: int = 18, num_classes: int = 1000, image_size: int = 224, seed: int = 0, keep_weights: bool = False
) -> Path:
    """The model exported as torchvision's docs show: input "input", output "output", dynamic batch.
    No preprocessing file: torchvision users normalize in their own code (docs/models.md)."""
    torch.manual_seed(seed)
    model = TorchvisionResNet(depth, num_classes).eval()
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.randn(1, 3, image_size, image_size),),
            str(out / "model.onnx"),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch_size"}, "output": {0: "batch_size"}},
            opset_version=17,
            dynamo=False,
        )
    if keep_weights:  # weights.pt beside the graph, for parity checks against the torch model
        torch.save(model.state_dict(), out / "weights.pt")
    return out


def build_export(kind: str, size: str, out: Path) -> Path:
    """One export into `out`, by kind: hf-bert, hf-gpt2, hf-llama, torchvision-resnet{18,50}. The
    caller makes it atomic (serve_app.zoo.build exports into its scratch directory)."""
    if kind == "hf-bert":
        return hf_text_classifier(out, size)
    if kind == "hf-gpt2":
        return hf_gpt2(out, size)
    if kind == "hf-llama":
        return hf_llama(out, size)
    if kind.startswith("torchvision-resnet"):
        return torchvision_resnet(out, int(kind.removeprefix("torchvision-resnet")))
    raise ValueError(f"unknown export kind {kind!r}")
