"""Named size presets for every model family.

`*-tiny` presets build in seconds for tests; `*-light` / `*-heavy` are the
default catalog; the real-size presets (`bert-base`, `gpt2-small`, `resnet-50`)
carry the published shapes for GPU benchmarks and are exported untrained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 512
    max_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    n_classes: int = 2


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


@dataclass(frozen=True)
class ResNetConfig:
    block: Literal["basic", "bottleneck"] = "basic"
    layers: tuple[int, ...] = (1, 1, 1)
    widths: tuple[int, ...] = (16, 32, 64)
    image_size: int = 32
    n_classes: int = 6
    # Each residual branch's last BatchNorm starts at zero, so every block starts as the identity
    # (Goyal et al.): what lets a deep ResNet train in a few hundred steps.
    zero_init_residual: bool = False


@dataclass(frozen=True)
class ExportConfig:
    """A real architecture from its ecosystem's definition (transformers, torchvision's layout),
    random weights, exported by the tool its users use (serve_app.zoo.hub): what users serve."""

    kind: Literal["hf-bert", "hf-gpt2", "hf-llama", "torchvision-resnet50", "torchvision-resnet18"]
    size: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """How long to train; `steps == 0` exports the randomly initialised model."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    n_train: int = 4000
    seed: int = 0  # initial weights; another seed trains another model of the same shape


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # a registered family (serve_app.families)
    model: BertConfig | GPTConfig | ResNetConfig | ExportConfig
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def trained(self) -> bool:
        return self.train.steps > 0


# Vocab sizes of the demo presets must match the demo tokenizer (see tokenizer.py).
DEMO_VOCAB = 512

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("bert-tiny", "bert", BertConfig(DEMO_VOCAB, 64, 16, 1, 2, 32), TrainConfig(60, 64, 3e-3, 1000)),
        Preset("bert-light", "bert", BertConfig(DEMO_VOCAB, 64, 32, 1, 2, 64), TrainConfig(400, 64, 3e-3, 6000)),
        Preset("bert-heavy", "bert", BertConfig(DEMO_VOCAB, 64, 96, 3, 4, 192), TrainConfig(700, 64, 2e-3, 12000)),
        # A second version of bert-heavy for canaries and shadows: wider, shallower, another seed.
        Preset("bert-heavy-v2", "bert", BertConfig(DEMO_VOCAB, 64, 128, 2, 4, 256), TrainConfig(600, 64, 2e-3, 12000, 1)),
        # BERT-Medium's shape (8 layers, 512 wide; Turc et al.) on the demo tokenizer, trained: the
        # heavy tier of configs/bench-cascade.yaml, where the heavy model dominates a route's cost.
        Preset("bert-medium", "bert", BertConfig(DEMO_VOCAB, 64, 512, 8, 8, 2048), TrainConfig(400, 64, 1e-3, 12000)),
        Preset("bert-base", "bert", BertConfig(30522, 512, 768, 12, 12, 3072, 2)),
        Preset("gpt-tiny", "gpt", GPTConfig(DEMO_VOCAB, 64, 16, 1, 2), TrainConfig(40, 32, 3e-3, 500)),
        Preset("gpt-light", "gpt", GPTConfig(DEMO_VOCAB, 128, 96, 3, 4), TrainConfig(500, 32, 2e-3, 6000)),
        Preset("gpt2-small", "gpt", GPTConfig(50257, 1024, 768, 12, 12)),
        # GPT-2 small's body (85M parameters without embeddings) on the demo tokenizer, with a
        # 256-token window: serves real text, costs what GPT-2 small costs per decode step.
        Preset("gpt2-small-demo", "gpt", GPTConfig(DEMO_VOCAB, 256, 768, 12, 12)),
        Preset("resnet-tiny", "resnet", ResNetConfig("basic", (1, 1), (4, 8)), TrainConfig(40, 64, 3e-3, 1000)),
        Preset("resnet-light", "resnet", ResNetConfig("basic", (1, 1, 1), (8, 16, 32)), TrainConfig(450, 64, 3e-3, 6000)),
        Preset("resnet-heavy", "resnet", ResNetConfig("bottleneck", (1, 2, 2), (16, 32, 64)), TrainConfig(420, 64, 2e-3, 12000)),
        # ResNet-50's layout (3, 4, 6, 3 bottleneck blocks) at 3/8 of its width for the demo's
        # 32x32 images, trained: the heavy image tier of configs/bench-cascade.yaml.
        Preset(
            "resnet-50-slim",
            "resnet",
            ResNetConfig("bottleneck", (3, 4, 6, 3), (24, 48, 96, 192), zero_init_residual=True),
            TrainConfig(400, 64, 2e-3, 12000),
        ),
        Preset("resnet-50", "resnet", ResNetConfig("bottleneck", (3, 4, 6, 3), (64, 128, 256, 512), 224, 1000)),
        # The real architectures, exported as their users export them (docs/models.md).
        Preset("hf-bert-base", "bert", ExportConfig("hf-bert", "base")),
        Preset("hf-gpt2-small", "gpt", ExportConfig("hf-gpt2", "small")),
        Preset("tv-resnet50", "resnet", ExportConfig("torchvision-resnet50")),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None
