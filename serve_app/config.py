"""Pydantic schema of the application args (`applications[].args` in the Serve YAML).

Deployment-level knobs (replicas, autoscaling, resources) stay in the Serve
YAML's `deployments:` section, where Ray Serve already validates them; this
schema holds what only this application knows: the catalog and its routes.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from serve_app import sources
from serve_app.families import FAMILIES, DeploymentPlan, Family, FamilyName, family
from serve_app.presets import get_preset

MODEL_DIR_ENV = "SERVE_APP_MODEL_DIR"


class ConfigModel(BaseModel):
    """A section of the config. An unknown field is an error: a misspelt knob (`max_batch_sizes`)
    would otherwise validate and leave its default in force without a word."""

    model_config = ConfigDict(extra="forbid")


class BatchingConfig(ConfigModel):
    """Dynamic batching; sent to replicas as `user_config`, so it is live-tunable."""

    max_batch_size: int = Field(16, ge=1, le=1024)
    batch_wait_timeout_s: float = Field(0.005, ge=0.0, le=1.0)


class FaultConfig(ConfigModel):
    """Deliberate faults for drills and tests, off by default; live-tunable like batching."""

    delay_s: float = Field(0.0, ge=0.0, le=60.0, description="extra seconds every batch takes")
    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of batches that fail with a model error")
    load_delay_s: float = Field(0.0, ge=0.0, le=60.0, description="a multiplexed pool's model: extra seconds each load takes")
    duration_s: float | None = Field(
        None,
        gt=0,
        description="faults last this long from the first batch they touch (an outage that heals); None: until changed",
    )


class ReplicaTuning(BatchingConfig):
    """A model deployment's `user_config`: what can change without restarting replicas."""

    faults: FaultConfig = Field(default_factory=FaultConfig)


class GenerationDefaults(ConfigModel):
    """Generator (GPT) settings. The KV cache is allocated once at replica start: slots x context window."""

    default_max_tokens: int = Field(32, ge=1)
    max_tokens_limit: int = Field(256, ge=1)
    scheduler: Literal["continuous", "request"] = Field(
        "continuous",
        description="continuous: iteration-level batching, sequences join and leave the batch at every decode step; "
        "request: @serve.batch groups requests and decodes each group to its longest member (for comparison)",
    )
    kv_slots: int = Field(16, ge=1, le=1024, description="sequences decoded together; each holds one KV cache slot")
    prefill_chunk: int = Field(32, ge=1, description="prompt tokens one sequence feeds per decode step")
    prefill_budget: int = Field(64, ge=1, description="prompt tokens all sequences feed per decode step")
    max_waiting: int = Field(64, ge=1, description="sequences queued for a slot; beyond that, 503 with Retry-After")
    preemption: bool = Field(
        True, description="a waiting sequence may swap out a running one of lower priority when every slot is taken"
    )
    coalesce_stream: bool = Field(
        True, description="a stream that falls behind the decode loop gets the tokens that piled up as one chunk"
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> GenerationDefaults:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"generation.default_max_tokens ({self.default_max_tokens}) is over max_tokens_limit "
                f"({self.max_tokens_limit}): every request without max_tokens would be refused"
            )
        return self


class TracingConfig(ConfigModel):
    """OpenTelemetry tracing. W3C `traceparent` is always read and carried to the replicas; spans
    are exported (OTLP over HTTP, protobuf) only when an endpoint is configured here or in
    OpenTelemetry's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`/`OTEL_EXPORTER_OTLP_ENDPOINT`."""

    enabled: bool = Field(True, description="false: no spans even when an endpoint is configured")
    otlp_endpoint: str | None = Field(None, description="e.g. http://otel-collector:4318/v1/traces")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="share of new traces recorded; a caller's sampled flag wins (parent-based)"
    )
    service_name: str = Field("serve-app", description="service.namespace; each role adds its own name (router, a model)")
    export_interval_ms: int = Field(1000, ge=10, description="how often buffered spans are sent")
    export_timeout_s: float = Field(5.0, gt=0, description="an export taking longer is dropped, never the request")


class ImagePreprocessing(ConfigModel):
    """How an image model wants its pixels, for exports that do not say (torchvision's, timm's):
    what preprocessor_config.json would give. Each field left out comes from the export."""

    mean: list[float] | None = Field(None, min_length=3, max_length=3, description="per channel, on pixels scaled to [0, 1]")
    std: list[float] | None = Field(None, min_length=3, max_length=3, description="per channel, on pixels scaled to [0, 1]")
    size: int | None = Field(None, ge=1, description="the graph's input height and width, when its input shape leaves them open")
    resize: int | None = Field(
        None, ge=1, description="an encoded image's shorter side is resized to this, then centre-cropped to `size`"
    )


