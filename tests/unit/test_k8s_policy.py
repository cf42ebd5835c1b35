"""Policy over every Kubernetes manifest in k8s/: least privilege, bounded resources, closed ports.

What an admission policy (Pod Security "restricted", a Kyverno/OPA rule set) would refuse,
checked offline: no cluster is reachable here. The RayService's schema is checked against
KubeRay's CRD in test_kuberay.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml"))


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod template a document holds, named for the failure message."""
    spec = doc.get("spec", {})
    if doc["kind"] == "RayService":
        cluster = spec["rayClusterConfig"]
        yield "head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster["workerGroupSpecs"]:
            yield group["groupName"], group["template"]["spec"]
    elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        yield doc["metadata"]["name"], spec["template"]["spec"]


PODS = [(f"{name}:{pod}", spec) for name, doc in documents() for pod, spec in pod_specs(doc)]


def test_the_policy_sees_every_workload():
    assert {n.split(":")[0] for n, _ in PODS} == {"rayservice.yaml", "redis.yaml", "redis-cache.yaml"}
    assert {d["kind"] for _, d in documents()} >= {"RayService", "StatefulSet", "Deployment", "Service", "NetworkPolicy"}


@pytest.mark.parametrize(("name", "pod"), PODS, ids=[n for n, _ in PODS])
def test_pods_run_unprivileged_with_bounded_resources(name: str, pod: dict[str, Any]):
    assert pod["securityContext"]["runAsNonRoot"] is True, name
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
    assert pod["securityContext"].get("runAsUser", 0) != 0, name
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and "ALL" in sc["capabilities"]["drop"], c["name"]
        assert not sc.get("privileged", False) and sc.get("runAsUser", 1) != 0, c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "hostNetwork" not in pod and "hostPID" not in pod


def test_no_ray_client_port_and_no_credentials_in_manifests():
    ports = [p["containerPort"] for _, pod in PODS for c in pod["containers"] for p in c.get("ports", [])]
    assert 10001 not in ports  # Ray client: remote code execution for whoever reaches it
    text = "".join(p.read_text() for p in MANIFESTS).lower()
    assert "password:" not in text.replace("redispassword:", "")  # passwords come from Secrets only


def test_network_policy_opens_only_the_serving_port_to_everyone():
    policies = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "NetworkPolicy"}
    ray = policies["serve-app-ray"]["spec"]
    labels = ray["podSelector"]["matchLabels"]
    (_, service), *_ = [(n, d) for n, d in documents() if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        assert labels.items() <= template["metadata"]["labels"].items()  # the policy selects every Ray pod
    open_rules = [r for r in ray["ingress"] if "from" not in r]
    assert [[p["port"] for p in r["ports"]] for r in open_rules] == [[8000, 9000]]  # HTTP and gRPC
    assert all(r["from"] for r in ray["ingress"] if "from" in r)
    redis = policies["serve-app-redis"]["spec"]["ingress"]
    assert all("from" in r for r in redis)


def test_the_gcs_is_fault_tolerant_with_the_redis_beside_it():
    (_, service), *_ = [(n, d) for n, d in documents() if d["kind"] == "RayService"]
    ft = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, port = ft["redisAddress"].split(":")
    redis_services = {d["metadata"]["name"]: d for n, d in documents() if n == "redis.yaml" and d["kind"] == "Service"}
    assert host in redis_services and int(port) in [p["port"] for p in redis_services[host]["spec"]["ports"]]
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == host
    assert service["spec"]["rayClusterConfig"]["authOptions"]["mode"] == "token"


def test_the_image_runs_as_a_user_and_fails_on_a_failed_build():
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "|| true" not in dockerfile
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
