"""--processes with real server processes: one port, one worker id each; the supervisor
restarts, kills and stops them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client._transports import open_client

from snowflake_server import decompose, load_settings
from snowflake_server._app import child as child_module
from snowflake_server._app.child import (
    NO_ANSWER,
    TERM_GRACE_S,
    Child,
    fetch,
)
from snowflake_server._app.node_id import configured_origin
from snowflake_server._app.supervisor import (
    METRICS_BOUND_S,
    UNRESPONSIVE_S,
    Supervisor,
    _ChildrenMetrics,
)
from snowflake_server._config.settings import ServerSettings
from snowflake_server._errors import (
    StartupDeferred,
    StartupInterrupted,
)
from snowflake_server._serving.listeners import started_threads
from tests.support.children import FakeAdmin, sleeper
from tests.support.endpoints import free_port, unique_scope
from tests.support.processes import (
    Load,
    ServerDidNotStart,
    ServerProcess,
    child_pids,
    parse_metrics,
    start_server,
)
from tests.support.waiting import wait_until


@pytest.fixture
def pair() -> Iterator[ServerProcess]:
    server = start_server("--processes", "2", "--worker-id", "3")
    yield server
    assert server.stop() == 0, server.log()


def test_connections_spread_over_processes_with_their_own_worker_ids(pair: ServerProcess) -> None:
    workers = {decompose(pair.raw_client().get_id("spread")).worker_id for _ in range(40)}
    assert workers == {3, 4}, "the kernel spreads new connections over both processes"
    with Load([pair], per_server=4) as load:
        wait_until(lambda: load.count() >= 20_000, "20,000 ids from 4 clients")
    assert load.duplicates() == 0 and not load.errors


def test_one_metrics_port_for_all_processes(pair: ServerProcess) -> None:
    for _ in range(10):
        pair.raw_client().get_ids("metrics", 5)
    counts = parse_metrics(pair.metrics())
    assert counts['snowflake_worker_id{process="0"}'] == 3
    assert counts['snowflake_worker_id{process="1"}'] == 4

    def generated() -> float:
        counts = parse_metrics(pair.metrics())
        return sum(v for k, v in counts.items() if k.startswith("snowflake_ids_generated_total"))

    # The children's metrics as of the latest supervision round (every 0.5 s).
    wait_until(lambda: generated() == 50, "the 50 ids counted")
    status, body = pair.http_get("/health")
    assert status == 200 and json.loads(body)["processes"] == {"0": "ok", "1": "ok"}


def test_promtool_accepts_the_merged_exposition(pair: ServerProcess) -> None:
    pair.raw_client().get_id("lint")
    promtool = shutil.which("promtool")
    assert promtool, "promtool (from Debian's prometheus package) is unpacked by `make test`"
    text = pair.metrics()
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr
    assert 'process_open_fds{process="1"}' in text and 'snowflake_ready{process="0"} 1.0' in text


def test_a_dead_process_is_restarted(pair: ServerProcess) -> None:
    os.kill(child_pids(pair.process.pid)[0], signal.SIGKILL)
    wait_until(
        lambda: "restarting it" in pair.log() and pair.http_get("/health")[0] == 200,
        "the supervisor restarts the killed process",
    )
    workers = {decompose(pair.raw_client().get_id("again")).worker_id for _ in range(40)}
    assert workers == {3, 4}


def test_a_child_that_cannot_be_scraped_reads_as_not_ready() -> None:
    settings = load_settings(["--worker-id", "3"], {})
    origin = configured_origin(settings)
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    alive, dead = Child(0, settings, origin), Child(1, settings, origin)
    supervisor.adopt(alive)
    supervisor.adopt(dead)
    dead.metrics = f"127.0.0.1:{free_port()}"  # nothing answers there
    child = start_server("--worker-id", "3")
    try:
        alive.metrics = f"127.0.0.1:{child.metrics_port}"
        supervisor.scrape_children()  # as the metrics thread does
    finally:
        child.stop()
    collector = _ChildrenMetrics([alive, dead], lambda: now[0])
    families = {f.name: f for f in collector.collect()}
    ready = {s.labels["process"]: s.value for s in families["snowflake_ready"].samples}
    assert ready == {"0": 1, "1": 0}
    now[0] += METRICS_BOUND_S + 0.1  # not asked since: its answers are too old to tell
    families = {f.name: f for f in collector.collect()}
    ready = {s.labels["process"]: s.value for s in families["snowflake_ready"].samples}
    assert ready == {"0": 0, "1": 0}


def test_worker_ids_must_fit_for_every_process() -> None:
    with pytest.raises(ServerDidNotStart, match=r"worker_id must be in 0\.\.31, got 32"):
        start_server("--processes", "3", "--worker-id", "30")


def test_children_die_with_a_killed_supervisor_and_free_their_worker_ids(tmp_path: Path) -> None:
    state = tmp_path / "state"
    scope = unique_scope()
    first = start_server(
        "--processes", "2", "--worker-id", "5", state_dir=state, lock_scope=scope
    )  # fmt: skip
    children = child_pids(first.process.pid)
    assert len(children) == 2
    first.stop(signal.SIGKILL)
    # The kernel tells each child with SIGTERM: a clean stop, final marks written.
    wait_until(lambda: not any(alive(pid) for pid in children), "the children to exit", 10)
    # Their worker ids and locks are free: a new supervisor starts on them at once.
    second = start_server(
        "--processes", "2", "--worker-id", "5", state_dir=state, lock_scope=scope
    )  # fmt: skip
    try:
        workers = {decompose(second.raw_client().get_id("again")).worker_id for _ in range(40)}
        assert workers == {5, 6}
    finally:
        assert second.stop() == 0


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_second_sigterm_cuts_every_process_drain_short() -> None:
    server = start_server("--processes", "2", "--drain-seconds", "60")
    try:
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: server.http_get("/readyz")[0] == 503, "not ready at once")
        assert server.raw_client().get_id("drain") > 0, "the processes serve on meanwhile"
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(20) == 0, "stopped without waiting out the drain"
    finally:
        server.stop()
    assert "again: stopping 2 processes now" in server.log()


def test_one_http_port_for_all_processes() -> None:
    server = start_server("--processes", "2", "--worker-id", "3", "--http-port", "0")
    try:
        http = server.http
        assert http is not None
        workers = set()
        for _ in range(40):  # a new connection each: the kernel spreads them
            with urllib.request.urlopen(f"http://{http[0]}:{http[1]}/v1/id?agent=p") as r:
                workers.add(decompose(int(json.loads(r.read())["id"])).worker_id)
        assert workers == {3, 4}
    finally:
        assert server.stop() == 0


def worker_pid(supervisor: int, worker_id: int) -> int:
    """The pid of the supervisor's child serving ``worker_id`` (from its command line)."""
    for pid in child_pids(supervisor):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[argv.index(b"--worker-id") + 1] == str(worker_id).encode():
            return pid
    raise AssertionError(f"no child serves worker {worker_id}")


