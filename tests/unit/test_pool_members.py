"""Models added to a multiplexed pool at run time (serve_app.router.routing.members), without Ray:
what a load checks, and what a router learns when it adds one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.errors import InvalidInput, NotFound
from serve_app.router.routing.members import PoolMembers


def members(tiny_model_dir: Path, root: Path) -> PoolMembers:
    shutil.copytree(tiny_model_dir / "bert-light", root / "reviews-en")
    entry = {"family": "bert", "path": str(root), "multiplex": {"max_models_per_replica": 2}}
    args = AppArgs.model_validate(AppArgs.model_validate({"models": {"reviews-*": entry}}).model_dump(mode="json"))
    handles: dict[str, Any] = {"reviews-en": ("pool", "reviews-en")}
    return PoolMembers(args, handles, {"reviews-*": "pool"}, {"reviews-en": "1"}, multiplexed=lambda h, name: (h, name))


def test_a_load_checks_the_directory_and_its_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = members(tiny_model_dir, tmp_path)
    assert pool.candidates() == []
    with pytest.raises(NotFound, match="no model directory reviews-it"):
        pool.check("reviews-it")
    with pytest.raises(NotFound, match="unknown model 'films-it'"):
        pool.check("films-it")
    (tmp_path / "reviews-empty").mkdir()
    with pytest.raises(InvalidInput, match="failed to load 'reviews-empty'"):
        pool.check("reviews-empty")
    shutil.copytree(tiny_model_dir / "bert-light", tmp_path / "reviews-it")
    assert pool.candidates() == ["reviews-empty", "reviews-it"]
    pool.check("reviews-it")


def test_an_added_model_gets_the_pools_handle_and_its_first_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = members(tiny_model_dir, tmp_path)
    shutil.copytree(tiny_model_dir / "bert-light", tmp_path / "reviews-it")
    pool.adopt(["reviews-it", "reviews-it", "films-it"])  # twice, and one that fits no pool: skipped
    assert pool.handles["reviews-it"] == ("pool", "reviews-it")
    assert pool.first_versions == {"reviews-en": "1", "reviews-it": "1"}
    assert "films-it" not in pool.args.models and pool.args.models["reviews-it"].pool == "reviews-*"
    assert pool.candidates() == []
