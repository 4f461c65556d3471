"""Fakes for what decides a branch in time: a clock, and its sleep."""

from __future__ import annotations


class FakeClock:
    """A clock for the generator: ``sleep`` advances it; tests move it at will."""

    def __init__(self, now_ms: int) -> None:
        self.now = float(now_ms)
        self.sleeps: list[float] = []

    def __call__(self) -> int:
        return int(self.now)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds * 1000
