"""The real server, in a thread of the test process: every branch it runs is measured
and can be driven with an injected clock or ZooKeeper client factory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

from snowflake_server import Node, ServerSettings
from snowflake_server._app.node_id import WorkerIdOrigin
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._native import native_core
from tests.support.endpoints import Endpoints, unique_scope


def check_native(node: Node, clock: Callable[[], int]) -> None:
    """Native threads serve exactly where they should: a suite run with the native core
    built (``make test`` runs it twice, with and without) must never pass by falling back
    to Python alone unseen."""
    expected = node.settings.serving.native and native_core() is not None and clock is wall_clock_ms
    assert bool(node.native_threads) == expected, (
        f"native threads serving: {node.native_threads}, expected "
        f"{'some' if expected else 'none'} (settings {node.settings.serving})"
    )


class InProcessServer(Endpoints):
    """A :class:`Node` on free loopback ports, serving from a thread until :meth:`stop`.

    ``settings`` get port 0 for admin and ``port`` (0 by default) for Thrift;
    ``state_dir`` is used unless the settings name one. ``first_start_wait`` (0: a
    fresh state directory is the norm here) and ``host_lock_scope`` (one of its own,
    so that tests running at once never share a worker lock) replace the settings'
    values; ``origin`` says where the worker id came from (the settings, by default).
    Use as a context manager, or :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        settings: ServerSettings,
        state_dir: Path,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        zk_client_factory: Callable[..., Any] = KazooClient,
        first_start_wait: float = 0.0,
        host_lock_scope: str | None = None,
        port: int = 0,
        origin: WorkerIdOrigin | None = None,
    ) -> None:
        self.settings = replace(
            settings,
            port=port,
            metrics_port=0,
            state_dir=settings.state_dir or str(state_dir),
            first_start_wait=first_start_wait,
            host_lock_scope=host_lock_scope if host_lock_scope is not None else unique_scope(),
        )
        self.transport = self.settings.transport
        self._clock = clock
        self.node = Node(
            self.settings, clock=clock, zk_client_factory=zk_client_factory, origin=origin
        )
        self._thread: threading.Thread | None = None
        self._clients = []

    def start(self) -> InProcessServer:
        self.node.start()
        check_native(self.node, self._clock)
        self.port = self.node.thrift_address[1]
        self.metrics_port = self.node.admin_address[1]
        self._thread = threading.Thread(target=self.node.run, name="in-process-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finish calls in flight, stop serving, write the final marks."""
        self.close_clients()
        self.node.request_stop()
        if self._thread is not None:
            self._thread.join(10)
            assert not self._thread.is_alive(), "the server did not stop within 10 s"
        self.node.close()

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
