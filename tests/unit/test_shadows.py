"""When mirrors may go: only while the router holds no client work, within a bound."""

from __future__ import annotations

from serve_app.scheduling.shadows import IdleRelease


def test_mirrors_wait_while_clients_are_served_and_go_together_when_idle():
    busy = [True]
    gate: IdleRelease[str] = IdleRelease(lambda: busy[0])
    assert not gate.offer("a", 4).refused and not gate.offer("b", 4).refused
    assert gate.release(8) == []
    busy[0] = False
    assert gate.release(8) == ["a", "b"] and gate.inflight == 2 and not gate.waiting
    gate.done()
    assert gate.inflight == 1


def test_one_batch_of_mirrors_is_out_at_a_time():
    gate: IdleRelease[str] = IdleRelease(lambda: False)
    for m in "abc":
        gate.offer(m, 8)
    assert gate.release(2) == ["a", "b"]
    assert gate.release(2) == []  # the first batch is still out
    gate.done()
    gate.done()
    assert gate.release(2) == ["c"]


def test_a_full_waiting_room_drops_its_oldest_and_a_full_flight_refuses_the_new_one():
    gate: IdleRelease[str] = IdleRelease(lambda: True)
    for m in "abc":
        assert gate.offer(m, 3).dropped is None
    assert gate.offer("d", 3).dropped == "a" and list(gate.waiting) == ["b", "c", "d"]
    gate.busy = lambda: False
    assert gate.release(8) == ["b", "c", "d"]
    assert gate.offer("e", 3).refused and not gate.waiting
    gate.done()
    assert not gate.offer("e", 3).refused
