"""``--processes N``: N server processes on one port, one worker id each.

Python serves on one core per process, and one worker id makes at most 4,096
ids per ms. So a host scales by processes, not threads: the supervisor starts
N children that bind the same Thrift port with SO_REUSEPORT (the kernel
spreads connections over them), each with its own worker id (consecutive from
``--worker-id``, or from the host name's ordinal x N with ``ordinal``, or leased
from ZooKeeper with ``auto``) and therefore its own generator, state file and
lock: nothing is shared between them. The supervisor serves the metrics of all
children on the one metrics port (each sample labelled ``process``), answers
``/readyz`` for all of them (ready when every child is), restarts a child that
dies, and passes SIGTERM, SIGINT and SIGHUP on (each child drains, or reloads,
on its own).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import replace

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from .._config.options import OPTIONS, worker_id_text
from .._config.settings import ServerSettings
from .._errors import ConfigurationError, StartupRefused
from .._observability.admin import AdminServer
from .._observability.logs import LogFile
from .._observability.probes import Readiness
from .._thrift.server import listen_socket
from .node import on_signal
from .node_id import WorkerIdOrigin, configured_origin
from .notify import NOTIFY_SOCKET_ENV, Notifier
from .ready import parse_ready_line, ready_line

__all__ = [
    "SUPERVISOR_PID_ENV",
    "WORKER_ID_ORIGIN_ENV",
    "Supervisor",
    "child_argv",
    "die_with_supervisor",
    "origin_from_supervisor",
]

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 60.0  # a child may wait for its clock (--max-startup-wait) and ZooKeeper
_STOP_TIMEOUT_S = 10.0
_SCRAPE_TIMEOUT_S = 2.0


SUPERVISOR_PID_ENV = "SNOWFLAKE_SUPERVISOR_PID"
"""Set by the supervisor for its children: the pid they must not outlive."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WORKER_ID_ORIGIN_ENV = "SNOWFLAKE_SUPERVISOR_WORKER_ID_ORIGIN"
"""Set by the supervisor for its children: where their worker ids came from, as JSON
(their flags carry only the ids)."""


def die_with_supervisor(environ: Mapping[str, str]) -> None:
    """In a child of the supervisor: have the kernel send SIGTERM when the supervisor
    dies, even by SIGKILL, so that no child serves on (holding its worker id and lock)
    unsupervised; SIGTERM is the clean stop, with the exact final marks written.

    Raises ``StartupRefused`` if the supervisor died before this call took effect.
    A process not started by the supervisor is left alone.
    """
    parent = environ.get(SUPERVISOR_PID_ENV)
    if not parent:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise StartupRefused(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # it died before the kernel knew to tell us
        raise StartupRefused(f"the supervisor (pid {parent}) is gone; not starting")


def origin_from_supervisor(environ: Mapping[str, str]) -> WorkerIdOrigin | None:
    """In a child of the supervisor: where its worker id came from, as the supervisor
    read it from the machine (the child's own flags give only the number). None in a
    process not started by the supervisor."""
    given = environ.get(WORKER_ID_ORIGIN_ENV)
    if not given or not environ.get(SUPERVISOR_PID_ENV):
        return None
    origin = json.loads(given)
    return WorkerIdOrigin(str(origin["source"]), str(origin["detail"]))


def child_argv(settings: ServerSettings) -> list[str]:
    """Flags that give a child exactly ``settings`` (flags beat environment and file)."""
    argv: list[str] = []
    for option in OPTIONS:
        value = getattr(settings, option.name)
        if option.is_switch:
            if value:
                argv.append(option.flag)
        elif value != "" and value is not None:  # None: derived, as the child will too
            argv += [
                option.flag,
                worker_id_text(value) if option.name == "worker_id" else str(value),
            ]
    return argv


class _Child:
    def __init__(self, index: int, settings: ServerSettings, origin: WorkerIdOrigin) -> None:
        self.index = index
        self.settings = settings
        self.origin = origin
        self.process: subprocess.Popen[str] | None = None
        self.metrics = ""  # host:port of its admin endpoint
        self.restarts = 0

    def start(self) -> None:
        command = [sys.executable, "-m", "snowflake_server", *child_argv(self.settings)]
        # The child asks the kernel to end it with us (see die_with_supervisor); only
        # the supervisor talks to systemd.
        env = {k: v for k, v in os.environ.items() if k != NOTIFY_SOCKET_ENV}
        env[SUPERVISOR_PID_ENV] = str(os.getpid())
        env[WORKER_ID_ORIGIN_ENV] = json.dumps(
            {"source": self.origin.source, "detail": self.origin.detail}
        )
        # A group of its own: a terminal's Ctrl-C reaches the supervisor only, which
        # passes it on (so a drain is the supervisor's decision, as with SIGTERM).
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env=env, process_group=0
        )
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + _START_TIMEOUT_S
            while selector.select(max(0.0, deadline - time.monotonic())):
                line = self.process.stdout.readline()
                if not line:
                    break
                ready = parse_ready_line(line)
                if ready is not None:
                    self.metrics = "{}:{}".format(*ready.metrics)
                    return
        self.process.kill()
        code = self.process.wait()
        raise StartupRefused(
            f"process {self.index} (worker {self.settings.worker_id}) did not start "
            f"(exit code {code}); its error is above"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def get(self, path: str) -> tuple[int, str]:
        url = f"http://{self.metrics}{path}"
        try:
            with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_S) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read().decode()
        except OSError as e:
            return 503, str(e)


