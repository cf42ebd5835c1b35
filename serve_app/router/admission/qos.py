"""A request's priority and deadline, from headers or Triton's request parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.contract import Priority
from serve_app.errors import InvalidInput

PRIORITY_HEADER = "x-priority"
TIMEOUT_HEADER = "x-request-timeout-ms"
MAX_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class QoS:
    priority: Priority
    deadline: float | None  # monotonic seconds

    def remaining_s(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now


def parse_qos(
    headers: Mapping[str, str], parameters: Mapping[str, Any] | None, now: float, default: Priority = Priority.NORMAL
) -> QoS:
    """Headers win over body parameters. Triton's `parameters.timeout` is in microseconds."""
    params = parameters or {}
    raw_priority: str | int | None = headers.get(PRIORITY_HEADER) or params.get("priority")
    try:
        priority = Priority.parse(raw_priority, default)
    except (ValueError, TypeError) as e:
        raise InvalidInput(f"bad priority: {e}") from None
    timeout_s: float | None = None
    if (raw := headers.get(TIMEOUT_HEADER)) is not None:
        timeout_s = _number(raw, TIMEOUT_HEADER) / 1e3
    elif (raw := params.get("timeout")) is not None:
        timeout_s = _number(raw, "parameters.timeout") / 1e6
    if timeout_s is not None and not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InvalidInput(f"request timeout must be > 0 and at most {MAX_TIMEOUT_S:.0f} s")
    return QoS(priority, None if timeout_s is None else now + timeout_s)


def _number(raw: Any, name: str) -> float:
    if isinstance(raw, bool):
        raise InvalidInput(f"{name} must be a number, got {raw!r}")
    try:
        return float(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond any float
        raise InvalidInput(f"{name} must be a number, got {raw!r}") from None
