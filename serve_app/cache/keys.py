"""Cache keys: a digest over everything that decides an answer, and nothing else."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

Payload = Sequence[str] | np.ndarray


def _part(h: hashlib.blake2b, data: bytes) -> None:
    """Length-prefixed, so that no two different sequences of parts hash alike."""
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def cache_key(
    target: str,
    deployments: Sequence[str],
    input_name: str,
    payload: Payload,
    requested: Sequence[str] | None,
    tenant: str | None = None,
    extra: str = "",
) -> str:
    """The key of one request's answer.

    `target` is the model or route asked; `deployments` the versions that may answer it (a
    route's two tiers), so an answer never crosses versions; the input's name, datatype, shape
    and bytes as the router decoded them; the outputs asked for; the tenant when answers are
    kept apart per tenant; `extra` for whatever else decides the answer (sampling parameters).
    """
    h = hashlib.blake2b(digest_size=20)
    for text in (target, "\0".join(deployments), input_name, extra, tenant or "", "\0".join(requested or ("*",))):
        _part(h, text.encode())
    if isinstance(payload, np.ndarray):
        _part(h, f"{payload.dtype.str}{payload.shape}".encode())
        data = np.ascontiguousarray(payload)  # hashed in place: no copy of a contiguous array
        h.update(data.nbytes.to_bytes(8, "little"))
        h.update(data.data.cast("B"))
    else:
        _part(h, f"BYTES{len(payload)}".encode())
        for item in payload:
            _part(h, item.encode())
    return h.hexdigest()
