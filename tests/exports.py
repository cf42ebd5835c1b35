"""Tiny exports made as users make them (serve_app.zoo.hub), built once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serve_app.zoo import hub
from serve_app.zoo.hub import IMAGENET

__all__ = ["IMAGENET", "IMAGE_SIZE", "Exports", "build_exports"]
IMAGE_SIZE = 64


@dataclass(frozen=True)
class Exports:
    root: Path

    @property
    def bert(self) -> Path:
        return self.root / "bert"

    @property
    def gpt2(self) -> Path:
        return self.root / "gpt2"

    @property
    def llama(self) -> Path:
        return self.root / "llama"

    @property
    def resnet(self) -> Path:
        return self.root / "resnet"

    def checkpoint(self, name: str) -> Path:
        return self.root / f"{name}-checkpoint"


def build_exports(root: Path) -> Exports:
    e = Exports(root)
    hub.hf_text_classifier(e.bert, checkpoint=e.checkpoint("bert"))
    hub.hf_gpt2(e.gpt2, checkpoint=e.checkpoint("gpt2"))
    hub.hf_llama(e.llama, checkpoint=e.checkpoint("llama"))
    hub.torchvision_resnet(e.resnet, 18, num_classes=10, image_size=IMAGE_SIZE, keep_weights=True)
    return e
