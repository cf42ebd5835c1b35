"""What KubeRay's operator makes of k8s/rayservice.yaml: each pod's command line and environment.

Pure functions of the manifest's text (no processes, no Ray), so the translation is tested on its
own. The rules follow KubeRay v1.7's `ray-operator/controllers/ray/common/pod.go`:
`generateRayStartCommand` and `setMissingRayStartParams` (flags), `setContainerEnvVars`,
`configureGCSFaultTolerance` and `SetContainerTokenAuthEnvVars` (environment), and the container's
`/bin/bash -c "ulimit -n ...; ray start ..."`. The pod bed (benchmarks/podbed.py) runs what this
returns; nothing here repeats a setting of the manifest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

HEAD_PORT = 6379  # GetHeadPort: the GCS port when rayStartParams names none
DASHBOARD_PORT = 8265
AGENT_PORT = 52365  # dashboard-agent-listen-port, which KubeRay sets when missing
RECONNECT_TIMEOUT_S = "600"  # DefaultWorkerRayGcsReconnectTimeoutS, on workers with GCS fault tolerance
# What every RayService's Ray containers get (setContainerEnvVars, RayService clusters).
RAYSERVICE_ENV = {
    "RAY_timeout_ms_task_wait_for_death_info": "0",
    "RAY_gcs_server_request_timeout_seconds": "5",
    "RAY_SERVE_KV_TIMEOUT_S": "5",
}
_BINARY = 1024
_QUANTITY = {"Ki": _BINARY, "Mi": _BINARY**2, "Gi": _BINARY**3, "Ti": _BINARY**4, "k": 1000, "M": 1000**2, "G": 1000**3}


@dataclass(frozen=True)
class Pod:
    """One pod as the operator would create it."""

    name: str  # e.g. head, ingress-0, gpu-1
    group: str  # head, or the worker group's name
    command: str  # the container's shell command (`ulimit ...; ray start ...`)
    env: dict[str, str]  # after Kubernetes' $(VAR) expansion
    working_dir: str
    cpu: float = 1.0  # the container's CPU request in cores (its limit where it names no request)


@dataclass(frozen=True)
class Cluster:
    """The manifest's cluster: its Serve config and the pods of each group."""

    name: str
    serve_config: dict[str, Any]  # serveConfigV2, parsed as the operator parses it
    redis_address: str | None  # gcsFaultToleranceOptions.redisAddress
    redis_password: dict[str, Any] | None  # gcsFaultToleranceOptions.redisPassword: a value or a valueFrom
    head: dict[str, Any]  # headGroupSpec
    workers: dict[str, dict[str, Any]]  # groupName -> workerGroupSpec
    autoscaling: bool
    token_auth: bool

    # KubeRay's default external storage namespace is the RayCluster's UID: a new cluster never
    # picks up an old one's GCS state from the same Redis. The bed gives each start a new one.
    storage_namespace: str = ""

    def pods(self, counts: Mapping[str, int], head_service: str, secrets: Mapping[str, Mapping[str, str]]) -> list[Pod]:
        """The head and `counts[group]` pods of each worker group (default: the group's `replicas`)."""
        unknown = set(counts) - set(self.workers)
        if unknown:
            raise ValueError(f"no worker group {sorted(unknown)} in the manifest (it has {sorted(self.workers)})")
        pods = [self.pod("head", "head", self.head, head_service, secrets)]
        for group, spec in self.workers.items():
            for i in range(counts.get(group, spec.get("replicas", 1))):
                pods.append(self.pod(f"{group}-{i}", group, spec, head_service, secrets))
        return pods

    def pod(
        self, name: str, group: str, spec: dict[str, Any], head_service: str, secrets: Mapping[str, Mapping[str, str]]
    ) -> Pod:
        head = group == "head"
        container = spec["template"]["spec"]["containers"][0]
        params = dict(spec.get("rayStartParams", {}))
        env: dict[str, str] = {}
        # The container's own env first: the operator adds its variables only where these are missing.
        env.update(container_env(container, secrets))
        operator_env = {
            "RAY_CLUSTER_NAME": self.name,
            "RAY_CLUSTER_NAMESPACE": "default",
            "RAY_CLOUD_INSTANCE_ID": name,
            "RAY_NODE_TYPE_NAME": group,
            "RAY_PORT": str(HEAD_PORT),
            "RAY_ADDRESS": f"127.0.0.1:{HEAD_PORT}" if head else f"{head_service}:{HEAD_PORT}",
            "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
            "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
            **RAYSERVICE_ENV,
        }
        if not head:
            operator_env |= {"FQ_RAY_IP": head_service, "RAY_IP": head_service.split(".")[0]}
        if self.token_auth:
            # The operator's own Secret, named after the cluster, key auth_token (createAuthSecret).
            operator_env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets[self.name]["auth_token"]}
        if self.redis_address:
            if head:
                operator_env |= {
                    "RAY_REDIS_ADDRESS": self.redis_address,
                    "RAY_external_storage_namespace": self.storage_namespace or self.name,
                }
                if self.redis_password is not None:
                    password = container_env({"env": [{"name": "REDIS_PASSWORD", **self.redis_password}]}, secrets)
                    operator_env |= password
                    params.setdefault("redis-password", "$REDIS_PASSWORD")
            else:
                operator_env["RAY_gcs_rpc_server_reconnect_timeout_s"] = RECONNECT_TIMEOUT_S
        for k, v in operator_env.items():
            env.setdefault(k, v)
        params = with_missing_params(params, head, container.get("resources", {}), head_service)
        if head and self.autoscaling:
            params.setdefault("no-monitor", "true")
        start = ("ray start --head " if head else "ray start ") + param_string(params)
        env["KUBERAY_GEN_RAY_START_CMD"] = start
        command = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; " + start
        return Pod(name, group, command, env, container.get("workingDir", "/"), requested_cores(container))


