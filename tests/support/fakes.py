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


class FakeTransport:
    """The transport side of an ``asyncio.Protocol`` under test: what it was told to
    write, pause, close or abort. ``buffered`` is what it reports as unsent."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.reading = True
        self.closed = False
        self.aborted = False
        self.buffered = 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True
