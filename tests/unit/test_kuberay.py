"""The RayService manifest: generated from gpu.yaml and valid against KubeRay's CRD."""

from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app.kuberay import render, serve_config_of

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "k8s" / "crds" / "ray.io_rayservices.yaml"  # KubeRay v1.7.0's, kept in the repository
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
GPU_CONFIG = ROOT / "configs" / "gpu.yaml"


def test_committed_manifest_is_a_fresh_render():
    assert MANIFEST.read_text() == render(GPU_CONFIG), "run `serve-app k8s render` after editing configs/gpu.yaml"


def test_serve_config_v2_is_the_gpu_application():
    assert serve_config_of(MANIFEST.read_text()) == yaml.safe_load(GPU_CONFIG.read_text())


def test_manifest_validates_against_kuberay_crd():
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    manifest = yaml.safe_load(MANIFEST.read_text())
    jsonschema.validate(manifest, schema)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["maxReplicas"] > workers["minReplicas"]


def test_crd_schema_catches_a_broken_manifest():
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    manifest = yaml.safe_load(MANIFEST.read_text())
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "many"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, v1["schema"]["openAPIV3Schema"])
