"""configs/gpu.yaml on Ray started with a pretend GPU, the way users start it:
`ray start --head --num-gpus=1` then `serve run --address=auto CONFIG`.

Ray's scheduler does the packing, so a CPU machine shows it: fractional
replicas share GPU id 0 and the cluster's one GPU is fully allocated. On a
machine with a real GPU (nvidia-smi answers) the same tests also require every
replica's session to run on ONNX Runtime's CUDA provider.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.report import gpu_info
from tests.integration.serving import deployment_handle

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PORT = 8124
CATALOG = ["bert-light", "bert-heavy", "resnet-light", "resnet-heavy", "gpt"]
REAL_GPU = gpu_info() is not None


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    env = {**os.environ, "SERVE_APP_MODEL_DIR": str(tiny_model_dir), "RAY_AUTH_MODE": "token"}
    import ray
    from ray import serve

    from benchmarks.cluster import ensure_auth_token, stop_ray
    from tests.integration.serving import release_handles

    # Logical CPUs: gpu.yaml asks one CPU per replica, as a GPU node would have.
    start = ["ray", "start", "--head", "--num-cpus=16", "--num-gpus=1", "--include-dashboard=false"]
    start += ["--disable-usage-stats", "--port=6390"]
    try:
        ensure_auth_token(env)
        subprocess.run(start, check=True, env=env, capture_output=True)
        with ray_auth_mode("token"):
            ray.init(address="auto", log_to_driver=False)
            try:
                yield env, tmp_path_factory.mktemp("configs")
            finally:
                # Handles and Serve's cached client outlive ray.shutdown(): left, they talked to
                # this cluster after `ray stop` and the next module's Serve never started (CI:
                # every test_protocols test errored in setup, then the process died).
                release_handles()
                with contextlib.suppress(Exception):
                    serve.shutdown()
                ray.shutdown()
    finally:
        # Also when setup failed: a cluster left running here is joined by the next module.
        stop_ray()


@contextlib.contextmanager
def ray_auth_mode(mode: str) -> Iterator[None]:
    """Run this process's Ray driver in `mode`, then put the old mode back.

    Ray reads RAY_AUTH_MODE into a config cached at import, and pytest imported Ray while
    collecting: setting the variable alone leaves the driver tokenless ("InvalidAuthToken"),
    and leaving it set changed how the next module's `ray.init()` started its own cluster
    (CI: every test_protocols test errored in setup). Ray's own `_enable_token_auth` refreshes
    the cache the same way."""
    from ray._raylet import Config  # type: ignore[attr-defined]  # a Cython class, no stubs

    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
        Config.initialize("")


def _deploy(env: dict, config: dict, path: Path) -> None:
    config["http_options"]["port"] = PORT
    path.write_text(yaml.safe_dump(config))
    subprocess.run(
        ["serve", "run", "--address=auto", "--non-blocking", str(path)], check=True, env=env, capture_output=True, timeout=120
    )


def _wait_running(names: list[str], replicas: dict[str, int], timeout_s: float = 180) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get("default")
        if status is not None and status.status == "RUNNING":
            # replica_states is keyed by ReplicaState, a str enum: the plain string finds the same entry.
            running = {n: status.deployments[n].replica_states.get("RUNNING", 0) for n in names}  # type: ignore[call-overload]
            if all(running[n] == replicas.get(n, 1) for n in names):
                return
        assert time.monotonic() < deadline, f"not running in time: {status}"
        time.sleep(1)


def _replica_gpus(name: str, expected_replicas: int) -> dict[str, list[str]]:
    """replica id -> GPU ids, asking each replica (calls spread over replicas)."""

    handle = deployment_handle(name, "default")
    seen: dict[str, list[str]] = {}
    deadline = time.monotonic() + 60
    while len(seen) < expected_replicas:
        info = handle.runtime_info.remote().result()
        seen[info["replica"]] = info["gpu_ids"]
        if REAL_GPU:
            # onnxruntime-gpu lists CUDA as available on any machine; only a real GPU runs it.
            assert info["providers"][0] == "CUDAExecutionProvider", f"{name}: {info['providers']}"
        assert time.monotonic() < deadline, f"saw only {len(seen)} replicas of {name}"
    return seen


def test_gpu_yaml_packs_the_catalog_onto_one_pretend_gpu(cluster):
    env, tmp = cluster
    import ray

    config = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    _deploy(env, config, tmp / "gpu.yaml")
    _wait_running(CATALOG, {})
    for name in CATALOG:
        (gpus,) = _replica_gpus(name, 1).values()
        assert gpus == ["0"], f"{name} on GPU {gpus}"
    assert ray.available_resources().get("GPU", 0.0) == pytest.approx(0.0)
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["the food was good"]}]}
    resp = httpx.post(f"http://127.0.0.1:{PORT}/v2/models/text-classify/infer", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def test_user_config_retunes_batching_in_place(cluster):
    """Changing only `user_config` in the Serve config reconfigures running replicas."""
    env, tmp = cluster

    handle = deployment_handle("bert-light", "default")
    before = handle.runtime_info.remote().result()
    config = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    (light,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "bert-light"]
    light["user_config"] = {"max_batch_size": 5, "batch_wait_timeout_s": 0.02}
    _deploy(env, config, tmp / "retuned.yaml")
    deadline = time.monotonic() + 60
    while (after := handle.runtime_info.remote().result())["batching"]["max_batch_size"] != 5:
        assert time.monotonic() < deadline, "user_config change never reached the replica"
        time.sleep(0.5)
    assert after["replica"] == before["replica"], "replica restarted instead of reconfiguring"
    assert after["batching"]["batch_wait_timeout_s"] == 0.02


def test_four_quarter_gpu_replicas_share_one_gpu(cluster):
    env, tmp = cluster
    import ray

    config = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    app = config["applications"][0]
    app["args"]["models"] = {"resnet-heavy": app["args"]["models"]["resnet-heavy"]}
    app["args"]["routes"] = {}
    app["deployments"] = [d for d in app["deployments"] if d["name"] in ("router", "resnet-heavy")]
    # The router's traffic policy names bert-heavy's versions, which this app no longer serves.
    (router,) = [d for d in app["deployments"] if d["name"] == "router"]
    router.pop("user_config", None)
    (heavy,) = [d for d in app["deployments"] if d["name"] == "resnet-heavy"]
    heavy.pop("autoscaling_config")
    heavy["num_replicas"] = 4
    assert heavy["ray_actor_options"]["num_gpus"] == 0.25
    _deploy(env, config, tmp / "packing.yaml")
    _wait_running(["resnet-heavy"], {"resnet-heavy": 4})
    replicas = _replica_gpus("resnet-heavy", 4)
    assert len(replicas) == 4
    assert all(gpus == ["0"] for gpus in replicas.values()), replicas
    assert ray.available_resources().get("GPU", 0.0) == pytest.approx(0.0)
