"""The CPU-cost model of bench compare (benchmarks/cost.py) and the binary workload encoding."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import cost, workloads
from benchmarks.baselines.runner import ModelRunner
from serve_app.protocols import v2


def test_core_ms_per_request_folds_roles_into_parts_and_leaves_the_client_out() -> None:
    point = {
        "throughput_rps": 600.0,  # 100 of them refusals: work, not answers
        "goodput_rps": 500.0,
        "cpu_cores_by_role": {
            "replica:router": 0.5,  # 1 ms per request
            "replica:bert-heavy": 0.25,
            "replica:resnet-heavy": 0.01,  # another model idling: Ray's overhead, not this model's
            "haproxy": 0.07,
            "haproxy-manager": 0.03,  # parses HAProxy's log line of every request: the ingress's
            "serve-proxy": 0.05,
            "serve-controller": 0.04,
            "loadgen": 0.3,
        },
    }
    c = cost.core_ms_per_request(point, "bert-heavy")
    assert c == {"ingress": 0.3, "router": 1.0, "model": 0.5, "ray": 0.1, "total": 1.9}
    assert cost.ceiling_rps(c, 2) == pytest.approx(1052.6, abs=0.1)
    assert cost.ceiling_rps(c, 16) == pytest.approx(8421.1, abs=0.1)


def test_baselines_count_their_server_as_the_model_and_empty_points_give_nothing() -> None:
    plain = {"goodput_rps": 100.0, "cpu_cores_by_role": {"replica:PlainModel": 1.0, "haproxy": 0.1}}
    assert cost.core_ms_per_request(plain, "resnet-heavy") == {"ingress": 1.0, "router": 0.0, "model": 10.0, "ray": 0.0,
                                                                 "total": 11.0}  # fmt: skip
    naive = {"goodput_rps": 200.0, "cpu_cores_by_role": {"naive-server": 1.0}}
    assert cost.core_ms_per_request(naive, "m")["model"] == 5.0  # type: ignore[index]
    assert cost.core_ms_per_request({"goodput_rps": 0.0, "cpu_cores_by_role": {"x": 1}}, "m") is None
    assert cost.ceiling_rps({"total": 0.0}, 16) is None


@pytest.mark.parametrize("body", [workloads.image_bodies(2, 16, items_per_request=2)[0], workloads.text_bodies(3, 3)[0]])
def test_a_binary_body_decodes_to_the_same_tensors_as_its_json(body: dict) -> None:
    raw, header_length = workloads.binary_body(body)
    from_binary = v2.parse_request(raw, str(header_length))
    from_json = v2.parse_request(json.dumps(body).encode(), None)
    assert (from_binary.parameters or {}).get("binary_data_output") is True
    a, b = from_binary.inputs[0], from_json.inputs[0]
    if a.datatype == "BYTES":
        assert v2.decode_bytes(a) == v2.decode_bytes(b)
    else:
        assert np.array_equal(v2.decode_numeric(a), v2.decode_numeric(b))
    spec = workloads.StreamSpec("s", "/p", [body], binary=True).to_json()["bodies"][0]
    assert base64.b64decode(spec["base64"]) == raw and spec["header_length"] == header_length


def test_idle_cores_are_the_nodes_fixed_cost_and_a_request_pays_only_what_it_adds_above_them() -> None:
    point = {
        "goodput_rps": 1000.0,
        "cpu_cores_by_role": {"replica:router": 0.6, "replica:m": 0.4, "serve-controller": 0.05, "haproxy": 0.1, "loadgen": 0.1},
    }
    idle = {"replica:router": 0.05, "replica:m": 0.02, "serve-controller": 0.05, "ray-system": 0.03, "loadgen": 0.01}
    above = cost.core_ms_per_request(point, "m", idle)
    assert above == {"ingress": 0.1, "router": 0.55, "model": 0.38, "ray": 0.0, "total": 1.03}
    fixed = cost.fixed_cores(idle)
    assert fixed == 0.15  # the client's idle share left out
    # 16 cores: 0.15 of them idle work, the rest at 1.03 core-ms a request.
    assert cost.ceiling_rps(above, 16, fixed) == pytest.approx((16 - 0.15) * 1000 / 1.03, abs=0.1)
    whole = cost.core_ms_per_request(point, "m")
    assert whole is not None and cost.ceiling_rps(whole, 16) < cost.ceiling_rps(above, 16, fixed)  # type: ignore[operator]
    assert cost.ceiling_rps(above, 1, fixed=1.5) is None  # idle work alone fills the node


@pytest.mark.parametrize("model", ["bert-heavy", "resnet-heavy"])
def test_plain_ray_serve_reads_a_binary_body_as_it_reads_its_json(tiny_model_dir: Path, model: str) -> None:
    """The baseline takes the binary rounds' inputs too, so both sides of a binary round get binary."""
    runner = ModelRunner(tiny_model_dir / model, threads=1)
    body = workloads.bodies_for(tiny_model_dir / model, 3)[0]
    raw, header_length = workloads.binary_body(body)
    from_binary, from_json = runner.decode_binary(raw, header_length), runner.decode(body)
    assert len(from_binary) == len(from_json) > 0
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(from_binary, from_json, strict=True))