def restarts(server: ServerProcess, reason: str) -> float:
    return parse_metrics(server.metrics()).get(
        f'snowflake_supervisor_restarts_total{{reason="{reason}"}}', 0.0
    )


def timed_readyz(server: ServerProcess) -> tuple[float, int, str]:
    started = time.monotonic()
    status, body = server.http_get("/readyz")
    return time.monotonic() - started, status, body


class NewConnections:
    """A client taking one id per new connection (1 s timeout) in a loop, as a load
    balancer's clients do: which workers answered, and how long the longest hang was."""

    def __init__(self, server: ServerProcess) -> None:
        self._server = server
        self._stop = threading.Event()
        self.answered: list[tuple[float, int]] = []  # (when the call began, worker)
        self.hung: list[float] = []  # when each timed-out attempt began
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                client = open_client("127.0.0.1", self._server.port, "framed", 1.0)
                try:
                    worker = decompose(client.get_id("wedge")).worker_id
                finally:
                    client.close()
            except Exception:  # noqa: BLE001 - a timeout on the stopped child's socket
                self.hung.append(began)
                continue
            self.answered.append((began, worker))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_stopped_process_is_killed_and_replaced_while_the_other_serves(
    pair: ServerProcess,
) -> None:
    wedged, healthy = worker_pid(pair.process.pid, 3), worker_pid(pair.process.pid, 4)
    load = NewConnections(pair)
    try:
        wait_until(lambda: len(load.answered) >= 20, "ids before the wedge")
        os.kill(wedged, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # From the next round on (its answers are due within 1.25 s).
        wait_until(lambda: timed_readyz(pair)[1] == 503, "not ready", 5)
        took, status, body = timed_readyz(pair)
        assert took < 0.5, f"/readyz took {took:.2f} s during the wedge"
        assert status == 503 and '"1": "ok"' in body and "process 0: did not answer" in body
        wait_until(lambda: wedged not in child_pids(pair.process.pid), "the wedged child killed")
        killed_after = time.monotonic() - stopped_at
        wait_until(lambda: pair.http_get("/readyz")[0] == 200, "its replacement ready")
        replaced_after = time.monotonic() - stopped_at
        assert worker_pid(pair.process.pid, 4) == healthy, "the healthy child was not touched"
        during = [w for t, w in load.answered if stopped_at < t < stopped_at + killed_after]
        assert during and set(during) == {4}, "the healthy child served on meanwhile"
        wait_until(
            lambda: {w for t, w in load.answered if t > stopped_at + replaced_after} == {3, 4},
            "the replacement serves worker 3 again",
        )
    finally:
        load.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(wedged, signal.SIGCONT)
    bound = UNRESPONSIVE_S + 3.0  # the failed polls, plus a round and a poll's deadline
    assert killed_after < bound, f"killed {killed_after:.1f} s after the wedge (bound {bound})"
    assert restarts(pair, "unresponsive") == 1 and restarts(pair, "exited") == 0
    hangs = [t for t in load.hung if t > stopped_at]
    print(
        f"wedge: killed after {killed_after:.1f} s, serving again after {replaced_after:.1f} s;"
        f" {len(hangs)} new connections hung meanwhile, {len(during)} ids from the other child"
    )
    assert "failed /livez 3 times" in pair.log()


def test_a_process_that_cannot_start_is_restarted_with_growing_delays(
    pair: ServerProcess,
) -> None:
    assert pair.state_dir is not None
    child = worker_pid(pair.process.pid, 3)
    os.kill(child, signal.SIGSTOP)  # so that it writes its state file no more
    (pair.state_dir / "worker-0-3.json").write_text("not json")
    os.kill(child, signal.SIGKILL)
    first = time.monotonic()
    wait_until(lambda: restarts(pair, "exited") >= 4, "four failed starts", 30)
    window = time.monotonic() - first
    delays = re.findall(r"process 0 \(worker 3, .*: restarting it in (\S+) s", pair.log())
    assert delays[:4] == ["0.5", "1", "2", "4"], delays
    # The fourth failure comes after the first three delays (0.5 + 1 + 2 s) and four
    # starts; without backoff a start failed every 0.7 s (11 in 8 s).
    assert window >= 3.5, f"4 failed starts in {window:.1f} s: no backoff"
    took, status, body = timed_readyz(pair)
    assert took < 2.5 and status == 503 and "restarting in" in body and '"1": "ok"' in body
    assert decompose(pair.raw_client().get_id("still")).worker_id in {4}
    assert restarts(pair, "unresponsive") == 0


def slow_starter(tmp_path: Path) -> ServerSettings:
    """A process that waits 60 s (its first-start wait) before it is ready."""
    return load_settings(
        ["--worker-id", "3", "--port", "0", "--metrics-port", "0", "--first-start-wait",
         "60", "--state-dir", str(tmp_path / "state"), "--host-lock-scope", unique_scope()],
        {},
    )  # fmt: skip


class Stderr:
    """What the children (who inherit our stderr) wrote so far."""

    def __init__(self, capfd: pytest.CaptureFixture[str]) -> None:
        self._capfd = capfd
        self._text = ""

    def count(self, what: str) -> int:
        self._text += self._capfd.readouterr().err
        return self._text.count(what)


@contextlib.contextmanager
def waiting_to_start(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> Iterator[Child]:
    """A child of :func:`slow_starter`, spawned and in its first-start wait; reaped after."""
    settings = slow_starter(tmp_path)
    child = Child(0, settings, configured_origin(settings))
    err = Stderr(capfd)
    child.spawn()
    try:
        wait_until(lambda: err.count("waiting --first-start-wait") == 1, "its first-start wait")
        yield child
    finally:
        child.reap()


def test_a_process_not_ready_in_time_is_stopped_with_sigterm(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Not SIGKILL (which leaves a cluster registration until its session expires),
    and "try again" (75), not "starting could repeat ids" (3)."""
    with waiting_to_start(tmp_path, capfd) as child:
        started = time.monotonic()
        with pytest.raises(StartupDeferred, match=r"not ready within 0 s: stopped \(exit code 0\)"):
            child.wait_ready(0.0)  # its limit is over
        took = time.monotonic() - started
    assert took < 2.5, f"stopped {took:.2f} s after its limit"


def test_a_restarted_process_not_ready_in_time_gets_sigterm_then_sigkill(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "snowflake_server._app.supervisor")
    settings = slow_starter(tmp_path)
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    supervisor.lifecycle.serving()
    child = Child(0, settings, configured_origin(settings))
    supervisor.adopt(child)
    limit = child.start_limit
    assert limit is not None
    err = Stderr(capfd)
    try:
        child.restart_at = now[0]
        supervisor.supervise_once()  # started again
        wait_until(lambda: err.count("waiting --first-start-wait") == 1, "its first-start wait")
        now[0] += limit + 0.1
        supervisor.supervise_once()  # SIGTERM: it ends its wait and exits 0
        first = child.process
        assert first is not None
        first.wait(5)
        supervisor.supervise_once()
        assert f"did not start within {limit:g} s: stopped (code 0)" in caplog.text
        assert supervisor.restarts["exited"] == 1
        # One that cannot act on SIGTERM (stopped) is killed after the grace.
        assert child.restart_at is not None
        now[0] = child.restart_at
        supervisor.supervise_once()
        wait_until(lambda: err.count("waiting --first-start-wait") == 1, "its second start")
        second = child.process
        assert second is not None and second is not first
        os.kill(second.pid, signal.SIGSTOP)
        now[0] += limit + 0.1
        supervisor.supervise_once()
        now[0] += TERM_GRACE_S - 0.2
        supervisor.supervise_once()
        assert second.poll() is None, "killed before its grace"
        now[0] += 0.2
        supervisor.supervise_once()
        assert second.returncode == -signal.SIGKILL
        assert f"nor stop within {TERM_GRACE_S:g} s: killed" in caplog.text
        assert supervisor.restarts["exited"] == 2
    finally:
        child.reap()


def timed_get(server: ServerProcess, path: str) -> tuple[float, int]:
    started = time.monotonic()
    url = f"http://{server.host}:{server.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        with e:
            status = e.code
    return time.monotonic() - started, status


def test_the_supervisors_livez_answers_at_once_while_probes_ask_during_a_wedge(
    pair: ServerProcess,
) -> None:
    """Its admin endpoint has one thread: probes and scrapes that waited there on a
    wedged process made its own /livez wait (a pod's liveness probe then fails)."""
    wedged = worker_pid(pair.process.pid, 3)
    stop = threading.Event()
    probes: list[tuple[float, int]] = []

    def probe(path: str) -> None:
        while not stop.is_set():
            probes.append(timed_get(pair, path))

    threads = [
        threading.Thread(target=probe, args=(path,), daemon=True)
        for path in ("/readyz", "/readyz", "/health", "/metrics")
    ]
    os.kill(wedged, signal.SIGSTOP)
    try:
        for thread in threads:
            thread.start()
        # Until the probes see the wedge (a round's answers are due within 1.25 s).
        livez: list[tuple[float, int]] = []
        deadline = time.monotonic() + 10
        while len(livez) < 5 or not any(status == 503 for _, status in probes):
            assert time.monotonic() < deadline, "the probes never saw the wedge"
            livez.append(timed_get(pair, "/livez"))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(wedged, signal.SIGCONT)
    slowest = max(took for took, _ in livez)
    print(f"/livez during a wedge: slowest {slowest:.3f} s; {len(probes)} probes meanwhile")
    assert all(status == 200 for _, status in livez)
    assert slowest < 0.5, f"/livez took {slowest:.2f} s while probes asked"
    assert max(took for took, _ in probes) < 0.5, "the probes answer at once too"


class DrippingAdmin(FakeAdmin):
    """An admin port that answers every request slowly, a byte every 0.1 s for 10 s
    (each read is quick; the answer is not), on a thread per connection."""

    def __init__(self) -> None:
        self._closed = threading.Event()
        super().__init__(threaded=True)

    def answer(self, connection: socket.socket, request: bytes) -> None:
        try:
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                # The drip's pace; the client's close (readable: its end) ends it.
                readable, _, _ = select.select([connection], [], [], 0.1)
                if readable or self._closed.is_set():
                    return
                connection.sendall(b"x")
        except OSError:
            return

    def close(self) -> None:
        self._closed.set()
        super().close()


def test_a_dripping_answer_is_cut_at_its_deadline_and_never_asked_twice_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(["--worker-id", "3"], {})
    origin = configured_origin(settings)
    drip = DrippingAdmin()
    took = time.monotonic()
    with pytest.raises(TimeoutError):
        fetch(drip.address, "/livez", 1.0)
    took = time.monotonic() - took
    assert took < 1.5, f"a 1 s request took {took:.1f} s: the deadline is per read"
    now = [100.0]
    pool = started_threads(2 * 2, "supervise")  # as run()'s for two
    supervisor = Supervisor(settings, clock=lambda: now[0], rounds_pool=pool)
    slow, healthy = Child(0, settings, origin), Child(1, settings, origin)
    supervisor.adopt(slow)
    supervisor.adopt(healthy)
    good = start_server("--worker-id", "4")
    slow.process, slow.metrics = sleeper(), drip.address
    healthy.process, healthy.metrics = sleeper(), f"127.0.0.1:{good.metrics_port}"
    # Counted where the requests are made: the drip's own count lags behind a request
    # the supervisor already gave up on (its thread sees the close a moment later).
    asking: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()

    def counted(address: str, path: str, timeout: float) -> tuple[int, str]:
        if address != drip.address:
            return fetch(address, path, timeout)
        with lock:
            asking[path] = asking.get(path, 0) + 1
            most[path] = max(most.get(path, 0), asking[path])
        try:
            return fetch(address, path, timeout)
        finally:
            with lock:
                asking[path] -= 1

    monkeypatch.setattr(child_module, "fetch", counted)
    try:
        for _ in range(4):
            started = time.monotonic()
            supervisor.supervise_once()
            assert time.monotonic() - started < 2.0
            assert healthy.answers["/livez"][0] == 200, "the healthy child answers every round"
            assert slow.answers["/livez"][0] == NO_ANSWER
            now[0] += 0.5
        assert most and max(most.values()) == 1, f"requests asked at once: {most}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        drip.close()
        good.stop()
        slow.reap()
        healthy.reap()


def test_a_process_that_exits_0_unasked_while_starting_is_try_again(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A stray SIGTERM to the process, not to the supervisor: exiting 0 would leave
    systemd's Restart=on-failure idle with nothing serving."""
    with waiting_to_start(tmp_path, capfd) as child:
        assert child.process is not None
        child.process.send_signal(signal.SIGTERM)
        with pytest.raises(StartupDeferred, match=r"did not start \(exit code 0\)"):
            child.wait_ready(stopping=threading.Event())


def test_a_stop_between_the_check_and_a_spawn_still_stops_that_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal thread acts between the spawn loop's look at the stop and the spawn:
    its SIGTERMs find no process; the start then waited out the process's whole start."""
    settings = load_settings(
        ["--processes", "1", "--worker-id", "3", "--port", "0", "--metrics-port", "0",
         "--first-start-wait", "20", "--state-dir", str(tmp_path / "state"),
         "--host-lock-scope", unique_scope()],
        {},
    )  # fmt: skip
    supervisor = Supervisor(settings)
    spawn = Child.spawn

    def stopped_meanwhile(child: Child, now: float = 0.0) -> None:
        supervisor.stop("SIGTERM")  # as the signal thread would, just now
        spawn(child, now)

    monkeypatch.setattr(Child, "spawn", stopped_meanwhile)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    started = time.monotonic()
    try:
        with pytest.raises(StartupInterrupted):
            supervisor.run()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    took = time.monotonic() - started
    assert took < 10, f"stopped after {took:.1f} s: the process waited out its start"