class MultiplexConfig(ConfigModel):
    """Many models of one family on one pool of replicas (serve_app.models.pool)."""

    max_models_per_replica: int = Field(
        4, ge=1, le=256, description="models one replica holds; the least recently used out first"
    )
    busy_batches: int = Field(
        2,
        ge=1,
        le=64,
        description="a replica with this many of one router's batches in flight is busy: a model it holds then loads "
        "on a second replica that has room and would evict no model in use (ray-project/ray#48741)",
    )
    second_copies: bool = Field(
        True,
        description="false: a model runs on one replica at a time, its batches waiting at that replica however busy "
        "(as Ray Serve's own multiplexed routing does); for comparisons",
    )


# Settings that moved under `advanced:`; a config that still sets them at their former place (a
# model's entry, `scheduling`) is read as if it set them there.
MODEL_ADVANCED = ("intra_op_threads", "urgent_lane", "urgent_session", "urgent_threads", "bulk_sessions")
ROUTER_ADVANCED = (
    "queue_delay_target_ms",
    "local_link",
    "router_nice",
    "router_full_gc_max_interval_s",
    "router_delay_target_ms",
    "router_max_inflight",
)


def nest_advanced(data: Any, names: tuple[str, ...]) -> Any:
    """`data` with any of `names` moved into its `advanced` section (where one is given at both
    places, the former place wins: a model version's own setting over its entry's)."""
    if not isinstance(data, dict) or not any(name in data for name in names):
        return data
    data = dict(data)
    advanced = dict(data.get("advanced") or {})
    advanced.update({name: data.pop(name) for name in names if name in data})
    data["advanced"] = advanced
    return data


def advanced_of(section: dict[str, Any], names: tuple[str, ...] = MODEL_ADVANCED) -> dict[str, Any]:
    """A config section's (a model's entry, `scheduling`) `advanced` settings, as written: those
    at their former place included."""
    return dict(nest_advanced(section, names).get("advanced") or {})


class ModelAdvanced(ConfigModel):
    """A model replica's mechanism (a model's `advanced`): threads, sessions and lanes. The defaults
    follow what the deployment was given: intra-op threads its num_cpus, bulk sessions one per
    thread on CPU and one on a GPU."""

    intra_op_threads: int | None = Field(
        None, ge=1, le=256, description="ONNX Runtime threads per replica; default: the replica's num_cpus, rounded up"
    )
    urgent_lane: bool = Field(
        True,
        description="classifiers: run high-priority batches on a session of their own beside the bulk lane's, so they "
        "never wait for a running batch. On CPU the bulk lane runs one single-threaded session per intra-op thread, "
        "side by side. Costs a copy of the weights in replica memory per extra session",
    )
    urgent_session: bool = Field(
        True,
        description="classifiers, with the urgent lane on: whether its batches run on a session of their own beside "
        "the bulk lane (the shortest wait, at the cost of a third copy of the weights and of threads that compete "
        "with the bulk lane's) or, off, next on the bulk lane's sessions, ahead of the bulk batches waiting there "
        "(a high-priority batch then waits for a running batch to end, never for queued ones)",
    )
    urgent_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="classifiers, with the urgent lane on: intra-op threads of the urgent lane's session; default "
        "intra_op_threads. A high-priority batch is usually one row, which a small model's operators do not split "
        "well over threads: fewer threads there leave more of the cores to the bulk lane for about the same "
        "high-priority latency (benchmarks/results/goodput/)",
    )
    bulk_sessions: int | None = Field(
        None,
        ge=1,
        le=256,
        description="classifiers: sessions the bulk lane runs side by side, the intra-op threads split between them, "
        "in the background (the lowest CPU priority). With the urgent lane on, default one per thread on CPU (most "
        "throughput beside other load, see benchmarks/results/contention/bench-realsize/), one on GPUs; 1 runs each "
        "batch on all the threads, so a batch ends sooner, which is what a request waits for at moderate load. With "
        "it off, default 1 (one session at normal priority); more keeps one batch running while the next is sent "
        "and answered, and lets a router on the same cores go first. Each extra session holds a copy of the weights",
    )


