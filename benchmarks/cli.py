"""`python -m benchmarks SCENARIO`: run one benchmark scenario and write its report.

Run from the repository root; the harness is not installed with the serving package."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cores import CorePlan, usable_cores

SCENARIOS = {
    "compare": "limit (ONNX Runtime in-process at its best batch size), naive (FastAPI + ORT, one session.run per "
    "request, one worker), plain Ray Serve (the model as its own ingress with @serve.batch) and ours (the full app "
    "through the router): closed-loop latency/throughput curves plus one open-loop (Poisson) point",
    "sweep": "ours at max_batch_size 1, 4, 8, 16, 32 under a fixed load: throughput, p50/p99 and replica memory",
    "ingress": "ours behind Ray Serve's default proxy vs HAProxy, each with and without RAY_SERVE_THROUGHPUT_OPTIMIZED=1 "
    "(Ray restarted per setting)",
    "profile": "ours under load with py-spy on the router and model replicas (collapsed stacks)",
    "priority": "high-priority traffic (10% of capacity) alone, then under a low-priority flood at 2x capacity: the "
    "router's priority policy vs plain FIFO, each on a fresh Ray",
    "cascade": "each route (light first, heavy when unsure) vs its heavy model alone: throughput, latency, who answered; "
    "with the calibrated accuracies from the light manifest",
    "contention": "no Ray: a model's bulk-lane throughput under SCHED_IDLE, one session on all its threads vs one "
    "single-threaded session per thread side by side, alone and beside bursty nice-19 load",
    "chaos": "a multi-node Ray cluster on this machine (head + worker node) under steady load: kill a classifier "
    "replica, a router replica, the worker node; wedge the decode loop; mix in malformed requests. Requests lost, "
    "streams' endings, time to recover",
    "flood": "priority when the router is the bottleneck: one high-priority closed-loop client sending JSON images "
    "to resnet-heavy, alone and then beside 64 low-priority closed-loop clients: high p50/p99 both ways, refusals, "
    "low statuses",
    "goodput": "open-loop (Poisson) overload: capacity first, then offered loads from 0.5x to 3x of it with several "
    "priority mixes, each request with a client timeout: per class answered share, p50/p99, refusals and their "
    "latency, timeouts; goodput over capacity; the load generator's CPU",
    "simulate": "no Ray: the router's scheduling policy alone, open loop on a virtual clock, the goodput scenario's "
    "loads and mixes: the real dispatcher with a model's settings from the config, the replica's real batch executor "
    "on simulated sessions; per point goodput over the simulated capacity, each class's share, refusals after waiting, "
    "timeouts, over several seeds",
    "routers": "one model replica behind one router, then two, under the same closed-loop load: throughput, the "
    "rows per batch each router sent and the rows per batch the replica ran (does its executor merge the routers' calls?)",
    "soak": "the whole app at 3x its capacity for 10 minutes, mixed models and priorities: statuses (only 200, "
    "or 429/503 with Retry-After), every process's memory slope after warm-up, the router's task count",
    "images": "text requests alone, then beside a burst of large PNG images decoded by the same router: the text "
    "stream's p99 with the burst over without",
    "lifecycle": "model versions on the shipped config: the traffic split, versioned paths, sticky keys; the response "
    "cache under Zipf traffic with and without it, two routers sharing it through a real Redis that stops mid-run; "
    "shadowing a route's heavy tier (client p99 with and without) and killing the shadow's replicas under load",
    "scaling": "scale from zero and a load spike on the shipped config: each model's first answer after idle at zero "
    "replicas (min_replicas 0, initial_replicas 0) against warm, and the time back to zero; a classifier autoscaling "
    "1-4 replicas under a step from its one-replica capacity to 4x: replicas over time, time to scale up and back "
    "down, p99 and refusals per priority",
    "wire": "the same requests to the same app over OIP v2 gRPC (Triton's asyncio gRPC client through Serve's gRPC "
    "proxy), HTTP with binary tensors and HTTP with JSON: goodput, p50/p99, and CPU per request of the ingress proxy, "
    "the router and the model replica",
    "precision": "no Ray: each classifier's FP32 graph beside its INT8 variant in ONNX Runtime on the CPU: test "
    "accuracy, rows/s at batch 1 and at max_batch_size, p50 of one row, file size, session memory",
    "multiplex": "many text models on one pool of replicas (a `review-*` multiplexed entry): Zipf popularity over them "
    "(hit ratio, cold loads, memory per replica against models held), one hot model with the pool's placement on and "
    "off (a second copy or none), and a few models as deployments of their own against the pool serving just those",
    "generation": "the GPT deployment with continuous batching vs the @serve.batch request-level version, same model and "
    "batch size: streaming completions of mixed lengths, tokens/s, TTFT p50/p99, ITL p99, latency",
}

EPILOG = """\
Each scenario runs its setups side by side, in one invocation, on the same model files.
Results go to benchmarks/results/<scenario>/<config name>/: result.json (all raw
figures, machine info, the command), README.md (tables) and PNG plots.
Examples (from the repository root):
  python -m benchmarks compare                                   # demo catalog, configs/local.yaml
  python -m benchmarks compare --config configs/bench-realsize.yaml   # BERT-base / ResNet-50 shapes
  python -m benchmarks sweep --smoke --model-dir /tmp/tiny       # seconds, for CI
  python -m benchmarks generation --concurrency 8 32 --rounds 3
  python -m benchmarks SCENARIO --help
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=Path("configs/local.yaml"), help="Serve config of ours (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, help="built models (default: the config's model_dir)")
    p.add_argument("--models", nargs="+", default=["bert-heavy", "resnet-heavy"], help="default: %(default)s")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/<scenario>/<config name>")
    p.add_argument("--seconds", type=float, help="measured seconds per point")
    p.add_argument("--concurrency", type=int, nargs="+", help="closed-loop levels of the compare curves")
    p.add_argument("--smoke", action="store_true", help="a few seconds per step: checks the harness, not the numbers")
    p.add_argument(
        "--client-cores",
        help="taskset list for the harness and its load generators (default: the highest usable core; benchmarks/cores.py)",
    )
    p.add_argument("--server-cores", help="taskset list for Ray, HAProxy, Redis and the baselines (default: the rest)")
    p.add_argument(
        "--shared-cores",
        action="store_true",
        help="client and server on every core, as a figure that does not count as a user's would (--smoke's default)",
    )
    p.add_argument("--batch", type=int, default=16, help="generation: KV slots = max_batch_size (default: %(default)s)")
    p.add_argument(
        "--request-waits",
        type=float,
        nargs="+",
        help="generation: @serve.batch wait timeouts, one request-level setup each (default: the config's)",
    )
    p.add_argument(
        "--router-delay-target-ms",
        type=float,
        help="flood: the router's own overload target (scheduling.router_delay_target_ms); default: the config's",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=(
            *("replica", "router", "stall", "malformed", "node"),
            *("zipf", "zipf_no_second_copy", "zipf_open", "hot", "separate", "sizes"),
        ),
        help="chaos: the phases to run, in order (default: all five); multiplex: the phases to run (default: all)",
    )
    p.add_argument("--routers", type=int, help="chaos: router replicas (default: 2, as configs/local.yaml runs them)")
    p.add_argument(
        "--size-sources", type=Path, nargs="+", help="multiplex: further text model directories for the load-time-by-size phase"
    )
    p.add_argument(
        "--bodies-only",
        action="store_true",
        help="images: the burst's bodies are sent to the text model, which refuses them once read (their transport alone)",
    )
    p.add_argument(
        "--idle-load",
        type=int,
        default=0,
        help="images: instead of the burst, this many SCHED_IDLE busy-loop processes beside the text requests",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="compare: after the curves, plain and ours deployed in turn this many rounds at the headline concurrency",
    )
    p.add_argument(
        "--pair-setups",
        nargs="+",
        default=["ours", "plain"],
        choices=["ours", "ours-handle", "plain"],
        help="compare --pairs: setups deployed in turn; ours-handle: ours with scheduling.local_link off (default: %(default)s)",
    )
    p.add_argument(
        "--plain-replicas", type=int, default=2, help="compare, generation: plain Ray Serve's replicas (default: %(default)s)"
    )
    p.add_argument("--loads", type=float, nargs="+", help="goodput: offered loads over capacity (default: 0.5 0.9 1.5 3)")
    p.add_argument(
        "--capacity-rps", type=float,
        help="goodput: the loads are multiples of this rate, not of the capacity measured (which is still reported)",
    )  # fmt: skip
    p.add_argument(
        "--mixes", nargs="+", help="goodput: priority mixes, by name: no-high trickle 10/30/60 mostly-high (default: all)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="generation: phases of each setup per concurrency; goodput --degrade and cascade: alternated rounds "
        "(default: %(default)s)",
    )
    p.add_argument("--seeds", type=int, help="simulate: runs of every mix, each with its own arrivals (default: 3)")
    p.add_argument(
        "--degrade",
        nargs="+",
        choices=["on", "off"],
        help="goodput on a tiered route: run each point with the route as configured (on) and with a copy that never "
        "degrades (off), alternated --rounds times",
    )


@dataclass
class Invocation:
    """What every scenario runner gets: the parsed command line and what it resolved to."""

    ns: argparse.Namespace
    config: dict[str, Any]
    model_dir: Path
    settings: Any  # benchmarks.scenarios.Settings
    out_dir: Path

    def catalog(self) -> dict[str, Any]:
        models: dict[str, Any] = self.config["applications"][0]["args"]["models"]
        return models

    def batch_sizes(self) -> dict[str, int]:
        return {m: int(self.catalog()[m].get("batching", {}).get("max_batch_size", 16)) for m in self.settings.models}


def _with_settings(
    module_name: str,
    settings_class: str,
    seconds_field: str = "seconds",
    options: Callable[[Any, argparse.Namespace], None] = lambda settings, ns: None,
) -> Callable[[Invocation], Any]:
    """A scenario module with a settings dataclass (its `smoke()` for --smoke) and
    `run(settings, model_dir, config_path)`; --seconds sets `seconds_field`, `options` the rest."""

    def runner(inv: Invocation) -> Any:
        module = importlib.import_module(f"benchmarks.{module_name}")
        cls = getattr(module, settings_class)
        settings = cls.smoke() if inv.ns.smoke else cls()
        if inv.ns.seconds:
            setattr(settings, seconds_field, inv.ns.seconds)
        options(settings, inv.ns)
        return module.run(settings, inv.model_dir, inv.ns.config.resolve())

    return runner


def _chaos_options(settings: Any, ns: argparse.Namespace) -> None:
    _phases(settings, ns)
    if ns.routers is not None:
        if ns.routers < 1:
            raise SystemExit("--routers: at least one")
        settings.routers = ns.routers


def _multiplex_options(settings: Any, ns: argparse.Namespace) -> None:
    _phases(settings, ns)
    if ns.size_sources:
        settings.size_sources = tuple(str(p) for p in ns.size_sources)


def _phases(settings: Any, ns: argparse.Namespace) -> None:
    """--phases: a subset of the scenario's own (its settings' default), in the order given."""
    if ns.phases:
        known = type(settings)().phases
        if unknown := [p for p in ns.phases if p not in known]:
            raise SystemExit(f"--phases: {', '.join(unknown)} not among this scenario's: {', '.join(known)}")
        settings.phases = tuple(ns.phases)


def _images_options(settings: Any, ns: argparse.Namespace) -> None:
    settings.bodies_only = ns.bodies_only
    settings.idle_load = ns.idle_load


def _flood_options(settings: Any, ns: argparse.Namespace) -> None:
    settings.router_delay_target_ms = ns.router_delay_target_ms


def _model_loads_mixes(settings: Any, ns: argparse.Namespace) -> None:
    if len(ns.models) == 1:  # one model named: that one (else the scenario's default)
        settings.model = ns.models[0]
    if ns.loads:
        settings.loads = tuple(ns.loads)
    if ns.mixes:
        settings.mixes = tuple(ns.mixes)


def _goodput(settings: Any, ns: argparse.Namespace) -> None:
    _model_loads_mixes(settings, ns)
    if ns.capacity_rps:
        settings.capacity_rps = ns.capacity_rps
    if ns.degrade:
        settings.degrade = tuple(ns.degrade)
        settings.rounds = ns.rounds


def _simulate(settings: Any, ns: argparse.Namespace) -> None:
    _model_loads_mixes(settings, ns)
    if ns.seeds:
        settings.seeds = ns.seeds


def _generation(inv: Invocation) -> Any:
    from benchmarks import generation, scenarios

    ns = inv.ns
    gpt_batching = inv.catalog()["gpt"].get("batching", {})
    waits = ns.request_waits or [gpt_batching.get("batch_wait_timeout_s", 0.01)]
    gen_config = generation.generation_config(inv.config, inv.model_dir, ns.batch, waits, ns.plain_replicas)
    concurrencies = ns.concurrency or ([4] if ns.smoke else [8, 32])
    seconds = ns.seconds or (2.0 if ns.smoke else 20.0)
    warmup, rounds = (0.5, 1) if ns.smoke else (3.0, ns.rounds)
    return generation.run(gen_config, inv.model_dir, concurrencies, seconds, warmup, rounds, scenarios.DEFAULT_INGRESS)


def _contention(inv: Invocation) -> Any:
    from benchmarks import contention
    from serve_app.config import advanced_of

    ns, models = inv.ns, inv.settings.models
    threads = max(int(advanced_of(inv.catalog()[m]).get("intra_op_threads") or 1) for m in models)
    return contention.run(
        {m: inv.model_dir / m for m in models}, inv.batch_sizes(), max(2, threads), [0.0, 0.1, 0.2],
        2.0 if ns.smoke else (ns.seconds or 6.0), 1 if ns.smoke else 2,
    )  # fmt: skip


def _wire(inv: Invocation) -> Any:
    from benchmarks import wire

    ns = inv.ns
    ws = wire.WireSettings.smoke() if ns.smoke else wire.WireSettings()
    if ns.seconds:
        ws.seconds = ns.seconds
    if ns.concurrency:
        ws.concurrency = ns.concurrency[0]
    ws.rounds = 1 if ns.smoke else ns.rounds
    return wire.run(ws, inv.settings.models, inv.model_dir, ns.config.resolve())


def _precision(inv: Invocation) -> Any:
    from benchmarks import precision

    ns = inv.ns
    return precision.run(
        {m: inv.model_dir / m for m in inv.settings.models}, inv.batch_sizes(), 2, 1.0 if ns.smoke else (ns.seconds or 5.0),
        1 if ns.smoke else ns.rounds, 200 if ns.smoke else 2000,
    )  # fmt: skip


def _profile(inv: Invocation) -> Any:
    from benchmarks import scenarios

    return scenarios.profile(inv.settings, inv.out_dir)


# Scenarios with a runner of their own; the rest are benchmarks.scenarios.SCENARIOS, run on Settings.
RUNNERS: dict[str, Callable[[Invocation], Any]] = {
    "profile": _profile,
    "generation": _generation,
    "chaos": _with_settings("chaos", "ChaosSettings", options=_chaos_options),
    "flood": _with_settings("flood", "FloodSettings", options=_flood_options),
    "goodput": _with_settings("goodput", "GoodputSettings", options=_goodput),
    "soak": _with_settings("soak", "SoakSettings"),
    "simulate": _with_settings("simulate", "SimulateSettings", options=_simulate),
    "routers": _with_settings("routers", "RoutersSettings"),
    "images": _with_settings("images", "ImageSettings", options=_images_options),
    "lifecycle": _with_settings("lifecycle", "LifecycleSettings"),
    "scaling": _with_settings("scaling", "ScalingSettings", seconds_field="spike_s"),
    "multiplex": _with_settings("multiplex", "MultiplexSettings", options=_multiplex_options),
    "contention": _contention,
    "wire": _wire,
    "precision": _precision,
}


SMOKE_INPUTS = 64


def core_plan(ns: argparse.Namespace) -> CorePlan:
    """Clients on cores of their own unless told to share (a smoke run checks the harness only)."""
    if ns.shared_cores or (ns.smoke and not (ns.client_cores or ns.server_cores)):
        return CorePlan(None, None)
    try:
        return CorePlan.split(usable_cores(), ns.client_cores, ns.server_cores)
    except ValueError as e:
        raise SystemExit(f"--client-cores/--server-cores: {e}") from None


def run(ns: argparse.Namespace, argv: list[str]) -> int:
    import yaml

    from benchmarks import report, scenarios
    from serve_app.config import AppArgs

    plan = core_plan(ns)
    plan.apply()
    if ns.smoke:  # a smoke run checks the harness, not the numbers: fewer inputs to build and send
        from benchmarks import workloads

        workloads.DISTINCT_INPUTS = SMOKE_INPUTS
    config = yaml.safe_load(ns.config.read_text())
    # Where the app itself reads its models: the config's `model_dir`, else its default.
    shipped = AppArgs.model_fields["model_dir"].default
    model_dir = (ns.model_dir or Path(config["applications"][0]["args"].get("model_dir", shipped))).resolve()
    make = scenarios.Settings.smoke if ns.smoke else scenarios.Settings
    if ns.scenario == "generation":
        ns.models = ["gpt"]
    s = make(models=ns.models, model_dir=model_dir, config=ns.config.resolve())
    if ns.seconds:
        s.seconds = ns.seconds
    s.pairs = ns.pairs
    s.plain_replicas = ns.plain_replicas
    s.pair_setups = tuple(ns.pair_setups)
    if ns.concurrency:
        s.concurrencies = ns.concurrency
        s.headline_concurrency = max(ns.concurrency) if s.headline_concurrency not in ns.concurrency else s.headline_concurrency
    # Routes that take their threshold from calibration need one for these model files,
    # as `serve-app models build` does for users.
    from serve_app.config import AppArgs
    from serve_app.tools.catalog_calibrate import calibrate_missing

    calibrate_missing(AppArgs.model_validate({**config["applications"][0]["args"], "model_dir": str(model_dir)}))
    out_dir = ns.out or Path("benchmarks/results") / ns.scenario / ns.config.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench {ns.scenario}: models {s.models} from {model_dir}; writing {out_dir}", flush=True)
    runner = RUNNERS.get(ns.scenario)
    result = runner(Invocation(ns, config, model_dir, s, out_dir)) if runner else scenarios.SCENARIOS[ns.scenario](s)
    res = {
        "scenario": ns.scenario,
        "command": "python -m benchmarks " + shlex.join(argv),
        "machine": report.machine_info(),
        "cores": plan.record(),
        "settings": s.to_json(),
        # The models measured that this config has (a route's scenario measures its tiers, whatever --models says).
        "model_sizes": {m: report.model_size(model_dir / m) for m in s.models if (model_dir / m).is_dir()},
        "result": result,
    }
    res["loadgen_cpu"] = report.loadgen_cost(result)
    path = report.write(ns.scenario, res, out_dir)
    print(f"wrote {path}", flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, help_text in SCENARIOS.items():
        add_arguments(sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
