"""Fakes for what decides a branch in time: clocks, and a sleep that moves one."""

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


class SecondsClock:
    """A clock in float seconds (a monotonic or boot clock), moved by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
