from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import build_app
from serve_app.config import MODEL_DIR_ENV, AppArgs
from serve_app.tools.catalog_build import load_app_args

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "configs" / "local.yaml", ROOT / "configs" / "gpu.yaml"]
DEFAULT_CATALOG = {"bert-light", "bert-heavy", "resnet-light", "resnet-heavy", "gpt"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid_serve_configs(path):
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (args,) = load_app_args(path)
    assert set(args.models) == DEFAULT_CATALOG
    assert set(args.routes) == {"text-classify", "image-classify"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_request_level_generator_may_hold_a_full_batch(path):
    # ray-project/ray#43288: @serve.batch never fills when max_ongoing_requests < max_batch_size.
    # The builder sets max_ongoing_requests; a shipped YAML must not cap it lower either.
    raw = yaml.safe_load(path.read_text())["applications"][0]
    for d in raw["deployments"]:
        assert "max_ongoing_requests" not in d or d["name"] not in raw["args"]["models"], d["name"]
    raw["args"]["models"]["gpt"].setdefault("generation", {})["scheduler"] = "request"
    args = AppArgs.model_validate(raw["args"])
    router: Any = build_app(args)._bound_deployment
    handles = router.init_args[1]  # the router's (args, handles)
    gpt = handles["gpt"]._bound_deployment
    assert gpt.max_ongoing_requests >= args.models["gpt"].batching.max_batch_size


def test_gpu_config_packs_min_replicas_onto_one_gpu():
    doc = yaml.safe_load(CONFIGS[1].read_text())
    gpus = [d["ray_actor_options"].get("num_gpus", 0) for d in doc["applications"][0]["deployments"]]
    assert 0 < sum(gpus) <= 1.0
    assert all(g < 1 for g in gpus)


def _args(**routes):
    return {"models": {"a": {"preset": "bert-tiny"}, "b": {"preset": "bert-tiny"}, "g": {"preset": "gpt-tiny"}}, "routes": routes}


def test_route_to_unknown_model_is_rejected():
    with pytest.raises(ValidationError, match="unknown model 'zzz'"):
        AppArgs.model_validate(_args(r={"light": "a", "heavy": "zzz"}))


def test_route_must_join_classifiers_of_one_family():
    with pytest.raises(ValidationError, match="two classifiers of one family"):
        AppArgs.model_validate(_args(r={"light": "a", "heavy": "g"}))


def test_route_name_cannot_shadow_a_model():
    with pytest.raises(ValidationError, match="same name as a model"):
        AppArgs.model_validate(_args(a={"light": "a", "heavy": "b"}))


def test_model_without_preset_needs_family():
    with pytest.raises(ValidationError, match="explicit `family`"):
        AppArgs.model_validate({"models": {"mine": {"path": "/models/mine"}}})
    args = AppArgs.model_validate({"models": {"mine": {"path": "/models/mine", "family": "resnet"}}})
    assert args.model_path("mine") == Path("/models/mine")


def test_unknown_preset_is_an_actionable_error():
    with pytest.raises(ValidationError, match="known presets"):
        AppArgs.model_validate({"models": {"x": {"preset": "bert-huge"}}})


def test_batching_bounds():
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"models": {"x": {"preset": "bert-tiny", "batching": {"max_batch_size": 0}}}})


@pytest.mark.parametrize(
    "args",
    [
        {"models": {"x": {"preset": "bert-tiny", "batching": {"max_batch_sizes": 64}}}},
        {"models": {"x": {"preset": "bert-tiny", "max_batch_size": 64}}},
        {"models": {"x": {"preset": "bert-tiny"}}, "scheduling": {"router_delay_target": 50}},
        {"models": {"x": {"preset": "bert-tiny"}}, "cache": {"enabled": True, "max_byte": 1024}},
    ],
    ids=["batching", "model", "scheduling", "cache"],
)
def test_a_misspelt_knob_is_a_config_error_not_a_silent_default(args):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppArgs.model_validate(args)


