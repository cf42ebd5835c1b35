"""Application builder: `serve_app.app:build_app` is the Serve config's import_path."""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.deployment import Deployment

from serve_app.config import AppArgs
from serve_app.models.classifier import ImageClassifier, TextClassifier
from serve_app.models.generator import TextGenerator
from serve_app.router.ingress import Router

DEPLOYMENT_FOR_FAMILY: dict[str, Deployment] = {
    "bert": TextClassifier,
    "resnet": ImageClassifier,
    "gpt": TextGenerator,
}


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """Bind one deployment per model (named like the model) behind the router.

    Ray passes a typed builder a validated model only when the annotation is a
    class at runtime; with postponed annotations it is a string, so accept both.
    """
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    handles = {}
    for name, model in args.models.items():
        assert model.family is not None, "validated config always has a family"
        deployment = DEPLOYMENT_FOR_FAMILY[model.family]
        batch = model.batching.max_batch_size
        handles[name] = deployment.options(
            name=name,
            user_config=model.tuning().model_dump(),
            # Generators batch with @serve.batch, which fills only when a replica may hold a
            # full batch of requests (ray-project/ray#43288). Classifiers get whole batches
            # from the router, about two at a time per replica; the rest is headroom for
            # several routers.
            max_ongoing_requests=max(2 * batch, 8) if model.family == "gpt" else 16,
        ).bind(name, str(args.model_path(name)), model.model_dump(mode="json"))
    # Routes and models travel to the router as plain data plus handles.
    return Router.options(name="router").bind(args.model_dump(mode="json"), handles)
