import pytest

from serve_app.contract import Priority
from serve_app.scheduling.estimate import ArrivalRates, DrainRate, LatencyEstimator
from serve_app.scheduling.protection.limit import AdaptiveLimit


def run(limit: AdaptiveLimit, replicas: int, batches: int, exec_s: float = 0.01) -> None:
    """A model with `replicas` replicas, fed `limit.slots` batches at a time: each replica
    runs one batch while the rest wait, so a batch waits (slots / replicas - 1) batch times."""
    for _ in range(batches):
        slots = limit.slots
        wait = max(slots / replicas - 1, 0) * exec_s
        limit.on_batch(wait_s=wait, exec_s=exec_s, inflight=slots)


def test_limit_settles_near_one_queued_batch_per_replica():
    for replicas in (1, 2, 4):
        limit = AdaptiveLimit(initial=1)
        run(limit, replicas, 500)
        assert replicas + 0.5 * replicas - 1 <= limit.slots <= 2.5 * replicas + 1, (replicas, limit.value)


def test_limit_follows_replicas_down_and_up():
    limit = AdaptiveLimit(initial=1)
    run(limit, 4, 500)
    high = limit.slots
    run(limit, 1, 500)
    assert limit.slots < high
    assert limit.slots <= 3


def test_idle_model_does_not_inflate_the_limit():
    limit = AdaptiveLimit(initial=2)
    for _ in range(100):
        limit.on_batch(wait_s=0.0, exec_s=0.01, inflight=1)
    assert limit.slots == 2


def test_failure_halves_the_limit_but_not_below_minimum():
    limit = AdaptiveLimit(initial=8)
    limit.on_failure()
    assert limit.value == 4
    for _ in range(10):
        limit.on_failure()
    assert limit.value == 1


def test_limit_rejects_inconsistent_bounds():
    with pytest.raises(ValueError, match="minimum <= initial"):
        AdaptiveLimit(initial=100, maximum=10)


def test_estimator_fits_a_line_through_small_and_full_batches():
    est = LatencyEstimator()
    for _ in range(50):
        est.observe(items=1, rtt_s=0.010, wait_s=0.0)
        est.observe(items=16, rtt_s=0.010 + 15 * 0.002 + 0.005, wait_s=0.005)
    assert est.batch_s(1) == pytest.approx(0.010, rel=0.05)
    assert est.batch_s(16) == pytest.approx(0.040, rel=0.1)


def test_completion_counts_queued_batches_per_slot():
    est = LatencyEstimator()
    assert est.completion_s(1000, 1, 16, 1, 1) == 0.0  # nothing learned: admit
    est.observe(items=1, rtt_s=0.01, wait_s=0.0)
    est.observe(items=16, rtt_s=0.04, wait_s=0.0)
    one_slot = est.completion_s(64, 1, 16, slots=1, inflight=1, inflight_items=16)
    two_slots = est.completion_s(64, 1, 16, slots=2, inflight=1, inflight_items=16)
    assert one_slot == pytest.approx(5 * est.batch_s(16) + est.batch_s(1))
    assert two_slots < one_slot
    # A small batch running is a short wait, not a full batch's.
    small = est.completion_s(0, 1, 16, slots=1, inflight=1, inflight_items=1)
    assert small == pytest.approx(2 * est.batch_s(1))


def test_drain_rate_counts_only_saturated_windows():
    drain = DrainRate(window_s=1.0, smoothing=0.5)
    assert drain.seconds_for(10) is None  # nothing learned
    drain.on_completion(8, 0.0, saturated=True)  # opens a window; its own rows predate it
    drain.on_completion(8, 0.5, saturated=True)
    assert drain.rate == 0.0  # window not closed yet
    drain.on_completion(8, 1.0, saturated=True)
    assert drain.rate == pytest.approx(16.0)
    # An idle spell says nothing about capacity: it discards the open window and keeps the rate.
    drain.on_completion(8, 1.5, saturated=True)
    drain.on_completion(1, 9.0, saturated=False)
    assert drain.rate == pytest.approx(16.0)
    drain.on_completion(8, 10.0, saturated=True)
    drain.on_completion(8, 11.0, saturated=True)  # 8 rows in 1 s
    assert drain.rate == pytest.approx(12.0)
    assert drain.seconds_for(24) == pytest.approx(2.0)


