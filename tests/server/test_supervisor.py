"""The supervisor of --processes, in this process: its rounds, limits, probes and kills,
with ``sleep`` and fake admin ports standing for its children (whole server processes
are in tests/acceptance/test_processes.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from snowflake_server import load_settings
from snowflake_server._app.child import (
    NO_ANSWER,
    SUPERVISOR_PID_ENV,
    WORKER_ID_ORIGIN_ENV,
    Child,
    child_argv,
    origin_from_supervisor,
    start_failure,
    start_limit_s,
)
from snowflake_server._app.node_id import WorkerIdOrigin, configured_origin
from snowflake_server._app.supervisor import (
    ANSWER_BOUND_S,
    LIVE_BOUND_S,
    UNANSWERED_S,
    UNRESPONSIVE_S,
    Supervisor,
)
from snowflake_server._errors import (
    ConfigurationError,
    StartupDeferred,
    StartupInterrupted,
    StartupRefused,
)
from snowflake_server._observability.lifecycle import Phase
from tests.support.children import FakeAdmin, sleeper
from tests.support.waiting import wait_until


@pytest.mark.parametrize("worker_id", ["auto", "7", "ordinal"])
def test_children_get_exactly_the_parents_settings(worker_id: str) -> None:
    settings = load_settings(
        ["--worker-id", worker_id, "--zookeeper", "zk:2181", "--skip-sanity-checks",
         "--state-dir", "/s", "--idle-timeout", "5", "--force-node-id"], {},
    )  # fmt: skip
    assert load_settings(child_argv(settings), {}) == settings


def test_children_share_the_cpus_among_their_native_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)))
    settings = load_settings(["--processes", "4", "--worker-id", "3"], {})
    child = Supervisor(settings).child_settings(1, 7609, -1)
    assert (child.processes, child.worker_id, child.native_threads) == (1, 4, 2)
    assert load_settings(child_argv(child), {}).serving.native_threads == 2
    given = Supervisor(replace(settings, native_threads=0)).child_settings(0, 7609, -1)
    assert given.serving.native_threads == 0, "a number given is every child's"


def test_children_are_told_where_their_worker_ids_came_from() -> None:
    """Their flags give only the number the supervisor computed (ordinal x N + i)."""
    origin = WorkerIdOrigin("ordinal", "the host name snowflake-7")
    child = {WORKER_ID_ORIGIN_ENV: json.dumps({"source": "ordinal", "detail": origin.detail})}
    assert origin_from_supervisor({**child, SUPERVISOR_PID_ENV: "1"}) == origin
    assert origin_from_supervisor(child) is None, "only under a supervisor"
    assert origin_from_supervisor({SUPERVISOR_PID_ENV: "1"}) is None


# -- supervision: a wedged child, a child that cannot start, a stalled supervisor ------


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


# -- review: start limits, broken answers, races, probes that never block, kill bounds --


def test_the_start_limit_covers_every_start_up_wait() -> None:
    """A child is given as long as its own waits may take, and a margin (a fixed 60 s
    was less than a cluster child's ~75 s with the defaults)."""
    cluster = load_settings(["--zookeeper", "zk:2181", "--worker-id", "auto"], {})
    # --zk-connect-timeout, the peer-check bound (first-start wait + min(max wait, 60) +
    # 5), the first-start wait (session timeout + skew) and the clock wait.
    waits = 10 + (20 + 10 + 5) + 20 + 10
    limit = start_limit_s(cluster)
    assert limit is not None and limit > waits
    longer = load_settings(["--zookeeper", "zk:2181", "--first-start-wait", "60"], {})
    assert start_limit_s(longer) == limit + 2 * (60 - 20), "counted in both waits"
    standalone = start_limit_s(load_settings(["--max-startup-wait", "100"], {}))
    assert standalone is not None and standalone > 5 + 100
    assert start_limit_s(load_settings(["--max-startup-wait", "inf"], {})) is None


@pytest.mark.parametrize(
    ("code", "timed_out", "raised"),
    [
        (0, False, StartupDeferred),  # exited 0 unasked (a stray SIGTERM): try again
        (2, False, ConfigurationError),
        (3, False, StartupRefused),  # the only "starting could repeat ids"
        (75, False, StartupDeferred),
        (1, False, StartupDeferred),  # a bug: try again, not "an operator must act"
        (-9, False, StartupDeferred),  # killed (the OOM killer)
        (-15, False, StartupDeferred),  # a stray SIGTERM before it could act on it
        (None, False, StartupDeferred),
        (0, True, StartupDeferred),  # stopped by us: it did not start in time
    ],
)
def test_a_process_that_did_not_start_ends_the_supervisor_as_it_said(
    code: int | None, timed_out: bool, raised: type[Exception]
) -> None:
    assert start_failure(code, timed_out=timed_out) is raised
    # Asked to stop: its exit 0, or its end by our SIGTERM, is the stop.
    stopping = StartupInterrupted if code in (0, -15) and not timed_out else raised
    assert start_failure(code, timed_out=timed_out, stopping=True) is stopping


class BrokenAdmin(FakeAdmin):
    """An admin port that answers every request with ``answer`` and closes."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        super().__init__()

    def answer(self, connection: socket.socket, request: bytes) -> None:
        connection.sendall(self._answer)


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",  # BadStatusLine
        b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n{}",  # IncompleteRead: died mid-body
        b"HTTP/1.0 503 No\r\nContent-Length: 100\r\n\r\n{}",  # the same, in an error
        b"",  # closed unanswered
    ],
)
def test_a_broken_answer_is_no_answer_not_the_end_of_supervision(answer: bytes) -> None:
    settings = load_settings(["--worker-id", "3"], {})
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    supervisor.lifecycle.serving()
    child = Child(0, settings, configured_origin(settings))
    supervisor.adopt(child)
    admin = BrokenAdmin(answer)
    child.process, child.metrics = sleeper(), admin.address
    try:
        status, why = child.get("/livez")
        assert status == NO_ANSWER and why
        supervisor.supervise_once()  # a round, not an exception
        assert child.failed_polls == 1 and child.alive()
        assert supervisor.ready()[0] == f"process 0: {child.answers['/readyz'][1]}"
    finally:
        admin.close()
        child.reap()


def test_a_process_that_cannot_be_forked_is_down_and_retried_while_the_others_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(["--worker-id", "3"], {})
    origin = configured_origin(settings)
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    failing, running = Child(0, settings, origin), Child(1, settings, origin)
    supervisor.adopt(failing)
    supervisor.adopt(running)
    running.process, running.started_at = sleeper(), now[0]
    failing.restart_at = now[0]
    # exec fails as a fork would (ENOMEM, EAGAIN): Popen raises OSError.
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    try:
        supervisor.supervise_once()
        assert supervisor.restarts["failed"] == 1
        assert failing.restart_at == now[0] + 0.5, "down, retried after its delay"
        now[0] += 0.5
        supervisor.supervise_once()
        assert supervisor.restarts["failed"] == 2 and failing.restart_at == now[0] + 1
        assert running.alive(), "the other process is left alone"
        assert supervisor.live() is None, "the rounds go on"
    finally:
        running.reap()


def test_signalling_the_processes_while_one_is_reaped() -> None:
    """SIGHUP or SIGTERM (on the signal thread) while the main thread reaps a process."""
    settings = load_settings(["--worker-id", "3"], {})
    supervisor = Supervisor(settings)
    child = Child(0, settings, configured_origin(settings))
    supervisor.adopt(child)

    class ReapedMeanwhile(subprocess.Popen[str]):
        def poll(self) -> int | None:
            code = super().poll()
            child.process = None  # reap() on the main thread, between a look and a use
            return code

    process = ReapedMeanwhile(["sleep", "60"], text=True)
    child.process = process
    try:
        supervisor.stop("SIGTERM")  # while starting: every process gets SIGTERM
        assert process.wait(5) == -signal.SIGTERM
    finally:
        process.kill()
        process.wait()


def test_the_readiness_said_is_the_latest_rounds_and_a_stale_one_is_no_answer() -> None:
    settings = load_settings(["--worker-id", "3"], {})
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    supervisor.lifecycle.serving()
    child = Child(0, settings, configured_origin(settings))
    supervisor.adopt(child)
    child.answers = {"/readyz": (200, "{}", now[0])}
    now[0] += 1.0
    why, details = supervisor.ready()
    assert why is None and details["checked_s_ago"] == {"0": 1.0}
    now[0] += ANSWER_BOUND_S
    why, details = supervisor.ready()
    assert why == f"process 0: no answer for {ANSWER_BOUND_S + 1:.1f} s"
    assert details["processes"] == {"0": "unavailable"}


@pytest.mark.parametrize(
    ("stopped", "status", "bound"),
    [
        (False, NO_ANSWER, UNANSWERED_S),  # running, answering slowly: starved, flooded
        (True, NO_ANSWER, UNRESPONSIVE_S),  # stopped: it cannot answer
        (False, 503, UNRESPONSIVE_S),  # it says its serving loop is stuck
    ],
)
def test_a_process_is_killed_fast_only_when_it_certainly_does_not_work(
    stopped: bool, status: int, bound: float
) -> None:
    supervisor, child, now = supervised_one()
    # A port nothing listens on is no answer at once; a 503 is the child's own word.
    admin = None if status == NO_ANSWER else answering(status, "the serving loop is stuck")
    child.process, child.metrics = sleeper(), "127.0.0.1:1" if admin is None else admin.address
    process = child.process
    if stopped:
        os.kill(process.pid, signal.SIGSTOP)
        wait_until(lambda: alive_state(process.pid) == "T", "the process stopped")
    try:
        while now[0] - 100.0 < bound - 0.5:
            supervisor.supervise_once()
            assert child.answers["/livez"][0] == status
            assert child.process is process, f"killed after {now[0] - 100.0:.1f} s"
            now[0] += 0.5
        now[0] = 100.0 + bound
        supervisor.supervise_once()
        assert child.process is None and process.returncode == -signal.SIGKILL
        assert supervisor.restarts["unresponsive"] == 1
    finally:
        if admin is not None:
            admin.close()
        child.reap()
        process.kill()
        process.wait()


def answering(status: int, reason: str) -> BrokenAdmin:
    """An admin port whose every answer is ``status`` with ``reason``, as a child's."""
    body = json.dumps({"reason": reason}).encode()
    head = b"HTTP/1.0 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body))
    return BrokenAdmin(head + body)


def alive_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# -- second review: kills that do not take, scrapes off the rounds, dripping answers --


class Withheld(subprocess.Popen[str]):
    """A real process (``sleep``) whose handle withholds its exit, as the kernel does
    for a process in uninterruptible sleep (a hung fsync on a network volume: SIGKILL
    takes effect when the I/O completes). It stands for the OS, not for a server:
    nothing else can keep a killed process from dying on demand. ``withhold``:
    "stuck" (poll says running, wait times out) or "broken" (wait raises), until None."""

    def __init__(self) -> None:
        super().__init__(["sleep", "60"], stdout=subprocess.PIPE, text=True, process_group=0)
        self.withhold: str | None = None

    def poll(self) -> int | None:
        return None if self.withhold == "stuck" else super().poll()

    def wait(self, timeout: float | None = None) -> int:
        if self.withhold == "broken":
            raise ChildProcessError("waitpid failed")
        if self.withhold == "stuck":
            if timeout is None:
                raise AssertionError("waited for a killed process with no timeout")
            raise subprocess.TimeoutExpired(self.args, timeout)
        return super().wait(timeout)


def supervised_one() -> tuple[Supervisor, Child, list[float]]:
    settings = load_settings(["--worker-id", "3"], {})
    now = [100.0]
    supervisor = Supervisor(settings, clock=lambda: now[0])
    supervisor.lifecycle.serving()
    child = Child(0, settings, configured_origin(settings))
    supervisor.adopt(child)
    return supervisor, child, now


def test_a_killed_process_that_has_not_exited_blocks_no_round_and_gets_no_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    supervisor, child, now = supervised_one()
    process = Withheld()
    wedged = answering(503, "the serving loop has not turned for 31 s")
    child.process, child.metrics, child.started_at = process, wedged.address, now[0]
    # A restart runs `true`, which ignores its arguments: a stand-in that starts.
    monkeypatch.setattr(sys, "executable", shutil.which("true"))
    try:
        process.withhold = "stuck"
        while now[0] <= 100.0 + UNRESPONSIVE_S:
            supervisor.supervise_once()
            now[0] += 0.5
        assert supervisor.restarts["unresponsive"] == 1, "killed"
        assert os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT) is not None
        for _ in range(10):  # 5 s of rounds, well past its restart delay
            now[0] += 0.5
            supervisor.supervise_once()
            assert child.process is process, "a second process while the first lives"
        assert supervisor.live() is None, "the rounds go on"
        why, _ = supervisor.ready()
        assert why is not None and "not exited yet" in why
        process.withhold = None  # its I/O completed: it dies
        now[0] += 0.5
        supervisor.supervise_once()
        assert child.process is None and process.returncode == -signal.SIGKILL
        assert child.restart_at == now[0] + 0.5, "restarted its delay after it exited"
        now[0] += 0.5
        supervisor.supervise_once()
        assert child.process is not None and child.process is not process, "restarted"
    finally:
        wedged.close()
        process.withhold = None
        child.reap()
        process.kill()
        process.wait()


