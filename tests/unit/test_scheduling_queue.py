import pytest

from serve_app.contract import Priority
from serve_app.errors import InvalidInput
from serve_app.scheduling.queue import FifoQueue, PriorityQueue, QueueFull, Ticket, make_queue


def ticket(name: str, items: int = 1, priority: Priority = Priority.NORMAL, deadline: float | None = None) -> Ticket:
    return Ticket(name, items, priority, deadline, enqueued=0.0)


def names(tickets: list[Ticket]) -> list[str]:
    return [t.payload for t in tickets]


def test_priority_parses_headers_and_triton_levels():
    assert Priority.parse("HIGH") is Priority.HIGH
    assert Priority.parse(" low ") is Priority.LOW
    assert Priority.parse(None) is Priority.NORMAL
    assert Priority.parse(1) is Priority.HIGH
    assert Priority.parse(2) is Priority.NORMAL
    assert Priority.parse(9) is Priority.LOW
    assert Priority.parse(0, default=Priority.LOW) is Priority.LOW
    with pytest.raises(ValueError, match="high, normal or low"):
        Priority.parse("urgent")
    with pytest.raises(ValueError):
        Priority.parse(-1)


def test_higher_priority_first_then_earliest_deadline():
    q = PriorityQueue()
    q.push(ticket("low", priority=Priority.LOW))
    q.push(ticket("normal-late", deadline=9.0))
    q.push(ticket("normal-none"))
    q.push(ticket("normal-early", deadline=5.0))
    q.push(ticket("high", priority=Priority.HIGH))
    order = []
    while q.items:
        batch, expired = q.pop_batch(10, now=0.0)
        assert expired == []
        order.append(names(batch))
    # The high request runs alone, not padded with lower work; normal's batch fills up with low.
    assert order == [["high"], ["normal-early", "normal-late", "normal-none", "low"]]
    assert len(q) == 0


def test_fifo_ignores_priority():
    q = make_queue("fifo")
    q.push(ticket("a", priority=Priority.LOW))
    q.push(ticket("b", priority=Priority.HIGH))
    assert names(q.pop_batch(10, now=0.0)[0]) == ["a", "b"]  # and mixes classes in one batch


def test_batches_are_bounded_in_items_and_never_split_a_request():
    q = PriorityQueue()
    for i, n in enumerate([3, 3, 3]):
        q.push(ticket(f"r{i}", items=n))
    batch, _ = q.pop_batch(8, now=0.0)
    assert names(batch) == ["r0", "r1"]
    assert q.items == 3
    big = PriorityQueue()
    big.push(ticket("huge", items=20))
    assert names(big.pop_batch(8, now=0.0)[0]) == ["huge"]


def test_expired_requests_are_returned_apart():
    q = PriorityQueue()
    q.push(ticket("stale", deadline=1.0))
    q.push(ticket("fresh", deadline=10.0))
    batch, expired = q.pop_batch(8, now=2.0)
    assert names(batch) == ["fresh"] and names(expired) == ["stale"]


def test_full_queue_evicts_lowest_priority_latest_deadline_for_better_work():
    q = PriorityQueue(max_items=3)
    q.push(ticket("low-early", priority=Priority.LOW, deadline=1.0))
    q.push(ticket("low-late", priority=Priority.LOW, deadline=5.0))
    q.push(ticket("normal"))
    evicted = q.push(ticket("high", priority=Priority.HIGH))
    assert names(evicted) == ["low-late"]
    assert q.items == 3
    assert [names(q.pop_batch(10, now=0.0)[0]) for _ in range(2)] == [["high"], ["normal", "low-early"]]


def test_a_ticket_larger_than_the_queue_is_the_callers_error_not_a_full_queue():
    for q in (PriorityQueue(max_items=2), FifoQueue(max_items=2)):
        with pytest.raises(InvalidInput, match="3 items in one request"):
            q.push(ticket("big", items=3))
        assert q.items == 0


def test_full_queue_refuses_work_that_outranks_nothing():
    q = PriorityQueue(max_items=2)
    q.push(ticket("a", priority=Priority.HIGH))
    q.push(ticket("b"))
    with pytest.raises(QueueFull):
        q.push(ticket("c"))
    fifo = FifoQueue(max_items=1)
    fifo.push(ticket("a", priority=Priority.LOW))
    with pytest.raises(QueueFull):
        fifo.push(ticket("b", priority=Priority.HIGH))


def test_items_ahead_counts_only_work_served_first():
    q = PriorityQueue()
    q.push(ticket("h", items=2, priority=Priority.HIGH))
    q.push(ticket("n", items=3))
    q.push(ticket("l", items=5, priority=Priority.LOW))
    assert q.items_ahead(Priority.HIGH) == 2
    assert q.items_ahead(Priority.NORMAL) == 5
    assert q.items_ahead(Priority.LOW) == 10
    assert make_queue("fifo").items_ahead(Priority.HIGH) == 0


def test_cancelled_and_evicted_tickets_do_not_grow_the_heap():
    q = PriorityQueue(max_items=10)
    for i in range(10):
        q.push(ticket(f"low{i}", priority=Priority.LOW))
    # Sustained overload: every high request evicts a low one, and every high one is served.
    for i in range(1000):
        q.push(ticket(f"high{i}", priority=Priority.HIGH))
        q.pop_batch(1, now=0.0)
    t = ticket("gone")
    q.push(t)
    q.cancel(t)
    assert len(q._heap) <= 2 * len(q) + 64 + 1
    assert q.items == len(q)
