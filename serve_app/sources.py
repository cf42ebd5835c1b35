"""Where model files come from: a local path, or an object-store URI fetched once per node.

`s3://bucket/prefix` is copied into this node's cache ($SERVE_APP_MODEL_CACHE, default
~/.cache/serve-app/models) before a replica loads it, as KServe's storage initializer does for a
`storageUri`. Replicas of one node share the copy: the first takes a file lock and downloads into
a scratch directory renamed into place when complete, so a half-fetched model is never loaded, and
the others wait for it and reuse it. The S3 client is boto3's, configured the usual way
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an instance role, AWS_ENDPOINT_URL for an
S3-compatible server such as MinIO).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

CACHE_ENV = "SERVE_APP_MODEL_CACHE"
COMPLETE = ".complete"


class SourceError(OSError):
    """A model source that cannot be fetched; the message says what to fix."""


def is_remote(source: str) -> bool:
    return "://" in source


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "serve-app" / "models").expanduser()


def local_path(source: str) -> Path:
    """A local path for `source`, fetching it into this node's cache first when it is a URI."""
    if not is_remote(source):
        return Path(source)
    url = urlparse(source)
    if url.scheme != "s3":
        raise SourceError(f"{source}: unsupported scheme {url.scheme!r}; use a local path or s3://bucket/prefix")
    if not url.netloc:
        raise SourceError(f"{source}: no bucket; use s3://bucket/prefix")
    key = hashlib.sha256(f"{url.netloc}/{url.path.strip('/')}".encode()).hexdigest()[:16]  # one copy however written
    target = cache_root() / f"{url.netloc}-{key}"
    if (target / COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other replicas of this node wait here, then reuse the copy
        if not (target / COMPLETE).is_file():
            _fetch_s3(url.netloc, url.path.lstrip("/"), target)
    return target


def children(source: str) -> list[str]:
    """The names of the directories directly under `source` (a local path or s3://bucket/prefix):
    where a multiplexed pool finds its models. Nothing is fetched; each model is when first loaded."""
    if not is_remote(source):
        root = Path(source).expanduser()
        if not root.is_dir():
            raise SourceError(f"{source}: not a local directory of models")
        return sorted(p.name for p in root.iterdir() if p.is_dir())
    url = urlparse(source)
    if url.scheme != "s3" or not url.netloc:
        raise SourceError(f"{source}: use a local path or s3://bucket/prefix")
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    prefix = url.path.strip("/")
    prefix = f"{prefix}/" if prefix else ""
    names: set[str] = set()
    try:
        pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=url.netloc, Prefix=prefix, Delimiter="/")
        for page in pages:
            names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
    except (BotoCoreError, ClientError) as e:
        raise SourceError(f"{source}: {e}") from None
    return sorted(n for n in names if n)


def _fetch_s3(bucket: str, prefix: str, target: Path) -> None:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    scratch = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    prefix = prefix.rstrip("/")
    try:
        client = boto3.client("s3")
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
        fetched = 0
        for page in pages:
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(prefix) :].lstrip("/") if prefix else obj["Key"]
                if not relative or relative.endswith("/"):
                    continue
                dest = scratch / relative
                if scratch.resolve() not in dest.resolve().parents:
                    raise SourceError(f"s3://{bucket}/{obj['Key']}: a key that leaves the model directory")
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(dest))
                fetched += 1
    except (BotoCoreError, ClientError) as e:
        shutil.rmtree(scratch, ignore_errors=True)
        raise SourceError(f"s3://{bucket}/{prefix}: {e}") from None
    if not fetched:
        shutil.rmtree(scratch, ignore_errors=True)
        raise SourceError(f"s3://{bucket}/{prefix}: no objects under this prefix")
    (scratch / COMPLETE).write_text("")
    shutil.rmtree(target, ignore_errors=True)  # an earlier fetch that never completed
    scratch.rename(target)
