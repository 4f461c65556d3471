from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snowflake_server import ServerSettings
from tests.support.inprocess import InProcessServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    """The real server with default settings, in a thread of this process, on free
    loopback ports (tests that need a process of its own use ``start_server``)."""
    with InProcessServer(ServerSettings(), tmp_path / "state") as running:
        yield running
