"""Scheduling policies: plain classes, no Ray, unit-testable on their own."""
