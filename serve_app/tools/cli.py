"""`serve-app`: build the demo models, and serve a config."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from serve_app.config import MODEL_DIR_ENV
from serve_app.families import FAMILIES
from serve_app.tools.ingress_env import export_lines, with_ingress_env
from serve_app.tools.kuberay import IMAGE, OPERATOR_NAMESPACE

# Where `ray start` notes the cluster this machine runs; `serve run` without --address joins it.
RAY_CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"


def _cmd_build(ns: argparse.Namespace) -> int:
    from serve_app.tools.catalog_build import build_missing, load_app_args

    if ns.model_dir:
        os.environ[MODEL_DIR_ENV] = ns.model_dir
    from serve_app.tools.catalog_calibrate import calibrate_missing

    for args in load_app_args(ns.config):
        build_missing(args, force=ns.force)
        # Routes without a pinned threshold take theirs from calibration: fit any that are missing or stale.
        calibrate_missing(args)
    return 0


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    from serve_app.tools.catalog_build import load_app_args
    from serve_app.tools.catalog_calibrate import calibrate_route, describe

    if ns.model_dir:
        os.environ[MODEL_DIR_ENV] = ns.model_dir
    for args in load_app_args(ns.config):
        for name in ns.route or list(args.routes):
            print(describe(calibrate_route(args, name, ns.max_drop_pp / 100, ns.n, ns.data)))
    return 0


def _cmd_list(ns: argparse.Namespace) -> int:
    from serve_app.tools.catalog_build import load_app_args
    from serve_app.tools.catalog_import import list_rows

    if ns.model_dir:
        os.environ[MODEL_DIR_ENV] = ns.model_dir
    for args in load_app_args(ns.config):
        print("\n".join(list_rows(args)))
    return 0


def _cmd_import(ns: argparse.Namespace) -> int:
    from serve_app.tools.catalog_import import import_lines

    image = {k: v for k, v in (("mean", ns.mean), ("std", ns.std), ("size", ns.size), ("resize", ns.resize)) if v is not None}
    lines, ok = import_lines(ns.source, ns.name, ns.family, image or None, ns.write, ns.num_cpus, ns.num_gpus)
    print("\n".join(lines), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _cmd_serve(ns: argparse.Namespace) -> int:
    """Build what is missing, then hand over to `serve run` (the way users start Serve), with the
    ingress settings Ray must start with (serve_app/tools/ingress_env.py)."""
    _cmd_build(argparse.Namespace(config=ns.config, model_dir=ns.model_dir, force=False))
    if os.environ.get("RAY_ADDRESS") or Path(RAY_CURRENT_CLUSTER).exists():
        # `serve run` then joins a running Ray, which started with its own environment.
        hint = 'For HAProxy there, start it after `eval "$(serve-app ingress-env)"`.'
        print(f"serve-app: a Ray cluster runs already and keeps the ingress it started with. {hint}", file=sys.stderr)
    return subprocess.call(["serve", "run", ns.config, *ns.serve_args], env=with_ingress_env(os.environ))


def _cmd_ingress_env(ns: argparse.Namespace) -> int:
    print(export_lines(with_ingress_env({})))
    return 0


def _cmd_keys_new(ns: argparse.Namespace) -> int:
    import secrets

    from serve_app.scheduling.tenants import key_digest

    key = "sk-" + secrets.token_urlsafe(32)
    print(f"key:        {key}\nkey_sha256: {key_digest(key).hex()}")
    return 0


def _cmd_keys_hash(ns: argparse.Namespace) -> int:
    from serve_app.scheduling.tenants import key_digest

    print(key_digest(sys.stdin.read().strip()).hex())
    return 0


def _cmd_k8s_render(ns: argparse.Namespace) -> int:
    from serve_app.tools.kuberay import render, render_network_policy

    outputs = [
        (ns.output, render(ns.config, image=ns.image, namespace=ns.namespace)),
        (ns.network_policy, render_network_policy(ns.operator_namespace, ns.namespace)),
    ]
    for path, text in outputs:
        if path == "-":
            sys.stdout.write(text)
        elif path:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {path}")
    return 0


def _cmd_k8s_monitoring(ns: argparse.Namespace) -> int:
    from serve_app.observability.manifests import write

    for path in write():
        print(f"wrote {path}")
    return 0


def _add_calibrate(cal: argparse.ArgumentParser) -> None:
    cal.add_argument("--config", default="configs/local.yaml")
    cal.add_argument("--model-dir")
    cal.add_argument("--route", nargs="+", help="default: every route of the config")
    cal.add_argument("--max-drop-pp", type=float, default=0.5, help="accuracy points the cascade may lose vs heavy-only")
    cal.add_argument("--n", type=int, default=2000, help="demo presets: items per split (validation fits, test reports)")
    cal.add_argument(
        "--data", type=Path, help="your labelled data, an .npz of `inputs` and `labels` (half fits, half reports); "
        "needed for any route whose tiers are not demo presets",
    )  # fmt: skip
    cal.set_defaults(func=_cmd_calibrate)


def _add_k8s(parser: argparse.ArgumentParser) -> None:
    """`serve-app k8s render` and `serve-app k8s monitoring`."""
    k8s = parser.add_subparsers(dest="action", required=True)
    render = k8s.add_parser("render", help="write the RayService manifest from a Serve config")
    render.add_argument("--config", default="configs/gpu.yaml")
    render.add_argument("--output", default="k8s/rayservice.yaml", help="file, or - for stdout")
    render.add_argument("--image", default=IMAGE, help="the image every Ray pod runs (built from k8s/Dockerfile, pushed)")
    render.add_argument("--namespace", default=None, help="the namespace to deploy into (default: kubectl's current one)")
    render.add_argument(
        "--operator-namespace", default=OPERATOR_NAMESPACE, help="where KubeRay's operator runs: only it may reach the dashboard"
    )
    render.add_argument(
        "--network-policy", default="k8s/networkpolicy.yaml", help="the NetworkPolicies: a file, - for stdout, '' for none"
    )
    render.set_defaults(func=_cmd_k8s_render)
    monitoring = k8s.add_parser(
        "monitoring", help="write the Grafana dashboard and k8s/monitoring.yaml (PodMonitor, alert rules, dashboard)"
    )
    monitoring.set_defaults(func=_cmd_k8s_monitoring)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="serve-app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models_help = "a config's models: build the demo ones, import your own"
    models = sub.add_parser("models", help=models_help).add_subparsers(dest="action", required=True)
    build = models.add_parser("build", help="build the models a config names and is missing (idempotent)")
    listing = models.add_parser("list", help="every model of a config: built, ready, or why it cannot load")
    for p in (build, listing):
        p.add_argument("--config", default="configs/local.yaml", help="Serve config file (default: %(default)s)")
        p.add_argument("--model-dir", help=f"override the config's model_dir (same as ${MODEL_DIR_ENV})")
    build.add_argument("--force", action="store_true", help="rebuild even when up to date")
    build.set_defaults(func=_cmd_build)
    listing.set_defaults(func=_cmd_list)
    imp = models.add_parser("import", help="check an export (a directory, an .onnx file or s3://...) and print its config entry")
    imp.add_argument("source")
    imp.add_argument("--name", required=True, help="the model's name in the config")
    imp.add_argument("--family", choices=sorted(FAMILIES), help="default: read from the graph")
    imp.add_argument("--mean", type=float, nargs=3, help="image models: per-channel mean on [0, 1] pixels")
    imp.add_argument("--std", type=float, nargs=3, help="image models: per-channel std on [0, 1] pixels")
    imp.add_argument("--size", type=int, help="image models: input size when the graph leaves it open")
    imp.add_argument("--resize", type=int, help="image models: shorter side before the centre crop")
    imp.add_argument("--write", action="store_true", help="write manifest.json into the model directory")
    imp.add_argument("--num-cpus", type=float, default=1, help="each replica's cores (its ONNX Runtime threads follow)")
    imp.add_argument("--num-gpus", type=float, default=0, help="each replica's share of a GPU (0.25: four to a GPU)")
    imp.set_defaults(func=_cmd_import)

    serve = sub.add_parser(
        "serve", help="build missing models, then `serve run` the config with the ingress settings (HAProxy and its knobs)"
    )
    serve.add_argument("--config", default="configs/local.yaml")
    serve.add_argument("--model-dir")
    serve.add_argument("serve_args", nargs=argparse.REMAINDER, help="passed on to `serve run`")
    serve.set_defaults(func=_cmd_serve)
    sub.add_parser(
        "ingress-env", help="print the ingress settings as `export` lines, for every node of a `ray start` cluster"
    ).set_defaults(func=_cmd_ingress_env)

    _add_calibrate(sub.add_parser("calibrate", help="fit each route's escalation threshold on held-out data"))

    keys = sub.add_parser("keys", help="API keys for `tenants`").add_subparsers(dest="action", required=True)
    new_key = keys.add_parser("new", help="print a new random key and the key_sha256 to put in the config")
    new_key.set_defaults(func=_cmd_keys_new)
    hash_key = keys.add_parser("hash", help="print the key_sha256 of a key read from stdin")
    hash_key.set_defaults(func=_cmd_keys_hash)

    _add_k8s(sub.add_parser("k8s", help="Kubernetes (KubeRay) manifests"))

    ns = parser.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
