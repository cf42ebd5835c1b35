"""A Serve application of your own that calls serve-app's models by handle.

`Moderator` reads a post (a text and a PNG or JPEG picture) and asks `bert-light` about the text
and `resnet-heavy` about the picture, both at once. Each call sends one input; the model's replica
batches it with every other caller's (`@serve.batch`), the router's traffic included, and answers
a `Prediction` (label, logits, probabilities) or raises the project's typed error
(`serve_app.errors.InvalidInput` for an input the model cannot take).

Run it beside the serve-app application (named "default" by `serve run configs/local.yaml`):

    serve.run(Moderator.bind(), name="moderator", route_prefix="/moderate")
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from ray import serve
from starlette.requests import Request

from serve_app.models.prediction import Prediction


@serve.deployment
class Moderator:
    def __init__(self, app: str = "default") -> None:
        # Handles by deployment name: a model's deployment is named like the model.
        self.text = serve.get_deployment_handle("bert-light", app)
        self.image = serve.get_deployment_handle("resnet-heavy", app)

    async def __call__(self, request: Request) -> dict[str, Any]:
        post = await request.json()
        text, image = await asyncio.gather(
            self.text.classify.remote(post["text"]),
            self.image.classify.remote(base64.b64decode(post["picture"])),
        )
        return {"text": _summary(text), "picture": _summary(image)}


def _summary(prediction: Prediction) -> dict[str, Any]:
    return {"label": prediction.label, "confidence": max(prediction.probabilities)}


app = Moderator.bind()