def test_a_rate_learned_while_starved_rises_to_what_the_lane_completes_after():
    drain = DrainRate(window_s=1.0, smoothing=0.5)
    # Before any saturated window, an unsaturated lane's throughput is the offered load: not learned.
    for i in range(5):
        drain.on_completion(30, i * 0.5, saturated=False)
    assert drain.rate == 0.0
    # A spike took the replicas' cores: 10 rows a second while saturated.
    for i in range(3):
        drain.on_completion(10, 3.0 + i, saturated=True)
    assert drain.rate == pytest.approx(10.0)
    # After it the lane completes 60 rows a second, never saturated for a whole window (admission,
    # trusting the stale rate, keeps the queue short): the rate rises to what it did complete.
    for i in range(1, 6):
        drain.on_completion(30, 5.0 + i * 0.5, saturated=False)
    assert drain.rate == pytest.approx(60.0)
    # A quieter spell never lowers it: that is the offered load, not the capacity.
    for i in range(1, 6):
        drain.on_completion(5, 8.0 + i * 0.5, saturated=False)
    assert drain.rate == pytest.approx(60.0)


def test_one_slow_batch_does_not_make_one_row_look_free():
    # Every batch takes 100 ms whatever its rows (a GPU at small batches); one two-row batch ran
    # slow on a busy machine. One row still costs 100 ms: a 25 ms deadline cannot be met.
    est = LatencyEstimator()
    for _ in range(5):
        est.observe(items=1, rtt_s=0.1, wait_s=0.0)
    est.observe(items=2, rtt_s=0.2, wait_s=0.0)
    for _ in range(5):
        est.observe(items=2, rtt_s=0.1, wait_s=0.0)
    assert est.batch_s(1) == pytest.approx(0.1, rel=0.05)
    assert est.batch_s(2) == pytest.approx(0.1, rel=0.05)


def test_a_cold_first_batch_is_forgotten_at_once_and_a_slow_one_moves_the_estimate_a_little():
    est = LatencyEstimator(smoothing=0.1)
    est.observe(items=4, rtt_s=2.0, wait_s=0.0)  # first run: session warm-up
    est.observe(items=4, rtt_s=0.02, wait_s=0.0)
    assert est.batch_s(4) == pytest.approx(0.02)
    est.observe(items=4, rtt_s=0.22, wait_s=0.0)  # a busy moment
    assert est.batch_s(4) == pytest.approx(0.04)


def test_sizes_not_seen_lately_leave_the_fit():
    est = LatencyEstimator(memory=10)
    est.observe(items=16, rtt_s=0.5, wait_s=0.0)
    est.observe(items=1, rtt_s=0.01, wait_s=0.0)
    steep = est.per_item_s
    for _ in range(10):
        est.observe(items=1, rtt_s=0.01, wait_s=0.0)
        est.observe(items=8, rtt_s=0.01 + 7 * 0.001, wait_s=0.0)
    assert steep > 0.03 and est.per_item_s == pytest.approx(0.001)
    assert est.batch_s(16) == pytest.approx(0.01 + 15 * 0.001)


def test_a_floor_holds_the_limit_up_against_queueing_and_failures_until_it_is_lowered():
    lim = AdaptiveLimit(initial=3.0)
    lim.hold_at_least(5.0)  # two holders busy at two batches each, and one more for a second copy
    assert lim.slots == 5
    for _ in range(50):
        lim.on_batch(wait_s=0.02, exec_s=0.01, inflight=5)  # batches queue at the replicas
    lim.on_failure()
    assert lim.slots == 5
    lim.hold_at_least(3.0)  # one holder left: the limit may shrink again, not below 3
    for _ in range(50):
        lim.on_batch(wait_s=0.02, exec_s=0.01, inflight=5)
    assert lim.slots == 3
    lim.hold_at_least(1000.0)
    assert lim.value == lim.maximum


