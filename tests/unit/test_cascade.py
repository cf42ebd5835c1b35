import asyncio

import numpy as np
import pytest

from serve_app.config import RouteConfig
from serve_app.contract import Priority
from serve_app.errors import DeadlineExceeded, InvalidInput, ModelFailure, Overloaded, Unavailable
from serve_app.manifest import Manifest
from serve_app.router.routing.cascade import Cascade, CascadePolicy, ClassifierResult, confidence, route_policy, softmax
from tests.unit.fakes import virtual_time


def test_softmax_rows_sum_to_one():
    p = softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, 0.0]]))
    assert np.allclose(p.sum(axis=1), 1.0)
    assert np.isfinite(p).all()


def test_max_prob_and_margin():
    logits = np.log(np.array([[0.7, 0.2, 0.1]]))
    assert confidence(logits, "max_prob")[0] == pytest.approx(0.7)
    assert confidence(logits, "margin")[0] == pytest.approx(0.5)


def test_escalates_only_uncertain_rows():
    logits = np.log(np.array([[0.95, 0.05], [0.6, 0.4], [0.05, 0.95]]))
    assert CascadePolicy(0.9).escalate(logits).tolist() == [False, True, False]


def test_threshold_zero_never_escalates_and_one_always_does():
    logits = np.log(np.array([[0.99, 0.01], [0.5, 0.5]]))
    assert not CascadePolicy(0.0).escalate(logits).any()
    assert CascadePolicy(1.0).escalate(logits).all()


# -- the route's execution (Cascade): every fallback and degrade rule, no Ray ----------------

SURE, UNSURE = [5.0, -5.0], [0.1, 0.0]  # light logits: confident, and a coin flip
HEAVY = [0.0, 9.0]


class Tiers:
    """Both tiers of a route as fakes: each answers its logits, or raises what it was told to."""

    def __init__(self, light: list[list[float]] | Exception, heavy: Exception | None = None) -> None:
        self.light, self.heavy = light, heavy
        self.calls: list[tuple[str, object]] = []

    async def submit(self, model: str, payload, items, priority, deadline, timing) -> np.ndarray:
        self.calls.append((model, payload))
        outcome = self.light if model == "light" else self.heavy
        if isinstance(outcome, Exception):
            raise outcome
        if model == "light":
            return np.array(outcome, dtype=np.float32)
        return np.array([HEAVY] * items, dtype=np.float32)


def run(tiers: Tiers, payload: list[str]) -> ClassifierResult:
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit)
    result = asyncio.run(cascade.classify(payload, Priority.NORMAL, None))
    run.counts = dict(cascade.counts)  # type: ignore[attr-defined]
    return result


def test_confident_items_stay_with_the_light_tier_and_never_reach_the_heavy_one():
    tiers = Tiers([SURE, SURE])
    result = run(tiers, ["a", "b"])
    assert result.served_by == ["light", "light"] and result.degraded is None
    assert [m for m, _ in tiers.calls] == ["light"]
    assert run.counts == {"light": 2}  # type: ignore[attr-defined]


def test_only_the_unsure_items_escalate_and_their_answers_are_merged_in_order():
    tiers = Tiers([SURE, UNSURE, SURE])
    result = run(tiers, ["a", "b", "c"])
    assert tiers.calls == [("light", ["a", "b", "c"]), ("heavy", ["b"])]
    assert result.served_by == ["light", "heavy", "light"]
    np.testing.assert_array_equal(result.logits[1], HEAVY)
    np.testing.assert_array_equal(result.logits[0], SURE)
    assert run.counts == {"light": 2, "heavy": 1}  # type: ignore[attr-defined]


def test_a_request_goes_to_the_tier_versions_chosen_for_it():
    tiers = Tiers([SURE, UNSURE])
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit)
    result = asyncio.run(cascade.classify(["a", "b"], Priority.NORMAL, None, tiers=("light", "heavy-v2")))
    assert [m for m, _ in tiers.calls] == ["light", "heavy-v2"]
    assert result.served_by == ["light", "heavy-v2"]


