"""Models added to a multiplexed pool at run time (serve_app.router.routing.members), without Ray:
what a load checks, and what a router learns when it adds one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import AppArgs
from serve_app.errors import InvalidInput, NotFound, Unavailable
from serve_app.router.routing.members import PoolMembers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def members(tiny_model_dir: Path, root: Path, clock: Clock | None = None, pools: dict[str, Path] | None = None) -> PoolMembers:
    shutil.copytree(tiny_model_dir / "bert-light", root / "reviews-en")
    entries = {"reviews-*": {"family": "bert", "path": str(root), "multiplex": {"max_models_per_replica": 2}}}
    entries |= {pattern: {"family": "bert", "path": str(path), "multiplex": {}} for pattern, path in (pools or {}).items()}
    args = AppArgs.model_validate(AppArgs.model_validate({"models": entries}).model_dump(mode="json"))
    handles: dict[str, Any] = {name: ("pool", name) for name in args.models}
    return PoolMembers(
        args, handles, {p: f"pool {p}" for p in entries}, {name: "1" for name in args.models},
        multiplexed=lambda h, name: (h, name), clock=clock or Clock(),
    )  # fmt: skip


def test_a_load_checks_the_directory_and_its_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    clock = Clock()
    pool = members(tiny_model_dir, tmp_path, clock)
    assert pool.candidates(pool.listed()) == []
    with pytest.raises(NotFound, match="no model directory reviews-it"):
        pool.find("reviews-it")
    with pytest.raises(NotFound, match="no pool's pattern fits"):
        pool.find("films-it")
    (tmp_path / "reviews-empty").mkdir()
    with pytest.raises(InvalidInput, match="failed to load 'reviews-empty'"):
        pool.find("reviews-empty")
    shutil.copytree(tiny_model_dir / "bert-light", tmp_path / "reviews-it")
    assert pool.candidates(pool.listed()) == []  # the listing is kept for a few seconds
    clock.now = 10.0
    assert pool.candidates(pool.listed()) == ["reviews-empty", "reviews-it"]
    pattern, config = pool.find("reviews-it")
    assert pattern == "reviews-*" and config.path == str((tmp_path / "reviews-it").resolve())


def test_of_two_pools_whose_patterns_fit_a_name_the_one_whose_path_holds_it_gets_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    big = tmp_path / "big"
    shutil.copytree(tiny_model_dir / "bert-light", big / "reviews-big-en")
    pool = members(tiny_model_dir, tmp_path / "small", pools={"reviews-big-*": big})
    shutil.copytree(tiny_model_dir / "bert-light", big / "reviews-big-it")
    assert pool.find("reviews-big-it")[0] == "reviews-big-*"
    pool.adopt({"reviews-big-it": "reviews-big-*"})
    assert pool.args.model_path("reviews-big-it") == (big / "reviews-big-it").resolve()


def test_a_pool_that_cannot_be_listed_is_a_503_not_a_404(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = members(tiny_model_dir, tmp_path / "pool")
    shutil.rmtree(tmp_path / "pool")
    with pytest.raises(Unavailable, match="cannot be listed"):
        pool.find("reviews-it")


def test_an_added_model_gets_the_pools_handle_and_its_first_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = members(tiny_model_dir, tmp_path)
    shutil.copytree(tiny_model_dir / "bert-light", tmp_path / "reviews-it")
    # Twice, and one that fits no pool and one for a pool this application lacks: both skipped.
    pool.adopt({"reviews-it": "reviews-*", "films-it": "reviews-*", "x": "films-*"})
    pool.adopt({"reviews-it": "reviews-*"})
    assert pool.handles["reviews-it"] == ("pool reviews-*", "reviews-it")
    assert pool.first_versions == {"reviews-en": "1", "reviews-it": "1"}
    assert "films-it" not in pool.args.models and pool.args.models["reviews-it"].pool == "reviews-*"
    assert pool.candidates(pool.listed()) == []
