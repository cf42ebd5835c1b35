"""Test doubles shared by the policy tests."""


class Clock:
    """A clock the test moves by hand: `clock.now = 5`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