def test_images_escalate_as_an_array_subset():
    tiers = Tiers([UNSURE, SURE])
    images = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit)
    asyncio.run(cascade.classify(images, Priority.NORMAL, None))
    (_, subset) = tiers.calls[1]
    assert isinstance(subset, np.ndarray) and subset.shape == (1, 3, 2, 2)
    np.testing.assert_array_equal(subset[0], images[0])


@pytest.mark.parametrize(
    "refusal",
    [InvalidInput("bad text"), Overloaded("light busy", retry_after_s=2), DeadlineExceeded("too late")],
    ids=["client-error", "overloaded", "deadline"],
)
def test_a_light_refusal_is_the_answer_and_the_heavy_tier_is_not_asked(refusal):
    tiers = Tiers(refusal)
    with pytest.raises(type(refusal)):
        run(tiers, ["a"])
    assert [m for m, _ in tiers.calls] == ["light"]


@pytest.mark.parametrize(
    "failure",
    [Unavailable("circuit open"), ModelFailure("replica crashed"), RuntimeError("actor died")],
    ids=["circuit-open", "model-error", "unexpected"],
)
def test_a_failing_light_tier_falls_back_to_the_heavy_one_for_every_item(failure):
    tiers = Tiers(failure)
    result = run(tiers, ["a", "b"])
    assert tiers.calls == [("light", ["a", "b"]), ("heavy", ["a", "b"])]
    assert result.served_by == ["heavy", "heavy"]
    assert result.degraded == "light unavailable; answered by heavy"
    assert run.counts == {"fallback": 2}  # type: ignore[attr-defined]


def test_when_both_tiers_fail_the_heavy_error_is_the_answer():
    tiers = Tiers(ModelFailure("light crashed"), heavy=Overloaded("heavy busy", retry_after_s=1))
    with pytest.raises(Overloaded):
        run(tiers, ["a"])


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (Overloaded("heavy busy", retry_after_s=1), "overloaded"),
        (DeadlineExceeded("too late"), "deadline_exceeded"),
        (Unavailable("circuit open"), "unavailable"),
    ],
    ids=["overloaded", "deadline", "circuit-open"],
)
def test_escalation_to_a_refusing_heavy_tier_degrades_to_the_light_answer(failure, code):
    tiers = Tiers([SURE, UNSURE], heavy=failure)
    result = run(tiers, ["a", "b"])
    assert result.served_by == ["light", "light"]
    assert result.degraded == f"heavy {code}; answered by light"
    np.testing.assert_array_equal(result.logits, np.array([SURE, UNSURE], dtype=np.float32))
    assert run.counts == {"light": 1, "degraded": 1}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("failure", "code"),
    [(ModelFailure("heavy crashed"), "model_error"), (RuntimeError("actor died"), "model_error")],
    ids=["model-error", "replica-died"],
)
def test_a_failing_heavy_tier_during_escalation_degrades_to_the_light_answer(failure, code):
    tiers = Tiers([UNSURE, SURE], heavy=failure)
    result = run(tiers, ["a", "b"])
    assert result.served_by == ["light", "light"] and result.degraded == f"heavy {code}; answered by light"
    assert run.counts == {"light": 1, "degraded": 1}  # type: ignore[attr-defined]


def test_a_client_error_from_the_heavy_tier_is_the_answer():
    tiers = Tiers([UNSURE], heavy=InvalidInput("too long for the heavy model"))
    with pytest.raises(InvalidInput):
        run(tiers, ["a"])


def test_a_route_takes_its_pinned_threshold_or_the_calibrated_one():
    light = Manifest(
        name="light", family="bert", inputs=[], outputs=[], calibrations={"heavy": {"threshold": 0.8, "signal": "margin"}}
    )
    assert route_policy("r", RouteConfig(light="light", heavy="heavy", threshold=0.6), light) == CascadePolicy(0.6)
    assert route_policy("r", RouteConfig(light="light", heavy="heavy"), light) == CascadePolicy(0.8, "margin")
    with pytest.raises(ValueError, match="never calibrated"):
        route_policy("r", RouteConfig(light="light", heavy="other"), light)


