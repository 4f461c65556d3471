from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from snowflake_server import ServerSettings
from tests.client.helpers import FakeServer, MakeServer
from tests.support.fakes import SecondsClock
from tests.support.inprocess import InProcessServer


@pytest.fixture
def clock() -> SecondsClock:
    return SecondsClock()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[MakeServer]:
    """Real servers in this process, as many as the test makes; all stopped at the end."""
    made: list[InProcessServer] = []

    def make(**kwargs: Any) -> InProcessServer:
        extra = {"clock": kwargs.pop("clock")} if "clock" in kwargs else {}
        server = InProcessServer(ServerSettings(**kwargs), tmp_path / f"state-{len(made)}", **extra)
        made.append(server.start())
        return server

    yield make
    for server in made:
        server.stop()  # again, for one a test stopped: stopping twice does nothing


@pytest.fixture
def fake() -> Iterator[Callable[[object], FakeServer]]:
    made: list[FakeServer] = []

    def make(handler: object) -> FakeServer:
        made.append(FakeServer(handler))
        return made[-1]

    yield make
    for server in made:
        server.close()