def test_a_misspelt_live_knob_is_refused_too():
    from serve_app.config import ReplicaTuning, RouterLiveConfig

    with pytest.raises(ValidationError, match="Extra inputs"):
        ReplicaTuning.model_validate({"max_batch_size": 8, "fault": {"error_rate": 0.5}})
    with pytest.raises(ValidationError, match="Extra inputs"):
        RouterLiveConfig.model_validate({"trafic": {}})


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"max_waiting": 0}, "greater than or equal to 1"),  # every generation would be refused, slots free or not
        ({"default_max_tokens": 64, "max_tokens_limit": 16}, "every request without max_tokens would be refused"),
    ],
)
def test_generation_settings_that_would_refuse_every_request_are_rejected(generation, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate({"models": {"g": {"preset": "gpt-tiny", "generation": generation}}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"traffic": {"bert-heavy": {"weights": {"1": float("inf"), "2": 1}}}}, "finite"),
        ({"traffic": {"bert-heavy": {"weights": {"1": 1e308, "2": 1e308}}}}, "finite"),  # the sum overflows
        ({"traffic": {"bert-heavy": {"weights": {"1": 9, "2": 1}, "sticky": "tenant"}}}, "no tenants are configured"),
        ({"tenants": [{"name": "t", "key_sha256": "zz"}]}, "64 hex characters"),
    ],
)
def test_traffic_and_keys_that_would_misroute_or_stop_the_router_are_config_errors(change, message):
    models = {"bert-heavy": {"preset": "bert-tiny", "versions": {"2": {"preset": "bert-tiny"}}}}
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate({"models": models, **change})


def test_model_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVE_APP_MODEL_DIR", str(tmp_path))
    args = AppArgs.model_validate({"models": {"x": {"preset": "bert-tiny"}}})
    assert args.model_path("x") == tmp_path / "x"


def test_the_router_can_hold_everything_its_queues_admit():
    """Else the proxy queues the overflow in arrival order, ahead of the router's priority queues."""
    import yaml

    from serve_app.config import AppArgs
    from serve_app.router.parts import ROUTER_HEADROOM, router_capacity

    args = AppArgs.model_validate(yaml.safe_load(CONFIGS[0].read_text())["applications"][0]["args"])
    assert router_capacity(args) == len(args.served) * args.scheduling.max_queue_items + ROUTER_HEADROOM
    # ... and the router deployment is built with it.
    assert build_app(args)._bound_deployment.max_ongoing_requests == router_capacity(args)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_calls_waiting_for_a_full_generator_are_bounded_and_classifiers_are_not(path, tiny_model_dir, monkeypatch):
    """Past its running and waiting rows, a continuous-batching generator's callers queue at most
    as many calls again in Serve (then 503 + Retry-After); classifier batches are bounded by the
    router's own queues instead."""
    monkeypatch.setenv(MODEL_DIR_ENV, str(tiny_model_dir))  # the builder binds a model only when its files load
    raw = yaml.safe_load(path.read_text())["applications"][0]
    args = AppArgs.model_validate(raw["args"])
    router: Any = build_app(args)._bound_deployment
    handles = router.init_args[1]  # the router's (args, handles)
    assert router.init_args[0]["unavailable"] == {}
    gpt = handles["gpt"]._bound_deployment
    generation = args.models["gpt"].generation
    assert gpt.max_queued_requests == generation.kv_slots + generation.max_waiting > 0
    assert all(h._bound_deployment.max_queued_requests == -1 for name, h in handles.items() if name != "gpt")


def test_a_model_whose_files_are_missing_is_bound_as_its_stand_in_and_named_to_the_router(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path))  # nothing built there
    args = AppArgs.model_validate(yaml.safe_load(CONFIGS[0].read_text())["applications"][0]["args"])
    router: Any = build_app(args)._bound_deployment
    unavailable = router.init_args[0]["unavailable"]
    assert set(unavailable) == set(args.served)
    assert all("\n" not in reason and "serve-app models build" in reason for reason in unavailable.values()), unavailable
    assert {h._bound_deployment.func_or_class.__name__ for h in router.init_args[1].values()} == {"UnavailableModel"}


def test_a_classifiers_stall_timeout_past_the_routers_batch_timeout_is_a_config_error():
    args = _args()
    args["scheduling"] = {"batch_timeout_s": 20}
    args["models"]["g"]["stall_timeout_s"] = 60  # a decode step: the routers' batch timeout is not its bound
    args["models"]["a"]["stall_timeout_s"] = 20
    valid = AppArgs.model_validate(args)
    assert valid.deployment_config("b").stall_timeout_s == 20  # its default follows the lowered batch timeout
    assert valid.deployment_config("g").stall_timeout_s == 60
    args["models"]["b"]["versions"] = {"2": {"preset": "bert-tiny", "stall_timeout_s": 25}}
    with pytest.raises(ValidationError, match=r"b-v2: stall_timeout_s 25 is above scheduling\.batch_timeout_s 20"):
        AppArgs.model_validate(args)