# -- degrading before refusing (the route's Degrading policy) ------------------------------


def degrading_run(tiers: Tiers, priority: Priority, degrading, standing_s: float = 0.0) -> ClassifierResult:
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit, degrading, lambda d: standing_s)
    result = asyncio.run(cascade.classify(["a", "b"], priority, None))
    degrading_run.counts = dict(cascade.counts)  # type: ignore[attr-defined]
    return result


def test_a_standing_heavy_queue_answers_low_escalations_from_the_light_tier_without_asking_it():
    from serve_app.scheduling.protection.degrade import Degrading

    from .fakes import Clock

    clock = Clock()
    degrading = Degrading([Priority.LOW, Priority.NORMAL], 0.1, clock=clock, draw=lambda: 0.0)
    for _ in range(100):  # the heavy queue's oldest request 1 s old for a second
        clock.now += 0.01
        degrading.follow(1.0)
    tiers = Tiers([SURE, UNSURE])
    result = degrading_run(tiers, Priority.LOW, degrading, standing_s=1.0)
    assert [m for m, _ in tiers.calls] == ["light"]  # the heavy tier never saw it
    assert result.served_by == ["light", "light"] and "low priority answered by light" in (result.degraded or "")
    assert degrading_run.counts == {"light": 1, "degraded": 1}  # type: ignore[attr-defined]
    tiers = Tiers([SURE, UNSURE])
    high = degrading_run(tiers, Priority.HIGH, degrading, standing_s=1.0)  # high still escalates
    assert [m for m, _ in tiers.calls] == ["light", "heavy"] and high.degraded is None


@pytest.mark.parametrize("error", [Overloaded("busy"), DeadlineExceeded("late")])
def test_a_heavy_refusal_is_the_answer_for_a_class_the_route_does_not_let_degrade(error):
    from serve_app.scheduling.protection.degrade import Degrading

    listed = Degrading([Priority.LOW], 0.1)
    result = degrading_run(Tiers([SURE, UNSURE], heavy=error), Priority.LOW, listed)
    assert result.degraded and degrading_run.counts["degraded"] == 1  # type: ignore[attr-defined]
    with pytest.raises(type(error)):
        degrading_run(Tiers([SURE, UNSURE], heavy=error), Priority.NORMAL, listed)
    with pytest.raises(type(error)):
        degrading_run(Tiers([SURE, UNSURE], heavy=error), Priority.LOW, Degrading([], 0.1))


def test_a_failing_heavy_tier_degrades_any_class_even_with_degrading_off():
    from serve_app.scheduling.protection.degrade import Degrading

    result = degrading_run(Tiers([SURE, UNSURE], heavy=ModelFailure("boom")), Priority.HIGH, Degrading([], 0.1))
    assert result.degraded and result.served_by == ["light", "light"]


class SilentHeavy(Tiers):
    """A heavy tier whose replicas went with their node: its call never returns."""

    async def submit(self, model: str, payload, items, priority, deadline, timing) -> np.ndarray:
        if model == "heavy":
            self.calls.append((model, payload))
            await asyncio.sleep(3600)
        return await super().submit(model, payload, items, priority, deadline, timing)


@virtual_time
async def test_a_heavy_tier_that_gives_no_answer_in_time_leaves_the_light_answer() -> None:
    tiers = SilentHeavy([SURE, UNSURE])
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit, heavy_wait_s=1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await cascade.classify(["a", "b"], Priority.HIGH, None)
    assert loop.time() - started == pytest.approx(1.0)
    assert result.served_by == ["light", "light"] and "no answer within 1 s" in (result.degraded or "")
    np.testing.assert_allclose(result.logits, [SURE, UNSURE])
    assert cascade.counts["degraded"] == 1


@virtual_time
async def test_without_a_bound_an_escalation_waits_for_the_heavy_tier() -> None:
    tiers = SilentHeavy([UNSURE])
    cascade = Cascade("route", "light", "heavy", CascadePolicy(0.9), tiers.submit)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cascade.classify(["a"], Priority.NORMAL, None), 60)
