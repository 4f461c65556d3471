"""The host-wide worker lock: one holder per (scope, datacenter, worker) on this host,
whatever the state directory, freed when its holder dies."""

from __future__ import annotations

import pytest

from snowflake_server import StartupRefused
from snowflake_server._state.hostlock import HostLock, lock_name
from tests.support.endpoints import unique_scope


def test_one_holder_per_worker_and_scope() -> None:
    scope = unique_scope()
    held = HostLock.acquire(1, 7, scope)
    try:
        with pytest.raises(StartupRefused) as info:
            HostLock.acquire(1, 7, scope)
        message = str(info.value)
        assert "another process on this host is serving datacenter 1, worker 7" in message
        assert "whatever its --state-dir" in message and "the same ids" in message
        assert f"@{held.name}" in message
        # Another worker, datacenter or scope is another lock.
        for other in (HostLock.acquire(1, 8, scope), HostLock.acquire(2, 7, scope)):
            other.release()
        HostLock.acquire(1, 7, unique_scope()).release()
    finally:
        held.release()
    HostLock.acquire(1, 7, scope).release()  # released: taken again at once
    held.release()  # twice is harmless


def test_a_long_scope_still_fits_a_socket_name() -> None:
    long_scope = "x" * 500
    name = lock_name(long_scope, 31, 31)
    assert len(name.encode()) < 107 and name.endswith("/31/31")
    assert name == lock_name(long_scope, 31, 31) != lock_name("y" * 500, 31, 31)
    assert lock_name("", 0, 0) == "snowflake-worker//0/0"
    HostLock.acquire(31, 31, long_scope).release()


def test_any_other_bind_error_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: object, address: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("socket.socket.bind", fail)
    with pytest.raises(StartupRefused, match=r"cannot take the host lock .*Permission denied"):
        HostLock.acquire(0, 0, unique_scope())