def test_a_stall_timeout_default_that_follows_the_batch_timeout_leaves_the_callers_config_alone():
    from serve_app.config import ModelConfig

    held = ModelConfig.model_validate({"preset": "bert-tiny"})
    args = AppArgs.model_validate({"models": {"b": held}, "scheduling": {"batch_timeout_s": 10}})
    assert args.deployment_config("b").stall_timeout_s == 10 and args.models["b"].stall_timeout_s == 10
    assert held.stall_timeout_s == 30  # another AppArgs may take it under another batch timeout
    assert AppArgs.model_validate({"models": {"b": held}}).deployment_config("b").stall_timeout_s == 30


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_is_a_valid_serve_config_whose_app_args_validate(path):
    """The benchmark configs too: a bad field there would only show on the machine it was made for."""
    from serve_app.config import ReplicaTuning, RouterLiveConfig

    raw = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(raw)
    assert all(args.models for args in load_app_args(path))
    # A deployment's user_config is applied on the cluster only: a bad field there would stop the
    # routers reconfiguring, or a model's replicas starting, where nothing here would see it.
    for app in raw["applications"]:
        for d in app.get("deployments", []):
            if "user_config" in d:
                (RouterLiveConfig if d["name"] == "router" else ReplicaTuning).model_validate(d["user_config"])


def test_a_bad_field_in_a_version_override_names_the_version():
    with pytest.raises(ValidationError, match="version '2': max_batch_sizes: Extra inputs are not permitted"):
        AppArgs.model_validate({"models": {"b": {"preset": "bert-tiny", "versions": {"2": {"max_batch_sizes": 4}}}}})


def _pool_dir(tmp_path: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / "reviews-notes.txt").write_text("a file, not a model directory")
    return tmp_path


def test_a_multiplexed_entry_is_one_model_per_matching_directory(tmp_path: Path):
    root = _pool_dir(tmp_path, ("reviews-en", "reviews-de", "other"))
    entry = {"family": "bert", "path": str(root), "multiplex": {"max_models_per_replica": 3}}
    args = AppArgs.model_validate({"models": {"reviews-*": entry, "solo": {"preset": "bert-tiny"}}})
    assert sorted(args.models) == ["reviews-de", "reviews-en", "solo"]
    assert args.models["reviews-en"].pool == "reviews-*" and args.models["solo"].pool is None
    assert args.model_path("reviews-de") == (root / "reviews-de").resolve()
    assert args.pools["reviews-*"].multiplex is not None and args.pools["reviews-*"].multiplex.max_models_per_replica == 3
    # The router validates the dumped args again: the pool is not expanded twice.
    again = AppArgs.model_validate(args.model_dump(mode="json"))
    assert sorted(again.models) == sorted(args.models) and list(again.pools) == ["reviews-*"]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"family": "bert", "path": "{root}"}, "give it `multiplex`"),
        ({"family": "bert", "path": "{root}/nowhere", "multiplex": {}}, "not a local directory"),
        ({"family": "bert", "path": "gs://bucket/pool", "multiplex": {}}, "use a local path or s3://"),
        ({"family": "bert", "path": "{root}", "multiplex": {}, "versions": {"2": {}}}, "no versions"),
    ],
)
def test_a_multiplexed_entry_is_checked(tmp_path: Path, entry: dict[str, Any], problem: str):
    root = _pool_dir(tmp_path, ("reviews-en",))
    entry = {k: v.format(root=root) if isinstance(v, str) else v for k, v in entry.items()}
    with pytest.raises(ValidationError, match=problem):
        AppArgs.model_validate({"models": {"reviews-*": entry}})


def test_a_pool_with_no_match_or_a_name_taken_is_refused(tmp_path: Path):
    root = _pool_dir(tmp_path, ("reviews-en",))
    with pytest.raises(ValidationError, match="no model directory"):
        AppArgs.model_validate({"models": {"films-*": {"family": "bert", "path": str(root), "multiplex": {}}}})
    entry = {"family": "bert", "path": str(root), "multiplex": {}}
    with pytest.raises(ValidationError, match="both a model of its own"):
        AppArgs.model_validate({"models": {"reviews-*": entry, "reviews-en": {"preset": "bert-tiny"}}})


