"""The committed KubeRay manifest on a short pod bed: pods on their own addresses, a request through
every path, a worker pod lost under load and every request answered on the client's retries.

The manifest's own pod counts: the head, two ingress pods (one router each) and two GPU worker pods with a
pretend GPU, serving the tiny models under the demo's names. Needs root and `ip netns`; skipped
where the machine does not allow it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks import netns
from benchmarks.podbed import SERVE_PORT, Bed
from benchmarks.pods import image_size, kill_phase, placement, write_bodies
from benchmarks.workloads import image_bodies, text_bodies

pytestmark = pytest.mark.integration
WHY_NOT = netns.available()


@pytest.fixture(scope="module")
def bed(tiny_model_dir: Path) -> Iterator[Bed]:
    if WHY_NOT is not None:
        pytest.skip(f"no pod bed on this machine: {WHY_NOT}")
    # The short bed measures nothing: its pods share the core unweighted, which starts them sooner
    # (the CPU groups' own test is tests/unit/test_cgroups.py).
    b = Bed(model_dir=tiny_model_dir, workdir=Path("/tmp/pbci"), prefix="pbci", subnet="10.233.1.0/24", weigh_cpu=False)
    try:
        b.start(timeout_s=240)
        yield b
    finally:
        b.stop()


def test_every_path_answers_through_every_ingress_pod(bed: Bed) -> None:
    where = placement(bed)
    ingress = {n for n, p in bed.pods.items() if p.group == "ingress"}
    workers = {n for n, p in bed.pods.items() if p.group == "gpu"}
    # Routers on ingress pods, one each; models on the worker pod: every answer crossed the network.
    assert sorted(p.split()[0] for p in where["router"]) == sorted(ingress)
    assert all(p.split()[0] in workers for d, pods in where.items() if d != "router" for p in pods)
    image = image_bodies(1, image_size(bed))[0]
    for address in bed.ingress_addresses():
        base = f"http://{address}:{SERVE_PORT}"
        for path, body in (
            ("/v2/models/text-classify/infer", text_bodies(1)[0]),
            ("/v2/models/bert-heavy/infer", text_bodies(1)[0]),
            ("/v2/models/image-classify/infer", image),
            ("/v1/completions", {"model": "gpt", "prompt": "the movie was", "max_tokens": 4}),
        ):
            r = httpx.post(base + path, json=body, timeout=60)
            assert r.status_code == 200, (address, path, r.text[:300])
        assert httpx.get(base + "/v2/health/ready", timeout=10).status_code == 200


def test_a_lost_worker_pod_loses_no_request(bed: Bed) -> None:
    bodies = bed.workdir / "bodies.json"
    write_bodies(bed.model_dir, bodies, 50)
    ns = argparse.Namespace(rate=5.0, phase_s=20.0, fault_at_s=5.0, replace_after_s=3.0, deadline_s=120.0, warmup_s=1.0)
    k = kill_phase(bed, ns, "worker", bodies)
    s = k["whole"]
    assert k["processes_killed"] > 0 and s["sent"] > 50
    # Every request answered: refused with Retry-After or cut by the pod's loss, then answered on retry.
    assert (s["answered"], s["lost"], s["failed"]) == (s["sent"], 0, {}), s
