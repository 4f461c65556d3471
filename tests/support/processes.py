"""Real server processes for the tests, and libfaketime to move their clocks."""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import thriftpy2
from snowflake_thrift_client._transports import Transport, open_client

from snowflake_server._app.ready import parse_ready_line
from snowflake_server._serving.server import NATIVE_FALLBACK
from tests.support.endpoints import Endpoints, unique_scope

DATA = Path(__file__).parent.parent / "data"


class FakeTime:
    """The wall-clock offset of the processes started with :attr:`env`."""

    def __init__(self, directory: Path) -> None:
        # The thread-safe build: with the plain one, threads reading the clock at once
        # sometimes see it jump back (a server sees InvalidSystemClock where none was).
        libraries = glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")
        assert libraries, "libfaketime (Debian package faketime) is installed by `make test`"
        self.file = directory / "faketime-offset"
        self.set("+0")
        self.env = {
            "LD_PRELOAD": libraries[0],
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_NO_CACHE": "1",  # read the offset on every call
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # only the wall clock moves
            # On by default for this glibc, the "monotonic fix" makes every timed wait on
            # a CLOCK_MONOTONIC condition variable (CPython's GIL hand-over) re-read the
            # offset file in a loop, holding libfaketime's lock: each hand-over between
            # threads then takes up to seconds (a start 30 ms → 2 s; renewals late enough
            # that calls failed, or one hung past the client's 5 s). Only the wall clock
            # is faked here, so no monotonic deadline needs fixing.
            "FAKETIME_FORCE_MONOTONIC_FIX": "0",
        }

    def set(self, offset: str) -> None:
        """Offset from the real time, in seconds: "+0", "-0.004", "-2"."""
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        tmp.replace(self.file)  # never a half-written offset


class ServerDidNotStart(AssertionError):
    """The server exited (or hung) before its ready line; ``log`` is its stderr."""

    def __init__(self, returncode: int | None, log: str) -> None:
        super().__init__(f"server did not become ready: rc={returncode}\n{log}")
        self.returncode = returncode
        self.log = log


@dataclass
class ServerProcess(Endpoints):
    """A real ``snowflake-server`` process on free loopback ports."""

    process: subprocess.Popen[str]
    stderr: IO[str]
    port: int
    metrics_port: int
    transport: Transport = "framed"
    state_dir: Path | None = None
    http: tuple[str, int] | None = None  # the HTTP/JSON API's address, with --http-port
    _clients: list[Any] = field(default_factory=list)
    _final_log: str = ""

    def log(self) -> str:
        """What the server wrote to stderr so far (kept after :meth:`stop`)."""
        if self.stderr.closed:
            return self._final_log
        self.stderr.seek(0)
        return self.stderr.read()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        self.close_clients()
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGABRT)  # -X faulthandler dumps every stack
            self.process.wait(5)
            raise AssertionError(
                f"server did not stop within {timeout_s} s:\n{self.log()}"
            ) from None
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            assert self.process.stdout is not None
            self.process.stdout.close()
            self._final_log = self.log()
            self.stderr.close()