def test_a_model_directory_put_under_a_pool_later_becomes_one_of_its_models(tmp_path: Path):
    root = _pool_dir(tmp_path, ("reviews-en",))
    entry = {"family": "bert", "path": str(root), "multiplex": {}, "batching": {"max_batch_size": 4}}
    built = AppArgs.model_validate({"models": {"reviews-*": entry, "solo": {"preset": "bert-tiny"}}})
    args = AppArgs.model_validate(built.model_dump(mode="json"))  # as the router has it
    (root / "reviews-it").mkdir()
    assert args.pool_candidates("reviews-*") == ["reviews-en", "reviews-it"]
    for name in ("reviews-a/b", "reviews-..", "other", "reviews-x y"):
        assert args.pools_for(name) == [] and args.add_pool_member("reviews-*", name) is False
    assert args.add_pool_member("reviews-*", "solo") is False  # a model of its own is no pool's
    assert args.pools_for("reviews-it") == ["reviews-*"]
    assert args.add_pool_member("reviews-*", "reviews-it") is True
    assert args.versions("reviews-it") == {"1": "reviews-it"} and args.served["reviews-it"].model == "reviews-it"
    assert args.model_path("reviews-it") == (root / "reviews-it").resolve()
    # The same entry as the models the pool was built with, but for its directory.
    assert args.models["reviews-it"].model_dump(exclude={"path"}) == args.models["reviews-en"].model_dump(exclude={"path"})


def test_a_pool_deployment_is_named_after_its_pattern():
    from serve_app.config import pool_deployment

    assert pool_deployment("reviews-*") == "reviews-pool" and pool_deployment("*") == "pool"
    assert pool_deployment("bert_*_v2") == "bert-v2-pool"


def test_a_pool_model_may_send_one_batch_past_a_busy_holder_so_a_second_copy_can_load(tmp_path: Path):
    """The dispatcher of a pool's model starts with busy_batches + 1 batches in flight: the one
    past a busy holder is what the placement sends to a second replica. Without second copies,
    or for a model of its own, the dispatcher's default."""
    from serve_app.router.routing.dispatchers import DispatcherPool
    from serve_app.scheduling.protection.limit import AdaptiveLimit

    root = _pool_dir(tmp_path, ("reviews-en",))
    for second_copies, expected in ((True, 4.0), (False, AdaptiveLimit().initial)):
        entry = {"family": "bert", "path": str(root), "multiplex": {"busy_batches": 3, "second_copies": second_copies}}
        args = AppArgs.model_validate({"models": {"reviews-*": entry, "solo": {"preset": "bert-tiny"}}})
        pool = DispatcherPool(args, send_for=lambda model: None)  # type: ignore[arg-type, return-value]
        assert pool.get("reviews-en").bulk.limit.value == expected
        assert pool.get("solo").bulk.limit.value == AdaptiveLimit().initial


def test_a_pool_runs_without_an_urgent_lane_unless_its_entry_asks(tmp_path: Path):
    root = _pool_dir(tmp_path, ("reviews-en",))
    entry = {"family": "bert", "path": str(root), "multiplex": {}}
    args = AppArgs.model_validate({"models": {"reviews-*": entry, "solo": {"preset": "bert-tiny"}}})
    assert not args.models["reviews-en"].advanced.urgent_lane and not args.pools["reviews-*"].advanced.urgent_lane
    assert args.models["solo"].advanced.urgent_lane  # a model of its own keeps the default
    asked = AppArgs.model_validate({"models": {"reviews-*": {**entry, "urgent_lane": True}}})
    assert asked.models["reviews-en"].advanced.urgent_lane and asked.pools["reviews-*"].advanced.urgent_lane


def test_a_model_added_under_a_lower_batch_timeout_gets_the_stall_timeout_the_build_gives_its_pool(tmp_path: Path):
    root = _pool_dir(tmp_path, ("reviews-en",))
    data = {
        "models": {"reviews-*": {"family": "bert", "path": str(root), "multiplex": {}}},
        "scheduling": {"batch_timeout_s": 10},
    }
    args = AppArgs.model_validate(AppArgs.model_validate(data).model_dump(mode="json"))  # as the router has it
    assert args.add_pool_member("reviews-*", "reviews-it") is True
    assert args.models["reviews-it"].stall_timeout_s == args.models["reviews-en"].stall_timeout_s == 10