class ModelConfig(ConfigModel):
    """One model of the catalog. `preset` builds a demo model; `path` points at any model directory."""

    preset: str | None = None
    family: FamilyName | None = None
    path: str | None = Field(
        None,
        description="model directory, ONNX file, or object-store URI (s3://bucket/prefix, fetched once per node into "
        "$SERVE_APP_MODEL_CACHE); default <model_dir>/<name>. An ordinary export (optimum, torch.onnx.export) serves as "
        "it is: see docs/models.md",
    )
    image: ImagePreprocessing | None = Field(None, description="image models: preprocessing the export does not declare")
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    generation: GenerationDefaults = Field(default_factory=GenerationDefaults)
    max_items_per_request: int = Field(64, ge=1, description="tensor rows accepted in one request")
    advanced: ModelAdvanced = Field(
        default_factory=lambda: ModelAdvanced(),
        description="mechanism with defaults derived from the replica's num_cpus and num_gpus; set only with a measured reason",
    )
    faults: FaultConfig = Field(default_factory=FaultConfig)
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a batch or decode step running longer than this fails the replica's health check, and Serve "
        "replaces the replica. Classifiers: at most scheduling.batch_timeout_s (a larger value is refused; the default "
        "follows a lower batch timeout), as past it the routers no longer wait for the batch, and a replica stuck "
        "longer only takes more batches to fail",
    )
    precision: Literal["fp32", "int8", "fp16"] = Field(
        "fp32",
        description="which graph of the model directory to serve: int8 (CPU; ONNX Runtime quantization) or fp16 (GPU) "
        "variants are built beside the FP32 one by `serve-app models build` and checked against it (classifiers only)",
    )
    version: str = Field("1", min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.]+$", description="this entry's version")
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="set by the app builder from the application's `tracing` section"
    )
    versions: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="further versions, each its own Serve deployment named <model>-v<version> with its own model "
        "directory (default <model_dir>/<model>-v<version>); each takes what it leaves out from this entry",
    )
    multiplex: MultiplexConfig | None = Field(
        None,
        description="an entry whose name holds `*` (`reviews-*`): each model directory under `path` whose name matches "
        "is a model of its own, all served by one pool of replicas that load them on demand",
    )
    pool: str | None = Field(None, description="set by the config: the multiplexed entry this model was found by")

    def tuning(self) -> ReplicaTuning:
        return ReplicaTuning(**self.batching.model_dump(), faults=self.faults)

    @model_validator(mode="before")
    @classmethod
    def _former_places(cls, data: Any) -> Any:
        return nest_advanced(data, MODEL_ADVANCED)

    @model_validator(mode="after")
    def _family_known(self) -> ModelConfig:
        if self.preset is not None:
            preset_family = get_preset(self.preset).family
            if self.family not in (None, preset_family):
                raise ValueError(f"preset {self.preset!r} is a {preset_family} model, not {self.family}")
            self.family = preset_family
        if self.family is None:
            raise ValueError(f"a model needs either a `preset` or an explicit `family` ({', '.join(sorted(FAMILIES))})")
        return self


VERSION_PATTERN = r"^[A-Za-z0-9_.]+$"


def deployment_name(model: str, version: str, first_version: str) -> str:
    """A version's Serve deployment: the model's own name for its entry's version, `<model>-v<version>` for others."""
    return model if version == first_version else f"{model}-v{version}"


@dataclass(frozen=True)
class ServedVersion:
    """One version of one model, as one Serve deployment."""

    model: str
    version: str
    deployment: str
    config: ModelConfig


def expand_versions(name: str, model: ModelConfig) -> list[ServedVersion]:
    """The entry's own version first, then each of `versions` over the entry's settings."""
    out = [ServedVersion(name, model.version, name, model)]
    base = model.model_dump(exclude={"versions", "version", "path"}, exclude_unset=True)
    for version, override in model.versions.items():
        if version == model.version or not re.match(VERSION_PATTERN, version):
            raise ValueError(f"model {name!r}: version {version!r} is the entry's own or not a plain name")
        merged = {**base, **override}
        if "advanced" in base or "advanced" in override:  # per setting, as the entry's own settings
            merged["advanced"] = {**base.get("advanced", {}), **nest_advanced(override, MODEL_ADVANCED).get("advanced", {})}
        if "preset" in override and "family" not in override:
            merged.pop("family", None)
        try:
            config = ModelConfig.model_validate({**merged, "version": version})
        except ValidationError as e:  # its own error would name the field but not the version it is in
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"model {name!r} version {version!r}: {problems}") from None
        if config.versions or config.family != model.family:
            raise ValueError(f"model {name!r} version {version!r} must be a {model.family} model without versions of its own")
        out.append(ServedVersion(name, version, deployment_name(name, version, model.version), config))
    return out


class ShadowConfig(ConfigModel):
    """Mirror a share of a model's answered requests to a candidate version, off the client's path."""

    version: str
    share: float = Field(1.0, ge=0.0, le=1.0, description="share of answered requests mirrored")
    max_inflight: int = Field(
        32, ge=1, description="shadow calls one router holds at once; past it a mirror is skipped (and counted)"
    )
    batch: int = Field(
        1,
        ge=1,
        description="mirrors sent together when the router turns idle: a client request that arrives meanwhile "
        "finds at most this much shadow work running beside it; larger drains waiting mirrors faster",
    )


