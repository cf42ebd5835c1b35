"""`serve-app models import` and `models list`: a model directory checked the way the app
builder will check it (serve_app.exports), said in one line per problem."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from serve_app.config import AppArgs
from serve_app.exports import Declared, ExportProblems, describe, discover
from serve_app.families import family
from serve_app.manifest import Manifest
from serve_app.sources import SourceError, local_path


@dataclass(frozen=True)
class Checked:
    manifest: Manifest | None
    model_dir: Path | None
    problems: list[str]


def check(source: str, declared: Declared) -> Checked:
    try:
        model_dir, manifest = discover(local_path(source), declared)
    except ExportProblems as e:
        return Checked(None, None, e.problems)
    except (SourceError, OSError) as e:
        return Checked(None, None, [str(e)])
    return Checked(manifest, model_dir, [])


def summary(m: Manifest) -> str:
    return f"{m.name}: {m.family} ({describe(m)}), graph {m.onnx_file}"


def config_entry(name: str, source: str, m: Manifest, image: dict[str, object] | None) -> str:
    """The entry to put under the app's `args.models`."""
    where = source if "://" in source else str(Path(source).resolve())
    entry: dict[str, object] = {"path": where, "family": m.family}
    if image:
        entry["image"] = image
    return yaml.safe_dump({name: entry}, sort_keys=False, default_flow_style=None).rstrip()


# Model deployments scale on the work the routers hold for them, not only Serve's own count
# (serve_app/scheduling/autoscale.py); a generator's decode loop is its own queue.
DEMAND_POLICY = {"policy_function": "serve_app.scheduling.autoscale:router_demand_policy"}


def deployment_entry(name: str, m: Manifest, num_cpus: float = 1, num_gpus: float = 0) -> str:
    """The entry to put under the application's `deployments:`: without one a model gets Serve's
    one CPU, no GPU and one replica."""
    options: dict[str, object] = {"num_cpus": num_cpus, **({"num_gpus": num_gpus} if num_gpus else {})}
    if family(m.family).generates:
        scaling: dict[str, object] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 16}
    else:
        scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "policy": DEMAND_POLICY}
    entry = {"name": name, "ray_actor_options": options, "autoscaling_config": scaling}
    return yaml.safe_dump([entry], sort_keys=False, default_flow_style=None, width=200).rstrip()


def import_lines(
    source: str, name: str, family: str | None, image: dict[str, object] | None, write: bool,
    num_cpus: float = 1, num_gpus: float = 0,
) -> tuple[list[str], bool]:  # fmt: skip
    """What `models import` prints, and whether the model can be served."""
    checked = check(source, Declared(name, family, image))
    if checked.manifest is None:
        return [f"{name}: {p}" for p in checked.problems], False
    lines = [summary(checked.manifest)]
    if write:
        assert checked.model_dir is not None
        checked.manifest.save(checked.model_dir)
        lines.append(f"wrote {checked.model_dir / 'manifest.json'}")
    lines += ["add to your config's `args.models`:", config_entry(name, source, checked.manifest, image)]
    lines += [
        "and to its `deployments:` (its replicas' resources):",
        deployment_entry(name, checked.manifest, num_cpus, num_gpus),
    ]
    return lines, True


def list_rows(args: AppArgs) -> list[str]:
    """One row per deployment of the config: built, importable, or why it cannot load."""
    from serve_app.exports import load_problem
    from serve_app.tools.catalog_build import plan

    planned = {p.name: p for p in plan(args)}
    rows = []
    for name in args.served:
        source = args.model_source(name)
        if (p := planned.get(name)) is not None:
            state = "built" if p.built and p.variant_built else "missing" if not p.built else f"no {p.precision}"
            rows.append(f"{name:16} {p.preset:14} {p.precision:5} {state:8} {source}")
            continue
        # The app builder's own check: what this row says is what `serve run` will do.
        problem = load_problem(args, name)
        state = "ok" if problem is None else f"cannot load: {problem}"
        precision = args.deployment_config(name).precision
        rows.append(f"{name:16} {'export':14} {precision:5} {'ready' if problem is None else 'broken':8} {source}  {state}")
    return rows
