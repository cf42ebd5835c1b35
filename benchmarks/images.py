"""`python -m benchmarks images`: does a burst of large encoded images slow down text requests
on the same router?

Text requests (`bert-heavy`, v2 JSON) arrive open loop at a fixed rate, a share of the
text capacity measured first; each round runs them alone, then with a stream of PNG
requests beside them (`resnet-heavy`, BYTES in the binary extension, several
megapixel-sized images per request, as a camera or upload service would send them).
The router decodes and resizes those images; the figure is the text stream's p99
with the burst over its p99 without, per round, both on the same deployment.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, Probe, RayCluster, run_loadgen
from benchmarks.cores import server_argv
from benchmarks.scenarios import DEFAULT_INGRESS, pin_replicas, single_versions

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
TEXT_MODEL, IMAGE_MODEL = "bert-heavy", "resnet-heavy"


@dataclass
class ImageSettings:
    seconds: float = 20.0  # measured window of each phase
    warmup: float = 2.0
    text_share: float = 0.3  # text rate, as a share of the text capacity
    png_rate: float = 4.0  # PNG requests per second in the burst
    images_per_request: int = 4
    image_px: int = 1024  # each image is image_px x image_px pixels
    rounds: int = 5  # alone/with-burst pairs; p99 is also pooled over them, one round being noisy
    # The burst's requests go to the text model, which refuses them (400, no input named 'image')
    # once the router has read them: what carrying the bodies alone costs the text requests.
    bodies_only: bool = False
    # Instead of the burst: this many busy-loop processes under SCHED_IDLE beside the text requests,
    # sharing nothing with them (no requests, no GIL, no memory to speak of): what CPU-bound work
    # in the lowest CPU class costs the text path on this machine, whatever that work is.
    idle_load: int = 0

    @classmethod
    def smoke(cls) -> ImageSettings:
        return cls(seconds=3.0, warmup=0.5, png_rate=2.0, images_per_request=2, image_px=256, rounds=1)


def png_images(n: int, px: int, seed: int = 0) -> list[bytes]:
    """Photo-like PNGs (smooth gradients, a few shapes, mild noise): sizes and decode costs of real
    pictures, not of flat colour or white noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:px, 0:px] / px
    out = []
    for _ in range(n):
        base = np.stack([np.sin(x * rng.uniform(2, 9) + rng.uniform(0, 6)) * np.cos(y * rng.uniform(2, 9))
                         for _ in range(3)], axis=-1)  # fmt: skip
        for _ in range(6):
            cx, cy = rng.uniform(0, 1, 2)
            r = rng.uniform(0.05, 0.2)
            base[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(-1, 1, 3)
        pixels = ((base + 1) * 110 + rng.normal(0, 2, base.shape)).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def png_request(images: list[bytes]) -> dict[str, Any]:
    """A v2 infer body in the binary extension carrying `images` as one BYTES tensor."""
    raw = b"".join(struct.pack("<I", len(i)) + i for i in images)
    header = json.dumps(
        {
            "inputs": [
                {"name": "image", "shape": [len(images)], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}
            ]
        },
        separators=(",", ":"),
    ).encode()
    return {"base64": base64.b64encode(header + raw).decode(), "header_length": len(header)}


def workload(
    path: Path, text_rate: float, png_rate: float, png_bodies: list[dict[str, Any]], png_model: str = IMAGE_MODEL
) -> Path:
    streams = [workloads.StreamSpec("text", f"/v2/models/{TEXT_MODEL}/infer", workloads.text_bodies(64), text_rate).to_json()]
    if png_rate > 0:
        streams.append({"name": "png", "path": f"/v2/models/{png_model}/infer", "weight": png_rate, "headers": {},
                        "bodies": png_bodies})  # fmt: skip
    path.write_text(json.dumps({"streams": streams}))
    return path


IDLE_LOOP = "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"


@contextmanager
def idle_loops(n: int) -> Iterator[None]:
    """`n` busy-loop processes under SCHED_IDLE for the duration."""
    procs = [subprocess.Popen(server_argv([sys.executable, "-c", IDLE_LOOP])) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


TAIL_PARTS = ("queue", "transport", "replica", "router_own", "outside")


def tail_parts(timed: list[tuple[float, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Where the text requests' time went, as the mean of each part over every request and over
    the slowest 1% (at or above the p99): the router's queues, the calls' transport (model round
    trips less the replicas' own time), the replicas' queue and run, the router's own handling
    outside those, and everything outside the router (client, network, HAProxy). The part that
    grows in the tail is where the burst's cost lands."""
    latency = np.asarray([lat for lat, _ in timed])
    cut = float(np.percentile(latency, 99))

    def split(lat: float, t: dict[str, float]) -> dict[str, float]:
        queue, model, replica, total = (t.get(k, 0.0) for k in ("queue", "model", "replica", "total"))
        parts = (queue, model - replica, replica, total - queue - model, lat - total)
        return dict(zip(TAIL_PARTS, parts, strict=True))

    def mean(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(float(np.mean([r[k] for r in rows])), 2) for k in TAIL_PARTS}

    rows = [split(lat, t) for lat, t in timed]
    return {"all": mean(rows), "tail": mean([r for r, lat in zip(rows, latency, strict=True) if lat >= cut])}


def run(s: ImageSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    config = single_versions(yaml.safe_load(config_path.read_text()))
    config["applications"][0]["args"]["model_dir"] = str(model_dir)
    pin_replicas(config, [TEXT_MODEL, IMAGE_MODEL])
    pngs = png_images(8 * s.images_per_request, s.image_px)
    bodies = [png_request(pngs[i : i + s.images_per_request]) for i in range(0, len(pngs), s.images_per_request)]
    out: dict[str, Any] = {
        "settings": asdict(s),
        "png_request_mb": round(np.mean([len(b["base64"]) * 3 / 4 for b in bodies]) / 2**20, 2),
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with RayCluster(DEFAULT_INGRESS, tmp, model_dir) as cluster:
            out["deploy_s"] = round(
                cluster.deploy(config, Probe(f"/v2/models/{TEXT_MODEL}/infer", workloads.text_bodies(1)[0])), 1
            )
            capacity = run_loadgen(
                BASE_URL, workload(tmp / "cap.json", 1.0, 0.0, []), {"concurrency": 8}, s.seconds / 2, s.warmup
            )
            out["text_capacity_rps"] = capacity["goodput_rps"]
            text_rate = round(max(1.0, s.text_share * capacity["goodput_rps"]), 1)
            out["text_rate_rps"] = text_rate
            rounds = []
            # The client's latencies, and the router's own handling time (Server-Timing's total):
            # where the two grow alike, the time went inside the router and the replicas behind it.
            pooled: dict[str, list[float]] = {"alone": [], "with_burst": [], "alone_server": [], "with_burst_server": []}
            timed: dict[str, list[tuple[float, dict[str, float]]]] = {"alone": [], "with_burst": []}
            png_model = TEXT_MODEL if s.bodies_only else IMAGE_MODEL
            burst_rate = 0.0 if s.idle_load else s.png_rate
            for _ in range(s.rounds):
                phases: dict[str, Any] = {}
                for name, png_rate in (("alone", 0.0), ("with_burst", burst_rate)):
                    wl = workload(tmp / f"{name}.json", text_rate, png_rate, bodies, png_model)
                    with idle_loops(s.idle_load if name == "with_burst" else 0):
                        load = run_loadgen(
                            BASE_URL, wl, {"rate": text_rate + png_rate}, s.seconds, s.warmup, max_in_flight=64, raw=True
                        )
                    text = [rec for rec in load.pop("records") if rec[0] == "text" and rec[3] == 200]
                    pooled[name] += [rec[2] for rec in text]
                    pooled[f"{name}_server"] += [rec[5] for rec in text if rec[5] is not None]
                    timed[name] += [(rec[2], rec[7]) for rec in text if rec[7]]
                    kept = ("requests", "statuses", "p50_ms", "p99_ms")
                    streams = {k: {f: v[f] for f in kept} for k, v in load["streams"].items()}
                    phases[name] = {"streams": streams, "cpu_cores_by_role": load["cpu_cores_by_role"]}
                alone, burst = phases["alone"]["streams"]["text"], phases["with_burst"]["streams"]["text"]
                phases["text_p99_ratio"] = (
                    round(burst["p99_ms"] / alone["p99_ms"], 2) if alone["p99_ms"] and burst["p99_ms"] else None
                )
                rounds.append(phases)
            out["rounds"] = rounds
            p99 = {k: float(np.percentile(v, 99)) if v else 0.0 for k, v in pooled.items()}
            out["pooled_text_p99_ms"] = {k: round(v, 2) for k, v in p99.items()}
            out["pooled_text_p99_ratio"] = round(p99["with_burst"] / p99["alone"], 3) if p99["alone"] else None
            server = (p99["alone_server"], p99["with_burst_server"])
            out["pooled_text_server_p99_ratio"] = round(server[1] / server[0], 3) if server[0] else None
            out["text_tail_parts_ms"] = {name: tail_parts(t) for name, t in timed.items() if t}
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    s = r["settings"]
    if s.get("idle_load"):
        burst = (
            f"**not sent**: in its place, {s['idle_load']} busy-loop process(es) under SCHED_IDLE, sharing nothing "
            "with the text requests"
        )
    elif s.get("bodies_only"):
        burst = f"sent to `{TEXT_MODEL}`, which refuses them (400) once the router has read them: the bodies' transport alone"
    else:
        burst = "decoded and resized by the router"
    lines = [
        f"Text (`{TEXT_MODEL}`, v2 JSON) open loop at {r['text_rate_rps']} req/s ({s['text_share']:.0%} of its "
        f"closed-loop capacity, {r['text_capacity_rps']} req/s); the burst: {s['png_rate']} req/s to `{IMAGE_MODEL}`, "
        f"each {s['images_per_request']} PNGs of {s['image_px']}x{s['image_px']} pixels ({r['png_request_mb']} MB per "
        f"request, binary extension), {burst}. {s['seconds']:.0f} s per phase.",
        "",
        "| round | text p50 alone ms | text p99 alone ms | text p50 with burst ms | text p99 with burst ms | p99 ratio "
        "| PNG answered | PNG p99 ms | router cores with burst |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(r["rounds"], 1):
        a, b = p["alone"]["streams"]["text"], p["with_burst"]["streams"]["text"]
        png = p["with_burst"]["streams"].get("png", {})
        lines.append(
            f"| {i} | {a['p50_ms']} | {a['p99_ms']} | {b['p50_ms']} | {b['p99_ms']} | {p['text_p99_ratio']}x | "
            f"{png.get('statuses')} | {png.get('p99_ms')} | {p['with_burst']['cpu_cores_by_role'].get('replica:router')} |"
        )
    if "pooled_text_p99_ratio" in r:
        pooled = r["pooled_text_p99_ms"]
        lines += [
            "",
            f"Text p99 pooled over the rounds: {pooled['alone']} ms alone, {pooled['with_burst']} ms with the burst "
            f"(**{r['pooled_text_p99_ratio']}x**).",
        ]
    if "pooled_text_server_p99_ratio" in r:
        pooled = r["pooled_text_p99_ms"]
        lines += [
            "",
            f"The router's own handling time of the text requests (Server-Timing's total), p99 pooled: "
            f"{pooled['alone_server']} ms alone, {pooled['with_burst_server']} ms with the burst "
            f"({r['pooled_text_server_p99_ratio']}x).",
        ]
    if parts := r.get("text_tail_parts_ms"):
        lines += [
            "",
            "Where the text requests' time went (Server-Timing), mean ms over all of them and over the slowest 1%, "
            "pooled over the rounds:",
            "",
            "| phase | requests | " + " | ".join(TAIL_PARTS) + " |",
            "|---|---|" + "---|" * len(TAIL_PARTS),
        ]
        for phase, by in parts.items():
            for which in ("all", "tail"):
                cells = " | ".join(str(by[which][k]) for k in TAIL_PARTS)
                lines.append(f"| {phase} | {'slowest 1%' if which == 'tail' else 'all'} | {cells} |")
    return "\n".join(lines)