class RollbackConfig(ConfigModel):
    """When a canary does worse than its baseline over a window, its weight goes to 0."""

    window_s: float = Field(30.0, gt=0, description="outcomes older than this are forgotten")
    min_requests: int = Field(20, ge=1, description="calls each side needs in the window before they are compared")
    max_error_rate_increase: float = Field(
        0.05, ge=0.0, le=1.0, description="roll back when the canary's error rate exceeds the baseline's by more"
    )
    max_p99_ratio: float | None = Field(
        3.0, gt=1.0, description="roll back when the canary's p99 latency exceeds this multiple of the baseline's; None: off"
    )


class TrafficConfig(ConfigModel):
    """Which version answers a model's requests that name none."""

    weights: dict[str, float] = Field(description="version -> relative weight; versions left out get none")
    baseline: str | None = Field(None, description="what canaries are compared with; default: the model's entry version")
    sticky: Literal["none", "session", "tenant"] = Field(
        "none",
        description="session: callers with the same X-Session-Key header stay on one version (A/B tests); tenant: "
        "each tenant stays on one; none: every request drawn anew",
    )
    shadow: ShadowConfig | None = None
    rollback: RollbackConfig | None = None

    @model_validator(mode="after")
    def _weights_valid(self) -> TrafficConfig:
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError("traffic weights must be non-negative with at least one above 0")
        if not math.isfinite(sum(self.weights.values())):  # inf or NaN, or a sum past the largest float
            raise ValueError("traffic weights must be finite numbers of reasonable size")
        return self


class RouterLiveConfig(ConfigModel):
    """The router deployment's `user_config`: applied by running routers, without a restart, on `serve deploy`."""

    traffic: dict[str, TrafficConfig] = Field(default_factory=dict, description="per model")


class CacheConfig(ConfigModel):
    """The router's response cache: a local LRU bounded in bytes, then an optional shared Redis tier."""

    enabled: bool = False
    max_bytes: int = Field(64 * 2**20, ge=0, description="the local tier's size bound; 0 turns it off")
    max_entry_bytes: int = Field(2**20, ge=1, description="larger answers are not cached")
    models: list[str] | None = Field(None, description="models and routes cached; None: every classifier and route")
    per_tenant: bool = Field(False, description="key answers per tenant, so one never sees an answer another paid for")
    redis_url: str | None = Field(None, description="shared tier, e.g. redis://redis:6379/0; None: local only")
    redis_url_env: str | None = Field(None, description="environment variable holding the URL (wins over redis_url)")
    ttl_s: int = Field(3600, ge=1, description="how long the shared tier keeps an answer")
    redis_timeout_s: float = Field(0.05, gt=0, description="a shared-tier call slower than this counts as a miss")
    redis_retry_s: float = Field(5.0, gt=0, description="after a shared-tier failure, skip it this long before trying again")
    key_prefix: str = Field("serve-app:cache:", description="namespace of keys in Redis")

    def url(self) -> str | None:
        if self.redis_url_env:
            return os.environ.get(self.redis_url_env) or self.redis_url
        return self.redis_url


class DegradeConfig(ConfigModel):
    """When a route's light tier answers alone, marked degraded (X-Degraded), instead of the heavy
    tier answering or refusing (serve_app/scheduling/protection/degrade.py)."""

    priorities: list[Literal["high", "normal", "low"]] = Field(
        ["low", "normal", "high"],
        description="the classes the light tier may answer alone: while the heavy tier's queue stands over "
        "`delay_target_ms`, a share of low, then of normal, skips it; and when the heavy tier refuses (overloaded, or "
        "too slow for the deadline) a listed class gets the light answer instead of the 503. High never skips the "
        "heavy tier ahead of a refusal. An empty list: escalations always go to the heavy tier and take its refusal",
    )
    delay_target_ms: float | None = Field(
        None,
        gt=0,
        description="the heavy queue's standing delay over which degrading starts; default half of "
        "scheduling.advanced.queue_delay_target_ms, so that degrading comes before the heavy tier refuses",
    )
    heavy_wait_ms: float | None = Field(
        None,
        gt=0,
        description="the longest an escalation waits for the heavy tier before the light answer in hand answers it "
        "(degraded), whatever its class: a route keeps answering while its heavy tier's replicas are lost with their "
        "node and placed again. None: as long as the heavy tier takes, within its own queue's limits",
    )


class RouteConfig(ConfigModel):
    """Tiered route: the light model answers unless its confidence is below `threshold`.

    Leave `threshold` out to use the one `serve-app calibrate` fitted on held-out data
    (stored in the light model's manifest); set it to pin a value by hand.
    """

    light: str
    heavy: str
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    signal: Literal["max_prob", "margin", "entropy"] = "max_prob"
    degrade: DegradeConfig = Field(default_factory=DegradeConfig)