def test_a_process_whose_reaping_failed_is_reaped_before_it_is_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    supervisor, child, now = supervised_one()
    process = Withheld()
    child.process, child.started_at = process, now[0]
    monkeypatch.setattr(sys, "executable", shutil.which("true"))
    try:
        process.withhold = "broken"
        os.kill(process.pid, signal.SIGKILL)  # it exits; reaping it fails
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        supervisor.supervise_once()
        assert child.restart_at is not None, "down, to be retried"
        for _ in range(4):  # past its restart delays: reaping is tried first each time
            now[0] = child.restart_at
            supervisor.supervise_once()
            assert child.process is process, "the unreaped process was replaced (orphaned)"
        process.withhold = None
        now[0] = child.restart_at
        supervisor.supervise_once()
        assert process.returncode == -signal.SIGKILL
        assert child.process is not None and child.process is not process, "restarted"
    finally:
        process.withhold = None
        child.reap()
        process.kill()
        process.wait()


class OneThreadAdmin(FakeAdmin):
    """An admin port served one request at a time on one thread, as a child's is (its
    event loop): rendering ``/metrics`` there takes ``render_s``, and whatever asks
    meanwhile (``/livez``) waits behind it. Records the paths asked."""

    def __init__(self, render_s: float) -> None:
        self._render = threading.Event()
        self._render_s = render_s
        self.asked: list[str] = []
        super().__init__()

    def answer(self, connection: socket.socket, request: bytes) -> None:
        path = request.split(b" ")[1].decode()
        self.asked.append(path)
        if path == "/metrics":
            self._render.wait(self._render_s)  # the CPU the render takes
        with contextlib.suppress(OSError):
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")


