"""Application builder: `serve_app.app:build_app` is the Serve config's import_path."""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application
from ray.serve.deployment import Deployment

from serve_app.config import AppArgs, RouterLiveConfig
from serve_app.exports import Declared, ExportProblems, discover
from serve_app.models.classifier import ImageClassifier, TextClassifier
from serve_app.models.generation.generator import TextGenerator
from serve_app.models.generation.generator_static import RequestBatchGenerator
from serve_app.models.unavailable import UnavailableModel
from serve_app.router.ingress import Router
from serve_app.router.parts import router_capacity
from serve_app.router.routing.replicas import ROUTER_DEPLOYMENT
from serve_app.sources import local_path


def as_deployment(decorated: object) -> Deployment:
    """What `@serve.deployment` made of a class. Ray types the decorator as returning the class
    itself, so the checker would not see `.options`/`.bind` without this."""
    return cast(Deployment, decorated)


DEPLOYMENT_FOR_FAMILY: dict[str, Deployment] = {
    "bert": as_deployment(TextClassifier),
    "resnet": as_deployment(ImageClassifier),
    "gpt": as_deployment(TextGenerator),
}


def load_problem(args: AppArgs, deployment: str) -> str | None:
    """Why a deployment's model cannot load, in one line, or None when its files are in order:
    the checks a replica's start would fail, made once here, where a failure costs no restarts."""
    config = args.deployment_config(deployment)
    try:
        model_dir, manifest = discover(local_path(args.model_source(deployment)), Declared.of(deployment, config))
        graph = manifest.onnx_file_for(config.precision)  # the variant the config asks for, built beside FP32
    except ExportProblems as e:
        return "; ".join(e.problems)
    except OSError as e:  # an unreadable directory, an object store that refused, a variant never built
        return str(e)
    if not (model_dir / graph).is_file():
        return f"{graph} is missing from {model_dir}: run `serve-app models build` for this config"
    return None


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """Bind one deployment per model version (named like the model, `<model>-v<version>` for its
    further versions) behind the router.

    Ray passes a typed builder a validated model only when the annotation is a
    class at runtime; with postponed annotations it is a string, so accept both.
    """
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    handles = {}
    unavailable: dict[str, str] = {}
    for name, served in args.served.items():
        model = served.config
        assert model.family is not None, "validated config always has a family"
        if (problem := load_problem(args, name)) is not None:
            # One line in the log, 503 with the reason for its requests; the other models serve.
            handles[name] = as_deployment(UnavailableModel).options(name=name).bind(name, problem)
            unavailable[name] = problem
            continue
        deployment = DEPLOYMENT_FOR_FAMILY[model.family]
        # Classifiers get whole batches from the router, about two at a time per replica;
        # the rest is headroom for several routers.
        ongoing, queued = 16, -1
        if model.family == "gpt" and model.generation.scheduler == "request":
            deployment = as_deployment(RequestBatchGenerator)
            # @serve.batch fills only when a replica may hold a full batch (ray-project/ray#43288).
            ongoing = max(2 * model.batching.max_batch_size, 8)
        elif model.family == "gpt":
            # Every sequence it can run or queue, plus a few that its scheduler refuses with a
            # 503 and Retry-After rather than leaving them queued, unbounded, at the caller.
            ongoing = model.generation.kv_slots + model.generation.max_waiting + 8
            # Past that, calls wait in Serve's queue at the caller, in arrival order and without
            # bound, until clients time out: bound it, and refuse the rest there (503 +
            # Retry-After, serve_app.router.endpoints.generation). Every call passes through that queue on
            # its way to a replica, so the bound holds a burst as large as a replica's rows.
            queued = model.generation.kv_slots + model.generation.max_waiting
        handles[name] = deployment.options(
            name=name,
            user_config=model.tuning().model_dump(),
            max_ongoing_requests=ongoing,
            max_queued_requests=queued,
        ).bind(name, args.model_source(name), model.model_copy(update={"tracing": args.tracing}).model_dump(mode="json"))
    # Routes and models travel to the router as plain data plus handles.
    # The traffic policy is the router's user_config: `serve deploy` changes it on running
    # routers, where a change of the args would restart every replica of the application.
    live = RouterLiveConfig(traffic=args.traffic)
    args = args.model_copy(update={"unavailable": unavailable})
    return (
        as_deployment(Router)
        .options(name=ROUTER_DEPLOYMENT, max_ongoing_requests=router_capacity(args), user_config=live.model_dump(mode="json"))
        .bind(args.model_dump(mode="json"), handles)
    )
