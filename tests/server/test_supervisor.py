"""--processes: several server processes on one port, one worker id each."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from snowflake_thrift_client._transports import open_client

from snowflake_server import decompose, load_settings
from snowflake_server._app.node_id import WorkerIdOrigin, configured_origin
from snowflake_server._app.supervisor import (
    LIVE_BOUND_S,
    SUPERVISOR_PID_ENV,
    UNRESPONSIVE_S,
    WORKER_ID_ORIGIN_ENV,
    Supervisor,
    _Child,
    _ChildrenMetrics,
    child_argv,
    origin_from_supervisor,
)
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
    total = sum(v for k, v in counts.items() if k.startswith("snowflake_ids_generated_total"))
    assert total == 50
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
    alive, dead = _Child(0, settings, origin), _Child(1, settings, origin)
    dead.metrics = f"127.0.0.1:{free_port()}"  # nothing answers there
    child = start_server("--worker-id", "3")
    try:
        alive.metrics = f"127.0.0.1:{child.metrics_port}"
        families = {f.name: f for f in _ChildrenMetrics([alive, dead]).collect()}
    finally:
        child.stop()
    ready = {s.labels["process"]: s.value for s in families["snowflake_ready"].samples}
    assert ready == {"0": 1, "1": 0}


def test_worker_ids_must_fit_for_every_process() -> None:
    with pytest.raises(ServerDidNotStart, match=r"worker_id must be in 0\.\.31, got 32"):
        start_server("--processes", "3", "--worker-id", "30")


@pytest.mark.parametrize("worker_id", ["auto", "7", "ordinal"])
def test_children_get_exactly_the_parents_settings(worker_id: str) -> None:
    settings = load_settings(
        ["--worker-id", worker_id, "--zookeeper", "zk:2181", "--skip-sanity-checks",
         "--state-dir", "/s", "--idle-timeout", "5", "--force-node-id"], {},
    )  # fmt: skip
    assert load_settings(child_argv(settings), {}) == settings


def test_children_are_told_where_their_worker_ids_came_from() -> None:
    """Their flags give only the number the supervisor computed (ordinal x N + i)."""
    origin = WorkerIdOrigin("ordinal", "the host name snowflake-7")
    child = {WORKER_ID_ORIGIN_ENV: json.dumps({"source": "ordinal", "detail": origin.detail})}
    assert origin_from_supervisor({**child, SUPERVISOR_PID_ENV: "1"}) == origin
    assert origin_from_supervisor(child) is None, "only under a supervisor"
    assert origin_from_supervisor({SUPERVISOR_PID_ENV: "1"}) is None


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


# -- supervision: a wedged child, a child that cannot start, a stalled supervisor ------


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
        took, status, body = timed_readyz(pair)
        assert took < 2.5, f"/readyz took {took:.2f} s during the wedge"
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


def test_the_supervisors_livez_fails_when_its_loop_stalls() -> None:
    now = [100.0]
    supervisor = Supervisor(load_settings(["--processes", "2"], {}), clock=lambda: now[0])
    assert supervisor.live() is None, "alive while starting"
    supervisor.supervise_once()  # no children: a round all the same
    now[0] += LIVE_BOUND_S
    assert supervisor.live() is None
    now[0] += 0.5
    assert supervisor.live() == "the supervision loop has not completed a round for 10.5 s"
    supervisor.supervise_once()
    assert supervisor.live() is None