class RouterAdvanced(ConfigModel):
    """The router's mechanism (`scheduling.advanced`): how it queues, yields the cores and refuses
    when saturated. The defaults fit a router on cores of its own, as the KubeRay manifest runs it."""

    queue_delay_target_ms: float = Field(
        500.0,
        gt=0,
        description="how long a request may be predicted to wait in a model's queue in the router, by class (at least "
        "two full batches): low is admitted within this, normal within twice it, high within max_queue_delay_s; the "
        "rest is refused at once (503 + Retry-After). Past capacity the queue so holds about this much work and the "
        "model never runs dry; below it nothing is refused",
    )
    local_link: bool = Field(
        False,
        description="a single-node option: send batches to classifier replicas on the router's own node over a unix "
        "socket (serve_app.link) instead of Serve's handle, which stays the fallback and the way to replicas on other "
        "nodes. Serve's own request metrics and max_ongoing_requests do not see these batches (the app's metrics do); "
        "with routers and models on different nodes (KubeRay's layout) it never engages",
    )
    router_nice: int | None = Field(
        19,
        ge=-20,
        le=19,
        description="niceness of the router's threads: 19 lets model replicas' urgent lanes on the same node take "
        "the cores first (serve_app/process/cpu_priority.py); None keeps Ray's worker default",
    )
    router_full_gc_max_interval_s: float | None = Field(
        None,
        gt=0,
        description="opt-in: the router runs Python's full garbage collections itself, when idle and at the latest "
        "this long after the last one (serve_app/process/gcwatch.py), instead of Python doing so mid-flood, where each "
        "pause stops every request on the router. Off by default: a collection started after 1 s idle can still meet "
        "a burst arriving just then, and its benefit to p99 is not shown yet (benchmarks/results/priority/bench-realsize/)",
    )
    router_delay_target_ms: float | None = Field(
        None,
        gt=0,
        description="the router's own overload control (serve_app/scheduling/protection/overload.py): while its event loop stays "
        "later than this for a whole interval (the router is saturated, not merely busy), a growing share of low "
        "priority is refused from the headers (503 + Retry-After), then of normal; high priority always goes on. "
        "None: off",
    )

    router_max_inflight: int | None = Field(
        None,
        ge=1,
        description="requests one router replica holds at once, judged from the headers before the body is read: "
        "past it low priority is refused at once (503 + Retry-After), normal past 1.5 times it, high past twice it "
        "(serve_app/scheduling/protection/concurrency.py). Keeps an overloaded router's event loop short, its health checks "
        "answered and its refusals fast. None: off",
    )


class SchedulingConfig(ConfigModel):
    """The router's per-model queues (see serve_app.scheduling.dispatcher)."""

    policy: Literal["priority", "fifo"] = Field(
        "priority", description="priority: classes, deadlines, shedding; fifo: one bounded FIFO queue (the baseline)"
    )
    max_queue_items: int = Field(1024, ge=1, description="rows queued per model per router; beyond it, shed or refuse")
    max_queue_delay_s: float = Field(
        2.0, gt=0, description="refuse work predicted to wait longer than this (503 with Retry-After)"
    )
    max_queued_s: float = Field(
        10.0,
        gt=0,
        description="the longest any request waits in a router's queue, whatever its deadline: past it, a 503 with "
        "Retry-After (higher classes arriving without end could otherwise hold lower ones until clients give up)",
    )
    default_priority: Literal["high", "normal", "low"] = "normal"
    anonymous_max_priority: Literal["high", "normal", "low"] = Field(
        "normal",
        description="with no tenants configured, the highest priority any caller may ask for. High priority evicts "
        "queued work and preempts running generations, so it is for known callers; set `high` only where every "
        "caller is trusted (a benchmark, a private network)",
    )
    batch_timeout_s: float = Field(30.0, gt=0, description="a batch taking longer is a model failure")
    breaker_failures: int = Field(5, ge=1, description="failed batches in a row that open a model's circuit")
    breaker_open_s: float = Field(5.0, gt=0, description="how long an open circuit fails fast before one probe")
    advanced: RouterAdvanced = Field(
        default_factory=lambda: RouterAdvanced(),
        description="the router's mechanism; defaults fit a router of its own; set only with a measured reason",
    )

    @model_validator(mode="before")
    @classmethod
    def _former_places(cls, data: Any) -> Any:
        return nest_advanced(data, ROUTER_ADVANCED)


class TenantConfig(ConfigModel):
    """One API client. Its key is given hashed (`key_sha256`) or read from an env var or a file, never in clear."""

    name: str
    key_sha256: str | None = Field(None, description="hex SHA-256 of the key (`serve-app keys hash`)")
    key_env: str | None = Field(None, description="environment variable holding the key")
    key_file: str | None = Field(None, description="file holding the key (e.g. a mounted Kubernetes secret)")
    max_priority: Literal["high", "normal", "low"] = Field("high", description="the best priority this tenant may ask for")
    rate_per_s: float | None = Field(None, gt=0, description="sustained requests per second; None: unlimited")
    burst: int = Field(20, ge=1, description="requests allowed at once above the rate")
    operator: bool = Field(False, description="may read /router/status (every model's queues and every tenant's traffic)")

    @model_validator(mode="after")
    def _one_key_source(self) -> TenantConfig:
        sources = [x for x in (self.key_sha256, self.key_env, self.key_file) if x]
        if len(sources) != 1:
            raise ValueError(f"tenant {self.name!r} needs exactly one of key_sha256, key_env, key_file")
        if self.key_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.key_sha256):
            raise ValueError(f"tenant {self.name!r}: key_sha256 must be 64 hex characters (`serve-app keys hash`)")
        return self


