"""Scheduling policies: plain classes, no Ray, unit-testable on their own.

Overload and failure protection (shedding, in-flight limits, the circuit breaker) in `protection/`.
"""
