"""Application builder: `serve_app.app:build_app` is the Serve config's import_path."""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment

from serve_app.config import AppArgs, RouterLiveConfig, deployment_plan, pool_deployment
from serve_app.exports import load_problem
from serve_app.families import load
from serve_app.models.pool import ModelPool
from serve_app.models.unavailable import UnavailableModel
from serve_app.router.ingress import Router
from serve_app.router.parts import router_capacity
from serve_app.router.routing.replicas import ROUTER_DEPLOYMENT
from serve_app.sources import is_remote


def as_deployment(decorated: object) -> Deployment:
    """What `@serve.deployment` made of a class. Ray types the decorator as returning the class
    itself, so the checker would not see `.options`/`.bind` without this."""
    return cast(Deployment, decorated)


POOL_ROUTER = "serve_app.router.routing.pool_router:PoolRouter"


def bind_pools(args: AppArgs) -> dict[str, Any]:
    """One deployment per multiplexed entry, serving its models (serve_app.models.pool) under the
    pool's request router (serve_app.router.routing.pool_router)."""
    bound = {}
    for pattern, entry in args.pools.items():
        assert entry.multiplex is not None, "a pool entry always multiplexes (config.expand_pools)"
        sources = {name: args.model_source(name) for name, m in args.models.items() if m.pool == pattern}
        config = entry.model_copy(update={"tracing": args.tracing, "multiplex": None, "path": None})
        multiplex = entry.multiplex
        placement = {
            "max_models": multiplex.max_models_per_replica,
            "busy_batches": multiplex.busy_batches,
            "second_copies": multiplex.second_copies,
        }
        router = RequestRouterConfig.model_validate({"request_router_class": POOL_ROUTER, "request_router_kwargs": placement})
        bound[pattern] = (
            as_deployment(ModelPool)
            .options(name=pool_deployment(pattern), user_config=entry.tuning().model_dump(), request_router_config=router)
            .bind(pattern, sources, config.model_dump(mode="json"), multiplex.max_models_per_replica, str(entry.path))
        )
    return bound


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
    pools = bind_pools(args)
    for name, served in args.served.items():
        model = served.config
        # A pool's model in an object store is checked when a replica first loads it: checking
        # here would fetch every model of the pool to the node that builds the app.
        remote_member = model.pool is not None and is_remote(args.model_source(name))
        if not remote_member and (problem := load_problem(args, name)) is not None:
            # One line in the log, 503 with the reason for its requests; the other models serve.
            handles[name] = as_deployment(UnavailableModel).options(name=name).bind(name, problem)
            unavailable[name] = problem
            continue
        if model.pool is not None:  # one of a multiplexed pool's models: the pool's deployment serves it
            handles[name] = pools[model.pool]
            continue
        plan = deployment_plan(args.family_of(name), model)  # its family's deployment (serve_app.families)
        handles[name] = (
            as_deployment(load(plan.target))
            .options(
                name=name,
                user_config=model.tuning().model_dump(),
                max_ongoing_requests=plan.max_ongoing_requests,
                max_queued_requests=plan.max_queued_requests,
            )
            .bind(name, args.model_source(name), model.model_copy(update={"tracing": args.tracing}).model_dump(mode="json"))
        )
    # Routes and models travel to the router as plain data plus handles.
    # The traffic policy is the router's user_config: `serve deploy` changes it on running
    # routers, where a change of the args would restart every replica of the application.
    live = RouterLiveConfig(traffic=args.traffic)
    args = args.model_copy(update={"unavailable": unavailable})
    return (
        as_deployment(Router)
        .options(name=ROUTER_DEPLOYMENT, max_ongoing_requests=router_capacity(args), user_config=live.model_dump(mode="json"))
        .bind(args.model_dump(mode="json"), handles, pools)
    )