def read_manifest(text: str) -> Cluster:
    """The RayService of k8s/rayservice.yaml."""
    doc = yaml.safe_load(text)
    if doc.get("kind") != "RayService":
        raise ValueError(f"not a RayService: kind {doc.get('kind')!r}")
    spec = doc["spec"]
    cluster = spec["rayClusterConfig"]
    ft = cluster.get("gcsFaultToleranceOptions") or {}
    return Cluster(
        name=doc["metadata"]["name"],
        serve_config=yaml.safe_load(spec["serveConfigV2"]),
        redis_address=ft.get("redisAddress"),
        redis_password=ft.get("redisPassword"),
        head=cluster["headGroupSpec"],
        workers={g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])},
        autoscaling=bool(cluster.get("enableInTreeAutoscaling")),
        token_auth=(cluster.get("authOptions") or {}).get("mode") == "token",
    )


def with_missing_params(params: dict[str, str], head: bool, resources: dict[str, Any], head_service: str) -> dict[str, str]:
    """rayStartParams with what the operator adds where they are missing (setMissingRayStartParams,
    generateRayStartCommand): the head's address, ports, and CPUs, memory and GPUs from the limits."""
    out = dict(params)
    if head:
        out.setdefault("dashboard-host", "0.0.0.0")
    else:
        out.setdefault("address", f"{head_service}:{HEAD_PORT}")
    out.setdefault("metrics-export-port", "8080")
    out.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    out["block"] = "true"
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    cpu = limits.get("cpu", requests.get("cpu"))
    if "num-cpus" not in out and cpu is not None:
        out["num-cpus"] = str(math.ceil(cpu_cores(str(cpu))))
    if "memory" not in out and "memory" in limits:
        out["memory"] = str(quantity_bytes(str(limits["memory"])))
    gpus = sum(int(v) for k, v in limits.items() if k.endswith("gpu"))
    if "num-gpus" not in out and gpus:
        out["num-gpus"] = str(gpus)
    return out


def param_string(params: Mapping[str, str]) -> str:
    """` --key=value` for each param, keys sorted; "true" is a bare flag, "false" is left out
    (convertParamMap). Values go to the shell as written: a quoted `resources` stays quoted."""
    parts = []
    for key in sorted(params):
        value = str(params[key])
        if value.lower() == "true":
            parts.append(f"--{key}")
        elif value.lower() != "false":
            parts.append(f"--{key}={value}")
    return " ".join(parts)


def container_env(container: dict[str, Any], secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """A container's `env`, with secretKeyRef values from `secrets` (an optional one that is missing
    leaves its variable unset) and Kubernetes' $(VAR) expansion of earlier variables."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            raise ValueError(f"env {var['name']}: only values and secretKeyRef are supported")
        value = secrets.get(ref["name"], {}).get(ref["key"])
        if value is None:
            if ref.get("optional"):
                continue
            raise ValueError(f"env {var['name']}: secret {ref['name']}/{ref['key']} is not given")
        env[var["name"]] = value
    for source in container.get("envFrom", []):
        ref = source.get("secretRef")
        if ref is None or ref["name"] not in secrets:
            if ref is not None and ref.get("optional"):
                continue
            raise ValueError(f"envFrom {source}: not given")
        env.update(secrets[ref["name"]])
    return env


def expand(value: str, env: Mapping[str, str]) -> str:
    """$(NAME) replaced with an earlier variable's value; an unknown one stays as written (Kubernetes)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def requested_cores(container: dict[str, Any]) -> float:
    """A container's CPU request, as the kubelet weighs it (the limit stands in for a missing request)."""
    resources = container.get("resources") or {}
    cpu = (resources.get("requests") or {}).get("cpu", (resources.get("limits") or {}).get("cpu"))
    return cpu_cores(str(cpu)) if cpu is not None else 1.0


def cpu_cores(q: str) -> float:
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def quantity_bytes(q: str) -> int:
    for suffix, factor in _QUANTITY.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(q)
