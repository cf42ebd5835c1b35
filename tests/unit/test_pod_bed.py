"""The pod bed's pure parts: the operator's translation of the manifest, the client's failover, and
what a kill's records say. The bed itself runs in tests/integration/test_pod_bed.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from benchmarks.podclient import Targets
from benchmarks.pods import longest_gap, summarize
from benchmarks.podspec import container_env, expand, param_string, read_manifest

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"serve-app": {"auth_token": "tok"}, "serve-app-redis": {"password": "pw"}}


def pods(**counts: int):
    cluster = read_manifest((ROOT / "k8s" / "rayservice.yaml").read_text())
    return {p.name: p for p in cluster.pods(counts, "head-svc", SECRETS)}


def test_every_group_gets_its_replicas_or_the_count_given():
    assert sorted(pods()) == ["gpu-0", "gpu-1", "head", "ingress-0", "ingress-1"]
    assert sorted(pods(gpu=2, ingress=1)) == ["gpu-0", "gpu-1", "head", "ingress-0"]
    with pytest.raises(ValueError, match="no worker group"):
        pods(cpu=1)


def test_head_command_is_the_operators():
    head = pods()["head"]
    args = shlex.split(head.command.split("; ", 1)[1])
    assert args[:3] == ["ray", "start", "--head"]
    # rayStartParams as written, plus what the operator adds: block, the agent port, memory from the limit,
    # the GCS store's password from the env it sets (the shell expands it).
    assert {"--num-cpus=0", "--dashboard-host=0.0.0.0", "--block", "--dashboard-agent-listen-port=52365"} <= set(args)
    assert "--redis-password=$REDIS_PASSWORD" in head.command and "--memory=8589934592" in args
    assert head.env["RAY_REDIS_ADDRESS"] == "serve-app-redis:6379" and head.env["REDIS_PASSWORD"] == "pw"
    assert head.env["RAY_AUTH_MODE"] == "token" and head.env["RAY_AUTH_TOKEN"] == "tok"
    assert head.env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # the container's own env, kept
    assert head.env["KUBERAY_GEN_RAY_START_CMD"] in head.command


def test_workers_join_the_head_service_with_their_limits_as_resources():
    p = pods()
    gpu = shlex.split(p["gpu-0"].command.split("; ", 1)[1])
    assert {"--address=head-svc:6379", "--num-cpus=8", "--num-gpus=1"} <= set(gpu)  # pretend GPU from nvidia.com/gpu
    ingress = shlex.split(p["ingress-0"].command.split("; ", 1)[1])
    assert '--resources={"ingress": 1}' in ingress  # the manifest's quoting, through the shell as KubeRay runs it
    assert p["gpu-0"].env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    assert "RAY_REDIS_ADDRESS" not in p["gpu-0"].env


def test_param_string_is_sorted_with_bare_flags():
    assert param_string({"b": "1", "a": "true", "c": "false"}) == "--a --b=1"


def test_env_secrets_and_expansion():
    container = {
        "env": [
            {"name": "A", "value": "x"},
            {"name": "P", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
            {"name": "URL", "value": "redis://:$(P)@h/$(A)"},
        ],
        "envFrom": [{"secretRef": {"name": "store", "optional": True}}],
    }
    assert container_env(container, {}) == {"A": "x", "URL": "redis://:$(P)@h/x"}
    assert container_env(container, {"store": {"KEY": "v"}})["KEY"] == "v"
    with pytest.raises(ValueError, match="not given"):
        container_env({"env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}, {})
    assert expand("$(A)-$(B)", {"A": "1"}) == "1-$(B)"


def test_client_moves_off_an_address_that_refused():
    t = Targets(["a", "b"])
    assert [t.pick(0.0), t.pick(0.0), t.pick(0.0)] == ["a", "b", "a"]
    t.mark_down("a", 0.0)
    assert [t.pick(0.5), t.pick(0.5)] == ["b", "b"]
    assert t.pick(0.5, avoid="b") in ("a", "b")  # all down or avoided: still sends somewhere
    assert "a" in {t.pick(2.0), t.pick(2.0)}  # back after down_s


def test_summary_counts_outcomes_and_the_longest_gap():
    # route, sent, done, status, attempts, connection_errors, refusals, served_by
    records = [
        ["t", 0.0, 0.1, 200, 1, 0, 0, "m", ""],
        ["t", 1.0, 5.0, 200, 3, 1, 1, "m", ""],
        ["t", 2.0, 32.0, -2, 1, 0, 0, "", ""],
        ["t", 3.0, 3.1, 500, 1, 0, 0, "", ""],
        ["i", 4.0, 4.2, 200, 1, 0, 0, "m", ""],
    ]
    s = summarize(records, (0.0, 10.0))
    assert (s["sent"], s["answered"], s["lost"], s["failed"]) == (5, 3, 1, {"500": 1})
    assert (s["answered_after_refusal"], s["answered_after_connection_error"]) == (1, 1)
    assert s["longest_gap_s"] == {"i": 5.8, "t": 5.0}
    assert longest_gap([], (0.0, 2.0)) == 2.0


def test_the_upgrade_is_a_valid_config_with_its_three_changes():
    from ray.serve.schema import ServeDeploySchema

    from benchmarks.pods import ADDED, upgraded
    from serve_app.config import AppArgs

    cluster = read_manifest((ROOT / "k8s" / "rayservice.yaml").read_text())
    config, change = upgraded(cluster.serve_config)
    ServeDeploySchema.model_validate(config)
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert ADDED in args.models and args.models["bert-light"].batching.max_batch_size == 32
    assert change["canary_weights"] == {"1": 50, "2": 50}
    assert cluster.serve_config != config  # the manifest's own config is left as it was


def test_the_bed_adds_pods_of_the_group_whose_resources_fit():
    from benchmarks.podbed import Bed

    bed = Bed()  # reads the manifest; starts nothing
    assert bed.group_for("router") == "ingress"
    assert bed.group_for("bert-light") == "gpu" and bed.group_for("gpt") == "gpu"


def test_a_replica_gets_a_new_pod_only_when_it_fits_on_none():
    """The autoscaler's stand-in reads what is placed, as KubeRay's reads Ray's pending demand:
    a slow start on a busy pod is no reason for a pod."""
    from benchmarks.netns import Host
    from benchmarks.podbed import HEAD_SERVICE, Bed

    bed = Bed()
    bed.pods = {p.name: p for p in bed.cluster.pods({}, HEAD_SERVICE, SECRETS)}
    bed.hosts = {name: Host(name, f"10.0.0.{i}") for i, name in enumerate(bed.pods)}
    bed.procs = dict.fromkeys(bed.pods)  # type: ignore[assignment]  # running pods: only the names are read
    gpu = [bed.hosts[n].address for n in bed.pods if n.startswith("gpu-")]

    def details(**placed: list[str]) -> dict:
        deployments = {d: {"replicas": [{"node_ip": ip} for ip in ips] + [{"node_ip": None}]} for d, ips in placed.items()}
        return {"applications": {"default": {"deployments": deployments}}}

    # Light tiers: at most one replica a pod, and both GPU pods hold one already.
    assert not bed.fits_somewhere("bert-light", "gpu", details(**{"bert-light": gpu}))
    assert bed.fits_somewhere("bert-light", "gpu", details(**{"bert-light": gpu[:1]}))
    # A pod's GPU full: 4 x 0.25 on one pod, the other free.
    assert bed.fits_somewhere("gpt", "gpu", details(**{"resnet-heavy": [gpu[0]] * 4}))
    assert not bed.fits_somewhere("gpt", "gpu", details(**{"resnet-heavy": [gpu[0]] * 4 + [gpu[1]] * 4}))
    # One router a pod: both ingress pods hold one.
    ingress = [bed.hosts[n].address for n in bed.pods if n.startswith("ingress-")]
    assert not bed.fits_somewhere("router", "ingress", details(router=ingress))


def test_a_new_bed_never_takes_up_an_old_clusters_gcs_state():
    import dataclasses

    cluster = read_manifest((ROOT / "k8s" / "rayservice.yaml").read_text())
    fresh = dataclasses.replace(cluster, storage_namespace="uid-1")
    (head,) = [p for p in fresh.pods({}, "svc", SECRETS) if p.group == "head"]
    assert head.env["RAY_external_storage_namespace"] == "uid-1"
