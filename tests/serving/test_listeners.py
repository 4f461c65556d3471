"""The sockets the server stands on (snowflake_server/_serving/listeners.py): ports
shared only when asked, clashes named, and the open-file limit fitted to the slots."""

from __future__ import annotations

import resource
import socket
from collections.abc import Iterator

import pytest

from snowflake_server import ConfigurationError
from snowflake_server._serving.listeners import SPARE_FDS, check_open_files, listen_socket


@pytest.fixture
def open_files() -> Iterator[tuple[int, int]]:
    """This process's open-file limits, put back after the test."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield limits
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_a_port_in_use_is_named_unless_it_is_shared_on_purpose() -> None:
    with listen_socket("127.0.0.1", 0, reuse_port=False, backlog=8) as first:
        port = first.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"127.0.0.1:{port}.*another process has it"):
            listen_socket("127.0.0.1", port, reuse_port=False)
    with listen_socket("127.0.0.1", 0, reuse_port=True, backlog=8) as first:
        port = first.getsockname()[1]
        with listen_socket("127.0.0.1", port, reuse_port=True, backlog=8) as second:
            assert second.getsockname()[1] == port  # SO_REUSEPORT: both serve it
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_an_address_that_cannot_be_bound_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"cannot listen on 192\.0\.2\.1:") as raised:
        listen_socket("192.0.2.1", 0, reuse_port=False)  # TEST-NET-1: no such interface
    assert "another process" not in str(raised.value)


def test_the_open_file_limit_is_raised_to_fit_the_connections(open_files: tuple[int, int]) -> None:
    _, hard = open_files
    if hard != resource.RLIM_INFINITY and hard < 1000 + SPARE_FDS:
        pytest.skip(f"the hard limit ({hard}) is below what the test asks for")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    check_open_files(100)  # fits already: left as it is
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (256, hard)
    check_open_files(1000)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (1000 + SPARE_FDS, hard)
    check_open_files(1000, native_threads=4)  # an epoll and a wake-up each, one for the events
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (1000 + SPARE_FDS + 9, hard)


def test_a_hard_limit_too_low_for_the_connections_is_a_configuration_error(
    open_files: tuple[int, int],
) -> None:
    _, hard = open_files
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ConfigurationError, match=r"ulimit -n") as raised:
        check_open_files(hard)
    assert f"ulimit -n {hard + SPARE_FDS}" in str(raised.value)
    assert f"lower those limits by {SPARE_FDS} or more" in str(raised.value)
    with pytest.raises(ConfigurationError, match=r"with --native-threads") as raised:
        check_open_files(hard, native_threads=2)
    assert f"lower those limits by {SPARE_FDS + 5} or more" in str(raised.value)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == open_files  # nothing changed


def test_the_open_file_limit_is_checked_in_process() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    from snowflake_server._errors import ConfigurationError
    from snowflake_server._serving.listeners import check_open_files

    with pytest.raises(ConfigurationError, match=r"needs \d+ open files"):
        check_open_files(hard - SPARE_FDS + 1)
    check_open_files(min(soft, hard - SPARE_FDS))  # fits: no error
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(soft, min(soft, hard)), hard)