@pytest.mark.slow  # a second or more of real time
def test_the_rounds_ask_no_metrics_so_a_slow_render_never_fails_a_livez() -> None:
    supervisor, child, now = supervised_one()
    admin = OneThreadAdmin(render_s=2.0)
    child.process, child.metrics = sleeper(), admin.address
    try:
        for _ in range(3):
            supervisor.supervise_once()
            assert child.answers["/livez"][0] == 200, child.answers
            assert child.answers["/livez"][2] == now[0], "this round's answer, not the last"
            now[0] += 0.5
        assert "/metrics" not in admin.asked
        supervisor.scrape_children()  # the metrics, asked apart from the rounds
        assert child.scraped is not None and child.scraped[0] == NO_ANSWER
    finally:
        admin.close()
        child.reap()


def test_a_stop_while_starting_is_never_undone_by_the_start_finishing() -> None:
    """A SIGTERM before the children were all up: the start that finishes after it
    marked the supervisor serving and /readyz answered 200 while its children stopped."""
    settings = load_settings(["--worker-id", "3"], {})
    supervisor = Supervisor(settings)
    supervisor.stop("SIGTERM")
    supervisor.lifecycle.serving()  # what _run does once its children answered
    assert supervisor.lifecycle.phase is Phase.DRAINING
    assert supervisor.ready() is not None


def test_a_second_child_of_one_index_is_refused() -> None:
    supervisor, child, _ = supervised_one()
    with pytest.raises(ValueError, match="process 0 is supervised already"):
        supervisor.adopt(Child(0, child.settings, child.origin))