@functools.cache
def _state_root() -> Path:
    """One temporary folder for the state dirs of this test run, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="snowflake-test-state-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def spawn_server(
    *args: str,
    transport: Transport = "framed",
    state_dir: Path | None = None,
    env: dict[str, str] | None = None,
    lock_scope: str | None = None,
    wrapper: Sequence[str] = (),
    first_start_wait: str | None = "0",
) -> tuple[subprocess.Popen[str], IO[str], Path]:
    """Start ``snowflake-server`` without waiting for it: its process, its stderr and
    its state directory (see :func:`start_server`; later ``args`` override the ports).
    ``wrapper`` goes before the command: one that execs it (``unshare ... sh -c '...
    exec "$@"' sh``) leaves the server with the process's pid. ``first_start_wait``:
    the flag's value (None: the server's own default, derived in cluster mode)."""
    stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by the caller
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(dir=_state_root()))
    command = [
        *wrapper, sys.executable, "-X", "faulthandler", "-m", "snowflake_server",
        "--port", "0", "--metrics-port", "0", "--transport", transport,
        "--state-dir", str(state_dir),
        # A fresh state directory is the norm here, and tests run at once must not share
        # the host-wide worker lock: later flags in ``args`` override these.
        *(["--first-start-wait", first_start_wait] if first_start_wait is not None else []),
        "--host-lock-scope", lock_scope or unique_scope(), *args,
    ]  # fmt: skip
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SNOWFLAKE_")},
        **(env or {}),
    }
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    return process, stderr, state_dir


class Spawned:
    """A server from :func:`spawned` that a test watches start, stop or exit."""

    def __init__(self, process: subprocess.Popen[str], stderr: IO[str], state_dir: Path) -> None:
        self.process = process
        self.state_dir = state_dir
        self._stderr = stderr
        self._final_log: str | None = None

    def log(self) -> str:
        """What it wrote to stderr so far (all of it once it ended)."""
        if self._final_log is not None:
            return self._final_log
        self._stderr.seek(0)
        return self._stderr.read()

    def end(self, timeout_s: float, sig: int | None = None) -> tuple[int, float]:
        """Send ``sig`` (if given) and wait up to ``timeout_s`` for the exit, killing it
        after that: its exit code and the seconds it took. Its pipes are closed."""
        asked = time.monotonic()
        if sig is not None and self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        took = time.monotonic() - asked
        if self._final_log is None:
            self._final_log = self.log()
            self._stderr.close()
            assert self.process.stdout is not None
            self.process.stdout.close()
        return code, took


@contextlib.contextmanager
def spawned(*args: str, **kwargs: Any) -> Iterator[Spawned]:
    """:func:`spawn_server` (same arguments), ended (killed if need be) on leaving."""
    server = Spawned(*spawn_server(*args, **kwargs))
    try:
        yield server
    finally:
        server.end(0 if server.process.poll() is None else 5)


def start_server(
    *args: str,
    transport: Transport = "framed",
    timeout_s: float = 15.0,
    state_dir: Path | None = None,
    env: dict[str, str] | None = None,
    lock_scope: str | None = None,
    wrapper: Sequence[str] = (),
    first_start_wait: str | None = "0",
) -> ServerProcess:
    """Start ``snowflake-server`` on free ports and wait for its ready line.

    Each server gets a fresh state directory unless ``state_dir`` is given
    (pass the same one to restart a worker); ``env`` adds environment variables;
    ``lock_scope`` shares a host lock scope between servers (one of their own by default);
    ``wrapper`` runs it inside another command (see :func:`spawn_server`).
    """
    process, stderr, state_dir = spawn_server(
        *args,
        transport=transport,
        state_dir=state_dir,
        env=env,
        lock_scope=lock_scope,
        wrapper=wrapper,
        first_start_wait=first_start_wait,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(deadline - time.monotonic()):
                break
            line = process.stdout.readline()
            if not line:
                break
            ready = parse_ready_line(line)
            if ready is not None:
                stderr.seek(0)
                assert NATIVE_FALLBACK not in stderr.read(), "native threads fell back unseen"
                server = ServerProcess(
                    process,
                    stderr,
                    port=ready.thrift[1],
                    metrics_port=ready.metrics[1],
                    transport=transport,
                    state_dir=state_dir,
                    http=ready.http,
                )
                return server
    process.kill()
    process.wait()
    process.stdout.close()
    with stderr:
        stderr.seek(0)
        log = stderr.read()
    raise ServerDidNotStart(process.returncode, log)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc (no ``ps``: procps may be absent)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces and parentheses: fields start after the last ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


def twitter_idl() -> Any:
    """Twitter's original IDL (no ``throws``), as a thriftpy2 module."""
    return thriftpy2.load(str(DATA / "twitter_snowflake.thrift"), module_name="twitter_sf_thrift")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format as {'name{labels}': value}, comments dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def failures(counts: dict[str, float], kind: str) -> float:
    """Failures of ``kind`` in parsed metrics (``parse_metrics``), whatever the method."""
    prefix = f'snowflake_exceptions_total{{kind="{kind}",'
    return sum(value for key, value in counts.items() if key.startswith(prefix))


class Load:
    """Clients hammering servers with get_ids in the background, bounded in time.

    Every id received is kept, so a test can count duplicates across a cluster;
    errors are counted by type and the connection is reopened after any of them.
    """

    def __init__(self, servers: list[ServerProcess], per_server: int = 2, batch: int = 10) -> None:
        self.ids: list[int] = []
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._batch = batch
        self._threads = [
            threading.Thread(target=self._run, args=(server,), daemon=True)
            for server in servers
            for _ in range(per_server)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, server: Endpoints) -> None:
        deadline = time.monotonic() + 120  # stops by itself whatever the test does
        client: Any = None
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if client is None:
                    client = open_client(server.host, server.port, server.transport, 2.0)
                ids = client.get_ids("load", self._batch)
                with self._lock:
                    self.ids.extend(ids)
            except Exception as e:  # noqa: BLE001 - counted; the test decides what is allowed
                with self._lock:
                    name = type(e).__name__
                    self.errors[name] = self.errors.get(name, 0) + 1
                if client is not None:
                    client.close()
                    client = None
                self._stop.wait(0.02)
        if client is not None:
            client.close()

    def count(self) -> int:
        with self._lock:
            return len(self.ids)

    def duplicates(self) -> int:
        with self._lock:
            return len(self.ids) - len(set(self.ids))