class LimitsConfig(ConfigModel):
    """What one request may ask of the router; past these it gets a 4xx before any model time is spent."""

    max_request_bytes: int = Field(
        64 * 2**20,
        ge=1024,
        description="request body limit (413); 64 MiB holds about 110 ResNet-50 images (224x224x3) as binary FP32, "
        "and several times fewer as JSON numbers",
    )
    max_text_chars: int = Field(
        20_000,
        ge=1,
        description="characters per text or prompt; text classifiers truncate to their token window after this check",
    )
    max_inflight_bytes: int = Field(
        512 * 2**20,
        ge=1024,
        description="request body bytes one router replica holds at once, over all requests in flight; past it a "
        "request gets 503 with Retry-After. Bounds the router's memory by bytes, whatever the request count",
    )
    infer_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a repository load call's whole time (504 past it); and, only where an operator opts into "
        "the direct path past Serve's per-request handling (/router/status: direct_infer), a v2 infer call's. "
        "Every other call ends at Serve's http_options.request_timeout_s (408), under every launcher",
    )
    generation_timeout_s: float = Field(
        600.0,
        gt=0,
        description="a generation whose request sets no deadline (X-Request-Timeout-Ms) ends after this: 504, or an "
        "error event that ends the stream",
    )

    @model_validator(mode="after")
    def _one_request_fits(self) -> LimitsConfig:
        if self.max_inflight_bytes < self.max_request_bytes:
            raise ValueError("limits.max_inflight_bytes must be at least max_request_bytes, or a full-size request never fits")
        return self


def pool_deployment(pattern: str) -> str:
    """The Serve deployment of a multiplexed entry: `reviews-*` -> `reviews-pool`."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", pattern.replace("*", "")).strip("-")
    return f"{stem}-pool" if stem else "pool"


def expand_pools(data: Any) -> Any:
    """A raw config's multiplexed entries (`reviews-*`) as one model per matching directory under
    their `path`, each marked with its entry (`pool`); the entries themselves move to `pools`."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        return data
    models = dict(data["models"])
    pools = dict(data.get("pools") or {})
    for pattern in [name for name in models if "*" in name]:
        entry = models.pop(pattern)
        if not isinstance(entry, dict) or entry.get("multiplex") is None or not entry.get("path"):
            raise ValueError(
                f"{pattern!r}: a name with `*` is a multiplexed pool; give it `multiplex` and a `path` to its models"
            )
        if entry.get("versions"):
            raise ValueError(f"{pattern!r}: a multiplexed pool's models have no versions")
        root = str(entry["path"])
        try:
            found = [name for name in sources.children(root) if in_pool(pattern, name)]
        except sources.SourceError as e:
            raise ValueError(f"{pattern!r}: {e}") from None
        if not found:
            raise ValueError(f"{pattern!r}: no model directory under {root} matches")
        # No urgent lane unless the entry asks: its second session would hold a second copy of
        # every loaded model's weights, and a pool's replica memory is what its models share.
        # Its path made absolute where the app is built, as its members' are: the routers and the
        # pool's replicas find models added since under it (routing/members.py).
        absolute = root if sources.is_remote(root) else str(Path(root).expanduser().resolve())
        pools[pattern] = {**nest_advanced(entry, MODEL_ADVANCED), "path": absolute}
        pools[pattern]["advanced"] = {"urgent_lane": False, **pools[pattern].get("advanced", {})}
        for name in found:
            if name in models:
                raise ValueError(f"{name!r} is both a model of its own and one of pool {pattern!r}")
            models[name] = pool_member(pools[pattern], pattern, name)
    return {**data, "models": models, "pools": pools}


def pool_member(entry: dict[str, Any], pattern: str, name: str) -> dict[str, Any]:
    """A pool member's own entry: the pool's, with the member's directory under the pool's path."""
    member = {k: v for k, v in entry.items() if k not in ("multiplex", "pool")}
    return {**member, "path": member_path(str(entry["path"]), name), "pool": pattern}


def member_path(root: str, name: str) -> str:
    """A pool member's own source: its directory under the pool's (a URI stays one, fetched on load)."""
    if sources.is_remote(root):
        return f"{root.rstrip('/')}/{name}"
    return str((Path(root).expanduser() / name).resolve())