class _ChildrenMetrics(Collector):
    """Every child's metrics, each sample labelled with its process index."""

    def __init__(self, children: list[_Child]) -> None:
        self._children = children

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for child in self._children:
            status, text = child.get("/metrics")
            if status != 200:
                # A child that cannot be scraped (dead, restarting) cannot serve either:
                # say so, rather than let its series vanish.
                ready = merged.setdefault(
                    "snowflake_ready",
                    Metric("snowflake_ready", "1 while /readyz answers 200.", "gauge"),
                )
                ready.add_sample("snowflake_ready", {"process": str(child.index)}, 0)
                continue
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "process": str(child.index)}
                    into.samples.append(sample._replace(labels=labels))
        yield from merged.values()


class Supervisor:
    """Runs ``settings.processes`` children; see the module docstring. ``origin`` says
    where the first worker id came from (see ``resolve_worker_id``)."""

    def __init__(
        self,
        settings: ServerSettings,
        log_file: LogFile | None = None,
        *,
        origin: WorkerIdOrigin | None = None,
    ) -> None:
        self._settings = settings
        self._origin = configured_origin(settings) if origin is None else origin
        self._log_file = log_file
        self._stop = threading.Event()
        self._children: list[_Child] = []
        self._readiness = Readiness()  # its phase; the children's own checks are theirs
        self._notifier = Notifier(os.environ)

    def _child_settings(self, index: int, port: int, http_port: int) -> ServerSettings:
        settings = self._settings
        first = settings.worker_number
        worker_id = first if settings.auto_worker_id else first + index
        # Checked as it is made: the consecutive worker id must fit the layout.
        return replace(
            settings,
            port=port,
            http_port=http_port,
            processes=1,
            reuse_port=True,
            worker_id=worker_id,
            metrics_host="127.0.0.1",
            metrics_port=0,
        )

    def run(self) -> int:
        settings = self._settings
        # Hold the port (SO_REUSEPORT, not listening) so that port 0 means one port for all.
        holders = [listen_socket(settings.host, settings.port, reuse_port=True)]
        if settings.thrift.http:
            holders.append(listen_socket(settings.http_host, settings.http_port, reuse_port=True))
        port = holders[0].getsockname()[1]
        http_port = holders[1].getsockname()[1] if len(holders) > 1 else settings.http_port
        try:
            for index in range(settings.processes):
                child = _Child(index, self._child_settings(index, port, http_port), self._origin)
                self._children.append(child)
                child.start()
        except BaseException:
            self._stop_children()
            raise
        finally:
            for holder in holders:
                holder.close()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ChildrenMetrics(self._children))
        try:
            admin = AdminServer(registry, settings.admin, ready=self._ready, live=lambda: None)
        except ConfigurationError:
            self._stop_children()
            raise
        admin.start()
        self._readiness.serving()
        on_signal(signal.SIGTERM, self._on_stop)
        on_signal(signal.SIGINT, self._on_stop)
        on_signal(signal.SIGHUP, lambda _name: self._reload())
        metrics_host, metrics_port = admin.address
        log.info("%d processes serving on %s:%d", settings.processes, settings.host, port)
        http = (settings.http_host, http_port) if settings.thrift.http else None
        print(ready_line((settings.host, port), (metrics_host, metrics_port), http), flush=True)
        self._notifier.ready(f"{settings.processes} processes serving")
        try:
            self._watch()
        finally:
            code = self._stop_children()
            admin.stop()
        return code

    def _on_stop(self, name: str) -> None:
        if self._stop.is_set():
            # Again: pass it on, so that each process skips the rest of its drain.
            log.info("received %s again: stopping %d processes now", name, len(self._children))
            self._signal_children(signal.SIGTERM)
            return
        log.info("received %s: stopping %d processes", name, len(self._children))
        self._readiness.draining()
        self._notifier.stopping(f"draining for {self._settings.drain_seconds:g} s")
        self._stop.set()

    def _reload(self) -> None:
        if self._log_file is not None:
            self._log_file.reopen()
        self._signal_children(signal.SIGHUP)

    def _signal_children(self, signum: signal.Signals) -> None:
        for child in self._children:
            if child.alive():
                assert child.process is not None
                child.process.send_signal(signum)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for child in self._children:
                if not child.alive() and not self._stop.is_set():
                    code = child.process.returncode if child.process else None
                    log.error("process %d exited (code %s): restarting it", child.index, code)
                    child.restarts += 1
                    try:
                        child.start()  # same worker id and state: its mark is honoured
                    except StartupRefused as e:
                        log.error("%s", e)

    def _stop_children(self) -> int:
        code = 0
        self._signal_children(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.drain_seconds + _STOP_TIMEOUT_S
        for child in self._children:
            if child.process is None:
                continue
            try:
                if child.process.wait(max(0.1, deadline - time.monotonic())) != 0:
                    code = 1
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
                code = 1
            if child.process.stdout is not None:
                child.process.stdout.close()
        return code

    def _ready(self) -> tuple[str | None, dict[str, object]]:
        """Ready when every child is (and we are not stopping): each one is asked."""
        unready: dict[str, str] = {}
        for child in self._children:
            status, body = child.get("/readyz")
            if status != 200:
                try:
                    unready[str(child.index)] = str(json.loads(body).get("reason", body))
                except (ValueError, AttributeError):
                    unready[str(child.index)] = body
        why = self._readiness.reason() or "; ".join(
            f"process {index}: {reason}" for index, reason in unready.items()
        )
        return why or None, {
            "phase": self._readiness.phase.value,
            "worker_id_source": self._origin.source,
            "worker_id_from": self._origin.detail,
            "processes": {
                str(child.index): "unavailable" if str(child.index) in unready else "ok"
                for child in self._children
            },
        }
