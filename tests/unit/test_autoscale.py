from types import SimpleNamespace

import pytest

from serve_app.contract import LINK_ONGOING, RouterLoad
from serve_app.scheduling.autoscale import (
    ROUTER_CPU,
    RouterLoadPolicy,
    desired_replicas,
    router_demand,
    router_demand_policy,
)
from serve_app.scheduling.protection.overload import CpuMeter


def ctx(ongoing: float, reports: dict[str, float], target: float = 2.0) -> SimpleNamespace:
    return SimpleNamespace(
        total_num_requests=ongoing,
        aggregated_metrics={RouterLoad.METRIC: reports},
        config=SimpleNamespace(target_ongoing_requests=target),
        policy_state={},
    )


def test_router_held_batches_add_to_ongoing_requests():
    # One replica with its 2 batches in flight looks "at target" to the default policy...
    assert desired_replicas(ongoing=2, router_batches=0, target_per_replica=2) == 1
    # ...but 6 full batches waiting in the router mean it needs more.
    desired, state = router_demand_policy(ctx(2, {"replica-a": 6.4}))
    assert desired == 4 and state["router_queued_batches"] == 6


def test_replicas_hear_the_same_routers_so_reports_are_not_summed():
    assert router_demand({RouterLoad.METRIC: {"a": 3.0, "b": 2.9}}) == 3
    assert router_demand({}) == 0 and router_demand(None) == 0


def test_a_partly_filled_batch_is_not_demand():
    desired, _ = router_demand_policy(ctx(1, {"a": 0.9}))
    assert desired == 1


def test_batches_that_came_over_replicas_links_count_as_ongoing_and_add_up():
    # Serve sees none of the link's calls; each replica reports its own, so they are summed.
    context = ctx(0, {"a": 0.0})
    context.aggregated_metrics[LINK_ONGOING] = {"a": 2.0, "b": 3.0}
    desired, _ = router_demand_policy(context)
    assert desired == 3  # (0 + 5) / 2, rounded up
    assert router_demand_policy(ctx(0, {"a": 0.0}))[0] == 0


def test_no_work_scales_toward_zero_and_serve_applies_min_replicas():
    assert router_demand_policy(ctx(0, {}))[0] == 0


def test_router_load_sums_routers_and_forgets_silent_ones():
    load = RouterLoad(ttl_s=5)
    load.report("r1", 2.0, now=0)
    load.report("r2", 1.5, now=3)
    assert load.total(now=4) == 3.5
    assert load.total(now=6) == 1.5
    load.report("r2", 0.0, now=7)
    assert load.total(now=7) == 0


def router_ctx(replicas: int, cores: dict[str, float] | None) -> SimpleNamespace:
    metrics = {ROUTER_CPU: cores} if cores is not None else {}
    return SimpleNamespace(current_num_replicas=replicas, aggregated_metrics=metrics, policy_state={})


def test_routers_scale_on_the_cores_they_use_together():
    policy = RouterLoadPolicy(target_cores=0.5)
    assert policy(router_ctx(1, {"a": 0.95}))[0] == 2  # one router near a whole core: add one
    desired, state = policy(router_ctx(2, {"a": 0.7, "b": 0.75}))
    assert desired == 3 and state["router_cpu_cores"] == 1.45
    assert policy(router_ctx(3, {"a": 0.1, "b": 0.1, "c": 0.05}))[0] == 1  # quiet: back to one
    assert policy(router_ctx(2, {"a": 0.0, "b": 0.0}))[0] == 1  # never below one
    assert policy(router_ctx(2, None))[0] == 2  # nothing measured yet: keep what runs


def test_a_router_cpu_target_beyond_one_core_is_refused():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="one core at most"):
            RouterLoadPolicy(target_cores=bad)


def test_the_cpu_meter_reports_cores_used_between_samples():
    wall, cpu = [0.0], [0.0]
    meter = CpuMeter(cpu_clock=lambda: cpu[0], clock=lambda: wall[0])
    wall[0], cpu[0] = 5.0, 4.0  # start-up, before the first sample: not load
    assert meter.sample() == 0.0
    wall[0], cpu[0] = 15.0, 10.0
    assert meter.sample() == 0.6
    wall[0], cpu[0] = 17.0, 12.0
    assert meter.sample() == 1.0
    assert meter.sample() == 0.0  # no time passed