# A member's name becomes a directory under its pool's path: one plain path segment, no more.
MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def in_pool(pattern: str, name: str) -> bool:
    """Whether `name` may be one of the pool `pattern`'s models (fnmatch's `*` would also match a `/`)."""
    return MEMBER_NAME.fullmatch(name) is not None and ".." not in name and fnmatch.fnmatchcase(name, pattern)


class AppArgs(ConfigModel):
    model_dir: str = Field("models", description=f"root of model directories; ${MODEL_DIR_ENV} overrides it")
    models: dict[str, ModelConfig]
    pools: dict[str, ModelConfig] = Field(
        default_factory=dict, description="set by the config: the multiplexed entries, their models listed in `models`"
    )
    routes: dict[str, RouteConfig] = Field(default_factory=dict)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    tenants: list[TenantConfig] = Field(default_factory=list, description="API keys; none configured = open server")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="set by the app builder: deployments whose model cannot load, with the reason. Their requests get "
        "503 with the reason; server readiness leaves them out, so the other models stay in service",
    )
    traffic: dict[str, TrafficConfig] = Field(
        default_factory=dict,
        description="the routers' starting traffic policy per model; the router deployment's user_config "
        "(RouterLiveConfig) replaces it live",
    )

    @model_validator(mode="before")
    @classmethod
    def _pools_expanded(cls, data: Any) -> Any:
        return expand_pools(data)

    @model_validator(mode="after")
    def _routes_consistent(self) -> AppArgs:
        if not self.models:
            raise ValueError("the catalog is empty: name at least one model under `models`")
        self._served = {s.deployment: s for name, m in self.models.items() for s in expand_versions(name, m)}
        self._versions = {}
        for s in self._served.values():
            self._versions.setdefault(s.model, {})[s.version] = s.deployment
        if len(self.served) != sum(1 + len(m.versions) for m in self.models.values()):
            raise ValueError("two versions map to one deployment name; rename a model or a version")
        check_traffic(self, self.traffic)
        self._check_stall_timeouts()
        for name in self.cache.models or []:
            if not self.is_name(name):
                raise ValueError(f"cache.models names unknown model {name!r}")
        for name, route in self.routes.items():
            if name in self.models:
                raise ValueError(f"route {name!r} has the same name as a model; pick another")
            for tier in (route.light, route.heavy):
                if tier not in self.models:
                    raise ValueError(f"route {name!r} names unknown model {tier!r}; known: {sorted(self.models)}")
            families = {self.models[route.light].family, self.models[route.heavy].family}
            if len(families) != 1 or not self.family_of(route.light).cascades:
                raise ValueError(f"route {name!r} must join two classifiers of one family, got {sorted(map(str, families))}")
        return self

    def _check_stall_timeouts(self) -> None:
        # Past the routers' batch timeout a stuck classifier still passes its health check while
        # every batch sent to it fails: Serve would replace it only after more batches were lost.
        limit = self.scheduling.batch_timeout_s
        for name, s in list(self._served.items()):
            if self.family_of(s.deployment).generates or s.config.stall_timeout_s <= limit:
                continue
            if "stall_timeout_s" not in s.config.model_fields_set:
                # The default follows a lowered batch timeout; in a copy, as the caller may hold this config.
                config = s.config.model_copy(update={"stall_timeout_s": limit})
                config.model_fields_set.add("stall_timeout_s")
                self._served[name] = replace(s, config=config)
                if name == s.model:
                    self.models[s.model] = config
            else:
                raise ValueError(
                    f"{s.deployment}: stall_timeout_s {s.config.stall_timeout_s:g} is above scheduling.batch_timeout_s "
                    f"{limit:g}; keep it at or below, so that a replica stuck on a batch fails its health check"
                )

    _served: dict[str, ServedVersion] = PrivateAttr(default_factory=dict)
    # model -> version -> deployment, made with `_served`: the router asks for it on every call.
    _versions: dict[str, dict[str, str]] = PrivateAttr(default_factory=dict)

    # The router reaches these on every request: each is looked up once through pydantic (whose
    # lookup of a private attribute is many times slower than a plain one) and then kept in the
    # instance's dict. Both dicts are made whole by the validator above and then only read.
    @cached_property
    def served(self) -> dict[str, ServedVersion]:
        """Deployment name -> the model version it serves."""
        return self._served

    @cached_property
    def version_index(self) -> dict[str, dict[str, str]]:
        """Model -> version -> deployment."""
        return self._versions

    def is_name(self, name: str) -> bool:
        return name in self.models or name in self.routes

    def versions(self, model: str) -> dict[str, str]:
        """A model's versions -> their deployments, the entry's own first (a copy: callers may edit it)."""
        return dict(self.version_index.get(model, {}))

    def pools_for(self, name: str) -> list[str]:
        """The multiplexed entries whose pattern a model name fits (whether or not it is served)."""
        return [pattern for pattern in self.pools if in_pool(pattern, name)]

    def pool_candidates(self, pattern: str) -> list[str]:
        """The model directories under a pool's path (or S3 prefix) now whose names fit it: those
        added since the build among them. Reads the directory or lists the prefix."""
        return [name for name in sources.children(str(self.pools[pattern].path)) if in_pool(pattern, name)]

    def pool_member_config(self, pattern: str, name: str) -> ModelConfig:
        """The entry `name` has as a model of the pool `pattern`: the pool's, with its own directory
        and, as the build gives the pool's other models, a stall timeout within the batch timeout."""
        entry = self.pools[pattern].model_dump(exclude={"multiplex", "pool"}, exclude_unset=True)
        config = ModelConfig.model_validate(pool_member({**entry, "path": self.pools[pattern].path}, pattern, name))
        limit = self.scheduling.batch_timeout_s
        return config.model_copy(update={"stall_timeout_s": min(config.stall_timeout_s, limit)})

    def add_pool_member(self, pattern: str, name: str) -> bool:
        """Serve `name` as a model of the pool `pattern` from now on (a model directory added under
        the pool's path after the build, loaded through the repository extension). False when the
        name does not fit the pool or names another model or a route; the caller has checked that
        its directory exists."""
        if name in self.models:
            return self.models[name].pool == pattern
        if pattern not in self.pools or not in_pool(pattern, name) or name in self.routes:
            return False
        config = self.pool_member_config(pattern, name)
        self.models[name] = config
        for served in expand_versions(name, config):
            self.served[served.deployment] = served
            self.version_index.setdefault(name, {})[served.version] = served.deployment
        return True

    def deployment_config(self, deployment: str) -> ModelConfig:
        return self.served[deployment].config

    def family_of(self, deployment: str) -> Family:
        """A deployment's family (a model's, by its name: its entry's own deployment)."""
        config = self.served[deployment].config
        assert config.family is not None, "validated config always has a family"
        return family(config.family)

    def model_path(self, deployment: str) -> Path:
        """Absolute model directory of a deployment; resolved where the app is built, not in each replica."""
        cfg = self.served[deployment].config
        root = Path(os.environ.get(MODEL_DIR_ENV) or self.model_dir).expanduser()
        path = Path(cfg.path).expanduser() if cfg.path else root / deployment
        return path.resolve()

    def model_source(self, deployment: str) -> str:
        """Where a deployment's replicas get the model: an object-store URI as configured (each
        node fetches it, serve_app.sources), else the absolute local path."""
        cfg = self.served[deployment].config
        if cfg.path and "://" in cfg.path:
            return cfg.path
        return str(self.model_path(deployment))


