"""Helpers shared by the tests: fakes, real server processes, a real ZooKeeper."""

from tests.support.fakes import FakeClock
from tests.support.processes import (
    DATA,
    FakeTime,
    Load,
    ServerDidNotStart,
    ServerProcess,
    parse_metrics,
    start_server,
    twitter_idl,
)

__all__ = [
    "DATA",
    "FakeClock",
    "FakeTime",
    "Load",
    "ServerDidNotStart",
    "ServerProcess",
    "parse_metrics",
    "start_server",
    "twitter_idl",
]
