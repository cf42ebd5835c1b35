"""The RayService manifest: generated from gpu.yaml and valid against KubeRay's CRD."""

import functools
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app.tools.kuberay import INGRESS_RESOURCE, for_the_cluster, render, render_network_policy, serve_config_of

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "k8s" / "crds" / "ray.io_rayservices.yaml"  # KubeRay v1.7.0's, kept in the repository
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
INGRESS_SERVICE = ROOT / "k8s" / "ingress-service.yaml"
GPU_CONFIG = ROOT / "configs" / "gpu.yaml"
NETWORK_POLICY = ROOT / "k8s" / "networkpolicy.yaml"


def test_committed_manifest_is_a_fresh_render():
    assert MANIFEST.read_text() == render(GPU_CONFIG), "run `serve-app k8s render` after editing configs/gpu.yaml"


def test_committed_network_policy_is_a_fresh_render():
    assert NETWORK_POLICY.read_text() == render_network_policy(), "run `serve-app k8s render`"


def test_serve_config_v2_is_a_block_with_the_comments_of_gpu_yaml():
    """Operators read the manifest: serveConfigV2 is a `|` block, as in KubeRay's samples, not one escaped line."""
    text = MANIFEST.read_text()
    assert "  serveConfigV2: |\n" in text
    embedded = yaml.safe_load(text)["spec"]["serveConfigV2"]
    comments = [line.strip() for line in GPU_CONFIG.read_text().splitlines() if line.strip().startswith("#")]
    assert comments and all(c in embedded for c in comments)


def test_render_takes_the_image_and_namespaces():
    manifest = yaml.safe_load(render(GPU_CONFIG, image="registry.example/serve-app:1.2", namespace="models"))
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert {c["image"] for p in pods for c in p["template"]["spec"]["containers"]} == {"registry.example/serve-app:1.2"}
    assert manifest["metadata"]["namespace"] == "models"
    policies = list(yaml.safe_load_all(render_network_policy("kuberay", "models")))
    assert all(p["metadata"]["namespace"] == "models" for p in policies)
    selectors = [f.get("namespaceSelector") for p in policies for rule in p["spec"]["ingress"] for f in rule.get("from", [])]
    assert {"kubernetes.io/metadata.name": "kuberay"} in [s["matchLabels"] for s in selectors if s]


def test_a_stopping_replica_outwaits_the_longest_request():
    """Routers and the generator finish what they stream on scale-in or upgrade: Serve's default (20 s)
    would cut a generation that request_timeout_s still allows; the pod's drain outlasts both."""
    from serve_app.tools.kuberay import DRAIN_DEADLINE_S

    for path in (GPU_CONFIG, ROOT / "configs" / "local.yaml"):
        config = yaml.safe_load(path.read_text())
        longest = config["http_options"]["request_timeout_s"]
        deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
        for name in ("router", "gpt"):
            assert deployments[name]["graceful_shutdown_timeout_s"] >= longest, (path.name, name)
            assert DRAIN_DEADLINE_S > deployments[name]["graceful_shutdown_timeout_s"]


def test_serve_config_v2_is_the_gpu_application_as_the_cluster_runs_it():
    embedded = serve_config_of(MANIFEST.read_text())
    gpu = yaml.safe_load(GPU_CONFIG.read_text())
    deployments = {d["name"]: d for d in embedded["applications"][0]["deployments"]}
    assert deployments["router"]["ray_actor_options"]["resources"] == {INGRESS_RESOURCE: 1}
    # A pod's loss or a rolling update leaves every model a replica, none with all of them on one pod.
    models = [d for n, d in deployments.items() if n != "router"]
    assert models and all(d["autoscaling_config"]["min_replicas"] >= 2 for d in models)
    assert all(d.get("max_replicas_per_node") == 1 for n, d in deployments.items() if n != "router")
    # Nothing else differs from configs/gpu.yaml.
    assert embedded == for_the_cluster(yaml.safe_load(GPU_CONFIG.read_text())) != gpu


def test_gpu_pods_hold_every_model_twice():
    cluster = yaml.safe_load(MANIFEST.read_text())["spec"]["rayClusterConfig"]
    (gpu,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu"]
    app = serve_config_of(MANIFEST.read_text())["applications"][0]
    models = [d for d in app["deployments"] if d["name"] != "router"]
    least = max(d["autoscaling_config"]["min_replicas"] for d in models)
    assert gpu["minReplicas"] >= least and gpu["replicas"] >= least
    # One replica of every model fits one pod's GPUs, so `least` pods hold them all at their minimum.
    gpus = float(gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert sum(d["ray_actor_options"].get("num_gpus", 0) for d in models) <= gpus


def test_routers_fit_the_ingress_group_and_the_models_do_not():
    """Routers run on CPU pods apart from the models: a GPU pod's loss cuts no client's connection."""
    cluster = yaml.safe_load(MANIFEST.read_text())["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    offered = json.loads(json.loads(groups["ingress"]["rayStartParams"]["resources"]))
    assert offered == {INGRESS_RESOURCE: 1} and "resources" not in groups["gpu"]["rayStartParams"]
    assert groups["ingress"]["minReplicas"] >= 2  # one pod's loss leaves routers serving
    app = serve_config_of(MANIFEST.read_text())["applications"][0]
    router = next(d for d in app["deployments"] if d["name"] == "router")
    # One router per ingress pod (Serve runs a proxy only where a replica is, and the Service sends
    # clients to every ingress pod), and enough pods for the routers' autoscaling.
    assert router["ray_actor_options"]["resources"][INGRESS_RESOURCE] == offered[INGRESS_RESOURCE]
    assert router["ray_actor_options"]["num_cpus"] <= int(groups["ingress"]["rayStartParams"]["num-cpus"])
    assert groups["ingress"]["minReplicas"] == router["autoscaling_config"]["min_replicas"]
    assert groups["ingress"]["maxReplicas"] >= router["autoscaling_config"]["max_replicas"]
    # Every model asks for a GPU, which the ingress pods do not have.
    models = [d for d in app["deployments"] if d["name"] != "router"]
    assert models and all(d["ray_actor_options"]["num_gpus"] > 0 for d in models)


def test_clients_reach_the_proxies_of_the_ingress_pods_only():
    service = yaml.safe_load(INGRESS_SERVICE.read_text())
    selector = service["spec"]["selector"]
    cluster = yaml.safe_load(MANIFEST.read_text())["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]["metadata"]["labels"]}
    pods |= {g["groupName"]: g["template"]["metadata"]["labels"] for g in cluster["workerGroupSpecs"]}
    selected = [name for name, labels in pods.items() if selector.items() <= labels.items()]
    assert selected == ["ingress"]
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 9000}


@functools.cache
def crd_schema() -> dict:
    """The CRD's v1 schema, parsed once: it is large, hence libyaml's loader where PyYAML has it."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict = v1["schema"]["openAPIV3Schema"]
    return schema


def test_manifest_validates_against_kuberay_crd():
    manifest = yaml.safe_load(MANIFEST.read_text())
    jsonschema.validate(manifest, crd_schema())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    for workers in cluster["workerGroupSpecs"]:
        assert workers["maxReplicas"] > workers["minReplicas"], workers["groupName"]


def test_crd_schema_catches_a_broken_manifest():
    manifest = yaml.safe_load(MANIFEST.read_text())
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, crd_schema())
