from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import ServerProcess, start_server


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    """A real server process with default settings on free loopback ports."""
    running = start_server()
    try:
        yield running
    finally:
        code = running.stop()
    assert code == 0, running.log()