def check_traffic(args: AppArgs, traffic: dict[str, TrafficConfig]) -> None:
    """Every model and version a traffic policy names exists; tenant stickiness has tenants to tell apart."""
    for model, policy in traffic.items():
        if model not in args.models:
            raise ValueError(f"traffic names unknown model {model!r}; known: {sorted(args.models)}")
        if policy.sticky == "tenant" and not args.tenants:
            # Every caller is then the one anonymous tenant: all traffic would go to one version.
            raise ValueError(f"traffic for {model!r} is sticky by tenant, but no tenants are configured")
        known = args.versions(model)
        named = [
            *policy.weights,
            *([policy.baseline] if policy.baseline else []),
            *([policy.shadow.version] if policy.shadow else []),
        ]
        for v in named:
            if v not in known:
                raise ValueError(f"traffic for {model!r} names unknown version {v!r}; known: {sorted(known)}")


def deployment_plan(f: Family, config: ModelConfig) -> DeploymentPlan:
    """The deployment to bind for a model of family `f`, and the calls its replicas hold."""
    if not f.generates:
        # The router sends whole batches, about two at a time per replica; the rest is
        # headroom for several routers.
        return DeploymentPlan(f.deployment, 16, -1)
    gen = config.generation
    if gen.scheduler == "request":
        if f.request_scheduler is None:
            raise ValueError(f"the {f.name} family has no deployment for generation.scheduler: request")
        # @serve.batch fills only when a replica may hold a full batch (ray-project/ray#43288).
        return DeploymentPlan(f.request_scheduler, max(2 * config.batching.max_batch_size, 8), -1)
    # Every sequence it can run or queue, plus a few that its scheduler refuses with a 503 and
    # Retry-After rather than leaving them queued, unbounded, at the caller. Past that, calls
    # wait in Serve's queue at the caller, in arrival order and without bound, until clients
    # time out: bound it, and refuse the rest there (503 + Retry-After,
    # serve_app.router.endpoints.generation). Every call passes through that queue on its way
    # to a replica, so the bound holds a burst as large as a replica's rows.
    rows = gen.kv_slots + gen.max_waiting
    return DeploymentPlan(f.deployment, rows + 8, rows)
