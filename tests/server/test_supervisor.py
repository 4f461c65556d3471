"""--processes: several server processes on one port, one worker id each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from snowflake_server import decompose, load_settings
from snowflake_server._app.node_id import WorkerIdOrigin, configured_origin
from snowflake_server._app.supervisor import (
    SUPERVISOR_PID_ENV,
    WORKER_ID_ORIGIN_ENV,
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
