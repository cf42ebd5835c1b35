"""The router's model catalog without Ray: names, routes, manifests and live readiness."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.errors import NotFound
from serve_app.router.catalog import ModelCatalog
from tests.conftest import tiny_args


class Replicas:
    """The models' metadata calls: answered while `up`, failing (as a dead deployment's would) otherwise."""

    def __init__(self) -> None:
        self.up = True
        self.calls = 0

    async def fetch(self, model: str) -> dict[str, Any]:
        self.calls += 1
        if not self.up:
            raise RuntimeError("no replicas")
        manifest = {"name": model, "family": "bert", "inputs": [], "outputs": [], "version": "1"}
        return {"manifest": manifest, "batching": {"max_batch_size": 8}}


def catalog(replicas: Replicas) -> ModelCatalog:
    return ModelCatalog(AppArgs.model_validate(tiny_args(Path("/nonexistent"))), replicas.fetch)


def test_readiness_follows_the_replicas_and_not_the_cached_manifest():
    replicas = Replicas()
    c = catalog(replicas)
    assert asyncio.run(c.all_ready(["bert-heavy"]))
    replicas.up = False
    assert not asyncio.run(c.all_ready(["bert-heavy"]))  # the manifest is cached; readiness is not
    assert asyncio.run(c.manifest("bert-heavy")).version == "1"  # metadata still answers from the cache
    replicas.up = True
    assert asyncio.run(c.all_ready(["bert-heavy"]))


def test_names_routes_and_versions():
    c = catalog(Replicas())
    assert c.members("text-classify") == ["bert-light", "bert-heavy"] and c.members("gpt") == ["gpt"]
    assert c.answering_model("text-classify") == "bert-light" and c.platform("text-classify") == "ensemble"
    assert c.generators() == ["gpt"]
    with pytest.raises(NotFound, match="available"):
        c.known("nope")
    assert c.deployment("bert-heavy", "1") == c.deployment("bert-heavy", None) == "bert-heavy"
    assert c.deployment("text-classify", "1") == "bert-light" and c.versions("text-classify") == ["1"]
    with pytest.raises(NotFound, match="no version '2'"):
        c.deployment("bert-heavy", "2")
    with pytest.raises(NotFound, match="no version '2'"):
        c.deployment("text-classify", "2")
