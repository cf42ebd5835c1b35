"""Cache keys name what answers: a deployment redeployed under the same name with another model,
version, precision or generation defaults gets new keys, so a shared cache that outlived the
redeploy never returns the old model's answers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from serve_app.config import AppArgs
from serve_app.manifest import Manifest
from serve_app.router.routing.answer_ids import AnswerIds
from tests.conftest import tiny_args


def _id(args: dict[str, Any], deployment: str, manifest: Manifest | None) -> str:
    return AnswerIds(AppArgs.model_validate(args), lambda name: manifest).of(deployment)


def test_the_id_follows_the_deployments_config_and_manifest(tiny_model_dir: Path):
    args = tiny_args(tiny_model_dir)
    manifest = Manifest.load(tiny_model_dir / "bert-heavy")
    base = _id(args, "bert-heavy", manifest)
    assert base.startswith("bert-heavy@") and base == _id(copy.deepcopy(args), "bert-heavy", manifest)

    changed = []
    for change in (
        {"path": str(tiny_model_dir / "bert-light")},  # other weights under the same name
        {"version": "7"},
        {"precision": "int8"},
    ):
        other = copy.deepcopy(args)
        other["models"]["bert-heavy"].update(change)
        changed.append(_id(other, "bert-heavy", manifest))
    rebuilt = manifest.model_copy(update={"source": {**manifest.source, "fingerprint": "another build"}})
    changed.append(_id(args, "bert-heavy", rebuilt))
    changed.append(_id(args, "bert-heavy", None))  # no manifest at hand: the config alone
    assert len({base, *changed}) == 6, changed

    gen = copy.deepcopy(args)
    gen["models"]["gpt"]["generation"]["default_max_tokens"] = 9  # requests without max_tokens answer differently
    gpt = Manifest.load(tiny_model_dir / "gpt")
    assert _id(gen, "gpt", gpt) != _id(args, "gpt", gpt)


def test_each_deployment_asks_for_its_manifest_once(tiny_model_dir: Path):
    asked: list[str] = []
    manifest = Manifest.load(tiny_model_dir / "bert-heavy")

    def manifest_of(name: str) -> Manifest:
        asked.append(name)
        return manifest

    ids = AnswerIds(AppArgs.model_validate(tiny_args(tiny_model_dir)), manifest_of)
    first, _, again = (ids.of(d) for d in ("bert-heavy", "bert-light", "bert-heavy"))
    assert first == again and asked == ["bert-heavy", "bert-light"]


def test_the_router_takes_a_manifest_it_has_at_hand_and_never_asks_a_replica(tiny_model_dir: Path):
    from serve_app.router.routing.catalog import ModelCatalog

    async def fetch(model: str) -> dict[str, Any]:
        raise AssertionError(f"asked a replica of {model}")  # it could be at zero replicas

    args = tiny_args(tiny_model_dir)
    args["models"]["elsewhere"] = {"preset": "bert-tiny", "path": str(tiny_model_dir / "not-on-this-node")}
    catalog = ModelCatalog(AppArgs.model_validate(args), fetch)
    assert catalog.manifest_at_hand("bert-heavy") == Manifest.load(tiny_model_dir / "bert-heavy")
    assert catalog.manifest_at_hand("elsewhere") is None
