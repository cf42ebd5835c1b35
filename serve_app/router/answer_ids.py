"""What decides a deployment's answers besides the request, as a short id for cache keys.

A deployment's name is not enough: redeployed under the same name with another model directory,
version, precision or generation defaults, it answers differently, and a shared cache (Redis)
outlives the redeploy. The id covers the deployment's config and its manifest, which changes when
the model is rebuilt (its source fingerprint and parity check). A model file replaced in place
under an unchanged manifest is not seen: give the new model a new version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

from serve_app.config import AppArgs
from serve_app.manifest import Manifest


def answer_id(deployment: str, config_json: str, manifest: Manifest) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(config_json.encode())
    h.update(b"\0")
    h.update(manifest.model_dump_json().encode())
    return f"{deployment}@{h.hexdigest()}"


class AnswerIds:
    """Each deployment's answer id, worked out at its first cache lookup and kept: a router's
    config is fixed for its life, and a manifest never changes under a running replica."""

    def __init__(self, args: AppArgs, manifest: Callable[[str], Awaitable[Manifest]]) -> None:
        self.args = args
        self.manifest = manifest  # serve_app.router.catalog.ModelCatalog.manifest
        self._ids: dict[str, str] = {}

    async def of(self, deployment: str) -> str:
        if (known := self._ids.get(deployment)) is None:
            config = self.args.deployment_config(deployment).model_dump_json()
            known = self._ids[deployment] = answer_id(deployment, config, await self.manifest(deployment))
        return known
