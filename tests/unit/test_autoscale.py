from types import SimpleNamespace

from serve_app.contract import RouterLoad
from serve_app.scheduling.autoscale import desired_replicas, router_demand, router_demand_policy


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
