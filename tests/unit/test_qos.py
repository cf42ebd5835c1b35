import pytest

from serve_app.contract import Priority
from serve_app.errors import InvalidInput
from serve_app.router.admission.qos import parse_qos


def test_headers_set_priority_and_deadline():
    qos = parse_qos({"x-priority": "high", "x-request-timeout-ms": "250"}, None, now=10.0)
    assert qos.priority is Priority.HIGH
    assert qos.deadline == pytest.approx(10.25)


def test_triton_parameters_priority_levels_and_microsecond_timeout():
    qos = parse_qos({}, {"priority": 3, "timeout": 500_000}, now=0.0)
    assert qos.priority is Priority.LOW
    assert qos.deadline == pytest.approx(0.5)


def test_headers_win_and_defaults_apply():
    assert parse_qos({"x-priority": "low"}, {"priority": 1}, now=0).priority is Priority.LOW
    qos = parse_qos({}, {}, now=0, default=Priority.LOW)
    assert qos.priority is Priority.LOW and qos.deadline is None


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({"x-priority": "urgent"}, None),
        ({"x-request-timeout-ms": "soon"}, None),
        ({"x-request-timeout-ms": "0"}, None),
        ({}, {"timeout": True}),
        ({}, {"priority": "?"}),
        ({}, {"timeout": -5}),
        ({}, {"timeout": 10**400}),  # beyond any float
        ({}, {"priority": 1.5}),  # JSON values that are neither a level nor a name
        ({}, {"priority": [1]}),
        ({}, {"priority": {}}),
    ],
)
def test_bad_values_are_400s(headers, params):
    with pytest.raises(InvalidInput):
        parse_qos(headers, params, now=0)
