"""What decides a deployment's answers besides the request, as a short id for cache keys.

A deployment's name is not enough: redeployed under the same name with another model directory,
version, precision or generation defaults, it answers differently, and a shared cache (Redis)
outlives the redeploy. The id covers the deployment's config and, where the router has it at
hand (kept, or in this node's model directory), its manifest, which changes when the model is
rebuilt (its source fingerprint and parity check); a replica is never asked for it here, which
could wake a model held at zero replicas for a request that never reaches it. A model file
replaced in place under an unchanged config is then not seen: give the new model a new version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from serve_app.config import AppArgs
from serve_app.manifest import Manifest


def answer_id(deployment: str, config_json: str, manifest: Manifest | None) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(config_json.encode())
    h.update(b"\0")
    h.update(b"" if manifest is None else manifest.model_dump_json().encode())
    return f"{deployment}@{h.hexdigest()}"


class AnswerIds:
    """Each deployment's answer id, worked out at its first cache lookup and kept: a router's
    config is fixed for its life, and a manifest never changes under a running replica."""

    def __init__(self, args: AppArgs, manifest: Callable[[str], Manifest | None]) -> None:
        self.args = args
        self.manifest = manifest  # serve_app.router.routing.catalog.ModelCatalog.manifest_at_hand
        self._ids: dict[str, str] = {}

    def of(self, deployment: str) -> str:
        if (known := self._ids.get(deployment)) is None:
            config = self.args.deployment_config(deployment).model_dump_json()
            known = self._ids[deployment] = answer_id(deployment, config, self.manifest(deployment))
        return known