def test_a_pools_floor_that_follows_its_holders_never_lowers_the_lanes_own():
    lim = AdaptiveLimit(initial=2.0, base_floor=4.0)  # four sessions shared with an urgent lane
    lim.hold_at_least(4.0)
    lim.hold_at_least(2.0)  # a pool with one holder busy at one batch, and one for a second copy
    for _ in range(50):
        lim.on_batch(wait_s=0.02, exec_s=0.01, inflight=5)
    assert lim.slots == 4
    lim.hold_at_least(6.0)
    assert lim.slots == 6


def test_arrival_rates_by_class_and_what_overtakes_each():
    arrivals = ArrivalRates(window_s=1.0, smoothing=0.5)
    for i in range(100):  # one second: 60 high rows, 40 normal
        arrivals.on_admission(Priority.HIGH if i % 5 < 3 else Priority.NORMAL, 1, i * 0.01)
    arrivals.on_admission(Priority.LOW, 1, 1.0)  # closes the window
    assert arrivals.rates[Priority.HIGH] == pytest.approx(30.0) and arrivals.rates[Priority.NORMAL] == pytest.approx(20.0)
    assert arrivals.above(Priority.LOW) == pytest.approx(50.0)
    assert arrivals.above(Priority.NORMAL) == pytest.approx(30.0) and arrivals.above(Priority.HIGH) == 0.0
    # Ten quiet seconds weigh as ten windows, not one: the old rates are all but gone.
    arrivals.on_admission(Priority.LOW, 1, 11.0)
    assert arrivals.above(Priority.LOW) < 0.1


def test_a_rise_in_the_rate_above_shows_within_a_tenth_of_a_second_and_holds_for_the_next_window():
    """A spike after a quiet spell: the average still says nothing arrives, the window open now
    says a thousand rows a second, and the window after it still counts the spike's own rate
    while the average has taken in only part of it; a fall shows a window later."""
    arrivals = ArrivalRates(window_s=1.0, smoothing=0.3)
    arrivals.on_admission(Priority.LOW, 1, 0.0)
    for i in range(40):  # normal at 1,000 rows/s
        arrivals.on_admission(Priority.NORMAL, 1, 0.001 * (i + 1))
    assert arrivals.above(Priority.LOW, now=0.05) == 0.0  # too little of the window to read a rate from
    for i in range(40, 150):
        arrivals.on_admission(Priority.NORMAL, 1, 0.001 * (i + 1))
    assert arrivals.above(Priority.LOW) == 0.0  # the average alone: the rate before the spike
    assert arrivals.above(Priority.LOW, now=0.15) == pytest.approx(1000.0)
    assert arrivals.above(Priority.NORMAL, now=0.15) == 0.0  # normal does not overtake normal
    for i in range(150, 999):  # the rest of the second
        arrivals.on_admission(Priority.NORMAL, 1, 0.001 * (i + 1))
    arrivals.on_admission(Priority.NORMAL, 1, 1.0)  # closes the window: the average takes in 30% of it
    assert arrivals.rates[Priority.NORMAL] == pytest.approx(300.0, rel=0.01)
    assert arrivals.above(Priority.LOW, now=1.05) == pytest.approx(1000.0, rel=0.01)  # the last window's own rate
    for i in range(1, 11):  # then the rate falls to ten rows a second
        arrivals.on_admission(Priority.NORMAL, 1, 1.0 + i * 0.1)
    assert arrivals.above(Priority.LOW, now=2.05) == pytest.approx(arrivals.rates[Priority.NORMAL])
