"""s3:// model sources, fetched from a real S3-compatible server (moto's standalone server) into
the node's cache once, then read as any model directory."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from serve_app import sources
from serve_app.config import AppArgs
from serve_app.errors import NotFound
from serve_app.exports import Declared, discover, load_problem
from serve_app.router.routing.members import PoolMembers
from tests.exports import Exports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def bucket(s3_endpoint: str, exports: Exports, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket holding the BERT export under models/bert/, the environment set as on a cluster node."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    name = f"b{time.monotonic_ns()}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    for f in exports.bert.iterdir():
        client.upload_file(str(f), name, f"models/bert/{f.name}")
    return name


def test_an_s3_model_is_fetched_once_into_the_cache_and_loads(bucket: str, exports: Exports):
    path = sources.local_path(f"s3://{bucket}/models/bert")
    assert sorted(p.name for p in path.iterdir() if p.name != sources.COMPLETE) == sorted(p.name for p in exports.bert.iterdir())
    _, manifest = discover(path, Declared("bert"))
    assert manifest.labels == ["negative", "positive"]
    boto3.client("s3").delete_object(Bucket=bucket, Key="models/bert/model.onnx")
    assert sources.local_path(f"s3://{bucket}/models/bert/") == path  # the cached copy: not fetched again


def test_replicas_of_one_node_share_one_fetch(bucket: str):
    """Four callers at once (a node's replicas starting): one fetch, every caller gets the same copy."""
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(sources.local_path(f"s3://{bucket}/models/bert"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and (got[0] / "model.onnx").is_file()
    assert not list(got[0].parent.glob("*.partial-*"))  # no scratch copy left behind


def test_a_missing_prefix_or_bucket_is_one_line_at_start(bucket: str):
    args = AppArgs.model_validate(
        {
            "models": {
                "nothing": {"path": f"s3://{bucket}/models/nothing", "family": "bert"},
                "no-bucket": {"path": "s3://no-such-bucket/bert", "family": "bert"},
                "bert": {"path": f"s3://{bucket}/models/bert", "family": "bert"},
            }
        }
    )
    assert load_problem(args, "nothing") == f"s3://{bucket}/models/nothing: no objects under this prefix"
    problem = load_problem(args, "no-bucket")
    assert problem is not None and "NoSuchBucket" in problem and "\n" not in problem
    assert load_problem(args, "bert") is None


def test_only_s3_uris_are_fetched():
    with pytest.raises(sources.SourceError, match="unsupported scheme 'gs'"):
        sources.local_path("gs://bucket/model")
    assert sources.local_path("/models/bert") == Path("/models/bert")


def test_a_pool_under_an_s3_prefix_finds_its_models_there_and_each_loads_when_first_used(bucket: str, exports: Exports):
    """`reviews-*` with an s3:// path: its models are the prefix's matching directories, listed at
    build without fetching one; each member's source is its own prefix, fetched when loaded."""
    client = boto3.client("s3")
    for name in ("reviews-de", "reviews-en", "other"):
        for f in exports.bert.iterdir():
            client.upload_file(str(f), bucket, f"pool/{name}/{f.name}")
    client.put_object(Bucket=bucket, Key="pool/reviews-notes.txt", Body=b"not a model")  # a file, not a directory
    entry = {"family": "bert", "path": f"s3://{bucket}/pool/", "multiplex": {"max_models_per_replica": 1}}
    args = AppArgs.model_validate({"models": {"reviews-*": entry}})
    assert sorted(args.models) == ["reviews-de", "reviews-en"]
    member = args.models["reviews-en"]
    assert member.path == f"s3://{bucket}/pool/reviews-en" and member.pool == "reviews-*"
    assert not sources.cache_root().exists()  # listing fetched nothing
    _, manifest = discover(sources.local_path(member.path or ""), Declared("bert"))
    assert manifest.labels == ["negative", "positive"]
    # A model put under the prefix after the build: an operator's load finds it there (members.py).
    for f in exports.bert.iterdir():
        client.upload_file(str(f), bucket, f"pool/reviews-fr/{f.name}")
    cached = set(sources.cache_root().iterdir())
    pool = PoolMembers(args, {}, {"reviews-*": "pool"}, {}, multiplexed=lambda h, name: h)
    assert pool.candidates(pool.listed()) == ["reviews-fr"]
    assert pool.find("reviews-fr")[0] == "reviews-*"
    with pytest.raises(NotFound, match="no model directory reviews-it"):
        pool.find("reviews-it")
    pool.adopt({"reviews-fr": "reviews-*"})
    assert args.models["reviews-fr"].path == f"s3://{bucket}/pool/reviews-fr"
    assert set(sources.cache_root().iterdir()) == cached  # fetched by the replica that loads it, not here
    with pytest.raises(ValueError, match="no model directory under"):
        AppArgs.model_validate({"models": {"fr-*": entry}})
    with pytest.raises(ValueError, match="NoSuchBucket"):
        AppArgs.model_validate({"models": {"reviews-*": {**entry, "path": "s3://no-such-bucket/pool"}}})
