"""``--processes N``: N server processes on one port, one worker id each.

Python serves on one core per process, and one worker id makes at most 4,096
ids per ms. So a host scales by processes, not threads: the supervisor starts
N children that bind the same Thrift port with SO_REUSEPORT (the kernel
spreads connections over them), each with its own worker id (consecutive from
``--worker-id``, or from the host name's ordinal x N with ``ordinal``, or leased
from ZooKeeper with ``auto``) and therefore its own generator, state file and
lock: nothing is shared between them. The supervisor serves the metrics of all
children on the one metrics port (each sample labelled ``process``), answers
``/readyz`` for all of them (ready when every child is), and passes SIGTERM,
SIGINT and SIGHUP on (each child drains, or reloads, on its own).

It supervises: every half second it asks every serving child's ``/livez`` and
``/readyz`` at once, each answer due within a second (an absolute deadline; a request
still running from an earlier round is not asked again: it counts as no answer). A
child's ``/metrics`` (rendering it costs the child CPU) is asked only every
``_METRICS_EVERY_S``, by a thread of its own, never counted toward liveness. The
supervisor's own ``/readyz`` and ``/metrics`` answer from the latest answers (its admin
endpoint has one thread: asking the children there would make its ``/livez`` wait
behind them). A child that exits is started again. A child whose ``/livez`` fails is
killed with SIGKILL (a stopped process cannot act on SIGTERM) and started again once
it has exited (one in uninterruptible sleep dies only when its I/O completes: no round
waits for that, and no second process of it starts meanwhile): after ``UNRESPONSIVE_POLLS``
failures in a row spanning ``UNRESPONSIVE_S`` if it certainly does not work (its
process is stopped or traced, or it answers 503: its serving loop has not turned for
--live-max-stall), or spanning ``UNANSWERED_S`` if it only does not answer while its process runs
(starved of CPU under overload, or its admin port flooded: capacity is needed most
then). Restarts wait a delay that doubles from 0.5 s up to 30 s and starts over once a
child has served for a minute. SIGKILL skips the final marks, which is safe: the mark
on disk is always ahead of every id issued (see ``_state.reservation``), and the next
start waits for the clock to pass it. A child that does not start within
:func:`start_limit_s` (its own start-up waits, and a margin) gets SIGTERM (it stops
within about 2 s from any wait, deregistered), then SIGKILL after ``TERM_GRACE_S``.
The supervisor's own ``/livez`` fails once no supervision round has completed for
``LIVE_BOUND_S``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from .._config.settings import ServerSettings
from .._errors import StartupDeferred, StartupInterrupted
from .._http.admin import AdminServer
from .._http.webconfig import load_web_config
from .._observability.lifecycle import Lifecycle
from .._observability.logs import LogFile
from .._observability.metrics import counter_by
from .._observability.probes import Readiness
from .._serving.listeners import check_open_files, listen_socket, started_threads
from .child import (
    FIRST_DELAY_S,
    KILL_WAIT_S,
    NO_ANSWER,
    STOPPED_STATES,
    TERM_GRACE_S,
    Answer,
    Child,
    poll_children,
    process_state,
)
from .node import announce_reload, reload_admin, reload_step
from .node_id import WorkerIdOrigin, configured_origin
from .notify import Notifier
from .ready import ready_line
from .signals import on_signal

__all__ = [
    "ANSWER_BOUND_S",
    "LIVE_BOUND_S",
    "UNANSWERED_S",
    "UNRESPONSIVE_POLLS",
    "UNRESPONSIVE_S",
    "Supervisor",
]

log = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 10.0
_POLL_EVERY_S = 0.5  # a supervision round
_PATHS = ("/livez", "/readyz")  # asked of every serving child each round: cheap
_METRICS_EVERY_S = 5.0
"""The children's ``/metrics`` are asked this often (on a thread of their own), not each
round: rendering them costs each child about 1.4 ms of CPU (its GIL) a time."""
METRICS_BOUND_S = 2 * _METRICS_EVERY_S + 2.0
"""A child's metrics older than this (two refreshes missed) are not served: it reads as
not ready."""
UNRESPONSIVE_POLLS = 3
"""Failed ``/livez`` polls in a row after which a child is killed and replaced, if they
span ``UNRESPONSIVE_S`` (it certainly does not work) or ``UNANSWERED_S`` (it does not
answer)."""
UNRESPONSIVE_S = 3.0
UNANSWERED_S = 15.0
"""A child whose process runs but does not answer its ``/livez`` in time is killed only
after this. Its admin thread answers unless the process is starved of CPU (overload: a
kill would cut capacity when it is needed most), its admin port is flooded, or it holds
the GIL in a stuck call; the child's own liveness tolerates a stall of its serving loop
of --live-max-stall (30 s by default), and 15 s replaces a process stuck for good well
before a pod's liveness probe (3 failures 10 s apart by default) would restart the whole pod."""
ANSWER_BOUND_S = 5.0
"""The supervisor's ``/readyz`` uses a child's answers from the latest round no older
than this (a round takes at most ~2 s: 0.5 s, then answers due within
1.25 s); older ones count as no answer."""
LIVE_BOUND_S = 10.0
"""The supervisor's ``/livez`` fails when no supervision round completed for this long."""
_BACKOFF_MAX_S = 30.0
_BACKOFF_RESET_S = 60.0  # a child that served this long restarts after the first delay again
RESTART_REASONS = ("exited", "unresponsive", "failed")


def _fresh(answer: Answer | None, now: float, bound: float = ANSWER_BOUND_S) -> Answer | None:
    """``answer`` if it is no older than ``bound``."""
    if answer is None or now - answer[2] > bound:
        return None
    return answer


class _ChildrenMetrics(Collector):
    """Every child's metrics, each sample labelled with its process index: as last
    asked by the supervisor's metrics thread (never asked here, on the admin endpoint's
    one thread, which answers ``/livez`` too)."""

    def __init__(self, children: list[Child], clock: Callable[[], float]) -> None:
        self._children = children
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        now = self._clock()
        for child in list(self._children):
            answer = _fresh(child.scraped, now, METRICS_BOUND_S)
            if answer is None or answer[0] != 200:
                # A child that cannot be scraped (dead, restarting) cannot serve either:
                # say so, rather than let its series vanish.
                ready = merged.setdefault(
                    "snowflake_ready",
                    Metric("snowflake_ready", "1 while /readyz answers 200.", "gauge"),
                )
                ready.add_sample("snowflake_ready", {"process": str(child.index)}, 0)
                continue
            try:
                families = list(text_string_to_metric_families(answer[1]))
            except ValueError as e:  # not the exposition format: not this child's
                log.warning("process %d: unreadable metrics: %s", child.index, e)
                families = []
            for family in families:
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "process": str(child.index)}
                    into.samples.append(sample._replace(labels=labels))
        yield from merged.values()


class Supervisor(Collector):
    """Runs ``settings.processes`` children; see the module docstring. ``origin`` says
    where the first worker id came from (see ``resolve_worker_id``). ``clock`` is
    monotonic seconds (the supervision loop's timing: restarts, bounds, answers' age).
    ``rounds_pool`` is the threads a round's requests run on, one per request (the
    caller's to shut down); by default :meth:`run` starts its own. ``admin`` is an admin
    endpoint already serving (the caller's to stop); by default :meth:`run` opens its own.

    As a collector it reports the restarts, by reason (exited, unresponsive, failed).
    """

    def __init__(
        self,
        settings: ServerSettings,
        log_file: LogFile | None = None,
        *,
        origin: WorkerIdOrigin | None = None,
        clock: Callable[[], float] = time.monotonic,
        rounds_pool: ThreadPoolExecutor | None = None,
        admin: AdminServer | None = None,
    ) -> None:
        self._settings = settings
        self._origin = configured_origin(settings) if origin is None else origin
        self._log_file = log_file
        self._clock = clock
        self._admin = admin
        self._stop = threading.Event()
        self._serving = threading.Event()  # every process started: a stop drains now
        self._children: list[Child] = []
        self.lifecycle = Lifecycle()
        self._readiness = Readiness(self.lifecycle)  # its phase; the children's checks are theirs
        self._notifier = Notifier(os.environ)
        self.restarts = dict.fromkeys(RESTART_REASONS, 0)
        self._last_round: float | None = None  # the clock when a round last completed
        self._watch_pool = rounds_pool
        self._metrics_pool: ThreadPoolExecutor | None = None

    def child_settings(self, index: int, port: int, http_port: int) -> ServerSettings:
        """The settings of child ``index``: the parent's, on the shared ``port``, with its
        own worker id, its admin endpoint on loopback, its share of the CPUs."""
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
            # The CPUs shared among the processes: resolved here, where their number is known.
            native_threads=settings.native_thread_count,
            worker_id=worker_id,
            metrics_host="127.0.0.1",
            metrics_port=0,
            # Its admin endpoint is the supervisor's alone, on loopback; the web
            # configuration guards the supervisor's.
            web_config_file="",
        )

    def run(self) -> int:
        settings = self._settings
        # Each child raises its own limit; a limit too low for any of them is found here,
        # before anything starts.
        check_open_files(settings.serving.connection_slots)
        # Threads started now, not when a poll needs one (a host out of threads must not
        # read as children not answering). One per request of a round: a request still
        # running is not asked again (see poll_children). The metrics have their own:
        # however slow they are, the rounds are not.
        own = self._watch_pool is None
        pool = self._watch_pool
        if pool is None:
            pool = started_threads(len(_PATHS) * settings.processes, "supervise")
            self._watch_pool = pool
        try:
            self._metrics_pool = started_threads(settings.processes, "scrape")
            try:
                return self._run()
            finally:
                self._metrics_pool.shutdown(wait=False, cancel_futures=True)
        finally:
            if own:
                pool.shutdown(wait=False, cancel_futures=True)
                self._watch_pool = None  # a later run() starts its own again

    def _run(self) -> int:
        settings = self._settings
        web_config = settings.admin.web_config_file
        web = load_web_config(web_config) if web_config else None  # a bad one: exit 2 now
        # Every port bound before any child starts (and waits): a port in use fails at
        # once. The Thrift ports are held (SO_REUSEPORT, not listening) so that port 0
        # means one port for all.
        admin_sock = listen_socket(settings.admin.host, settings.admin.port, reuse_port=False)
        holders: list[socket.socket] = []
        try:
            holders.append(listen_socket(settings.host, settings.port, reuse_port=True))
            if settings.serving.http:
                holders.append(
                    listen_socket(settings.http_host, settings.http_port, reuse_port=True)
                )
            port = holders[0].getsockname()[1]
            http_port = holders[1].getsockname()[1] if len(holders) > 1 else settings.http_port
            # From the start: a SIGTERM while the processes start stops them cleanly.
            on_signal(signal.SIGTERM, self.stop)
            on_signal(signal.SIGINT, self.stop)
            on_signal(signal.SIGHUP, lambda _name: self.reload())
            for index in range(settings.processes):
                if self._stop.is_set():
                    break
                child = Child(index, self.child_settings(index, port, http_port), self._origin)
                self.adopt(child)
                try:
                    child.spawn(self._clock())
                except OSError as e:  # out of memory or processes: nothing is unsafe
                    raise StartupDeferred(f"cannot start process {index}: {e}") from None
                if self._stop.is_set():
                    # The stop came between the check above and the spawn: the signal
                    # thread's SIGTERMs may have missed this one.
                    child.terminate()
            for child in self._children:
                child.wait_ready(stopping=self._stop)
            if self._stop.is_set():
                raise StartupInterrupted("asked to stop while the processes were starting")
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_ChildrenMetrics(self._children, self._clock))
            registry.register(self)
            admin = AdminServer(
                registry,
                settings.admin,
                ready=self.ready,
                live=self.live,
                bound=admin_sock,
                web=web,
            )
            self._admin = admin
        except BaseException:
            admin_sock.close()
            self._stop_children()
            raise
        finally:
            for holder in holders:
                holder.close()
        # Answers before the first /readyz: "ready" is said once the children are asked.
        self._poll(self._clock())
        self.scrape_children()
        threading.Thread(target=self._scrape, name="scrape", daemon=True).start()
        admin.start()
        self.lifecycle.serving()
        self._serving.set()
        metrics_host, metrics_port = admin.address
        if not self._stop.is_set():  # a stop while starting: no ready line, no READY
            log.info("%d processes serving on %s:%d", settings.processes, settings.host, port)
            http = (settings.http_host, http_port) if settings.serving.http else None
            print(ready_line((settings.host, port), (metrics_host, metrics_port), http), flush=True)
            self._notifier.ready(f"{settings.processes} processes serving")
        try:
            self._watch()
        finally:
            code = self._stop_children()
            admin.stop()
        return code

    def collect(self) -> Iterable[Metric]:
        yield counter_by(
            "snowflake_supervisor_restarts",
            "With --processes: processes restarted by the supervisor, by reason: exited "
            "(it died, or did not start in time), unresponsive (its /livez failed "
            f"{UNRESPONSIVE_POLLS} times in a row over {UNRESPONSIVE_S:g} s while stopped "
            f"or answering 503, or went unanswered for {UNANSWERED_S:g} s: killed), or "
            "failed (it could not be started or supervised: out of memory or processes).",
            "reason",
            self.restarts,
        )

    def live(self) -> str | None:
        """Why the supervisor cannot supervise (no round completed for ``LIVE_BOUND_S``),
        or None. Alive until its first round: starting has its own time limits."""
        last = self._last_round
        if last is None:
            return None
        stalled = self._clock() - last
        if stalled <= LIVE_BOUND_S:
            return None
        return f"the supervision loop has not completed a round for {stalled:.1f} s"

    def adopt(self, child: Child) -> None:
        """Supervise ``child`` from the next round on, as :meth:`run` does each child it
        starts (a child not started yet is started when its ``restart_at`` is due).
        ``ValueError`` for a child whose index is supervised already: two processes of one
        index would serve one worker id."""
        if any(known.index == child.index for known in self._children):
            raise ValueError(f"process {child.index} is supervised already")
        self._children.append(child)

    def stop(self, name: str) -> None:
        """Stop as SIGTERM (``name``) does: while starting, every process is stopped
        and the start ends; while serving, the processes drain; again, they stop now."""
        if not self._serving.is_set():
            # Nothing to drain: each process ends its start-up waits and exits 0.
            log.info("received %s while starting: stopping the processes", name)
            # Never ready from here on: a start that finishes meanwhile must not say so.
            self.lifecycle.draining()
            self._stop.set()
            self._signal_children(signal.SIGTERM)
            return
        if self._stop.is_set():
            # Again: pass it on, so that each process skips the rest of its drain.
            log.info("received %s again: stopping %d processes now", name, len(self._children))
            self._signal_children(signal.SIGTERM)
            return
        log.info("received %s: stopping %d processes", name, len(self._children))
        self.lifecycle.draining()
        self._notifier.stopping(f"draining for {self._settings.drain_seconds:g} s")
        self._stop.set()

    def reload(self) -> None:
        """What SIGHUP does: reopen the log file, reload the admin endpoint's web
        configuration, and pass SIGHUP to every process. One line says what the
        supervisor reloaded (or that it had nothing to) and to how many processes it
        passed SIGHUP; each process then logs its own."""
        # Each step whatever the others met: the processes get their SIGHUP even when the
        # supervisor's own files do not reload.
        if self._log_file is not None:
            reload_step("the log file", self._log_file.reopen)
        web_config = self._admin is not None and bool(self._settings.admin.web_config_file)
        if self._admin is not None:
            reload_admin(self._admin, self._settings.admin.web_config_file)
        passed = 0

        def pass_on() -> None:
            nonlocal passed
            passed = self._signal_children(signal.SIGHUP)

        reload_step("the processes (SIGHUP)", pass_on)
        reloaded = ["the log file"] if self._log_file is not None else []
        reloaded += ["the admin endpoint's web configuration"] if web_config else []
        announce_reload(
            reloaded,
            f"passed SIGHUP on to {passed} processes",
            nothing="SIGHUP: nothing to reload in the supervisor (no log file or web "
            "configuration configured)",
        )

    def _signal_children(self, signum: signal.Signals) -> int:
        """Send ``signum`` to every process running; how many were sent it."""
        # On the signal thread, while the main thread may reap a child (and clear its
        # process): one look at each.
        sent = 0
        for child in self._children:
            process = child.process
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)
                    sent += 1
        return sent

    def _scrape(self) -> None:
        while not self._stop.wait(_METRICS_EVERY_S):
            try:
                self.scrape_children()
            except Exception:  # a bug: the next one may work, and supervision goes on
                log.exception("asking the processes for their metrics failed")

    def scrape_children(self) -> None:
        """Ask every serving child for its ``/metrics`` (all at once, each due within
        ``POLL_TIMEOUT_S``) and keep the answers for the supervisor's ``/metrics``.
        Never counted toward a child's liveness."""
        now = self._clock()
        answers = poll_children(self._children, ("/metrics",), self._metrics_pool)
        for child in self._children:
            answer = answers.get(child.index, {}).get("/metrics")
            if answer is not None and child.metrics:
                child.scraped = (*answer, now)

    def _watch(self) -> None:
        self._last_round = self._clock()
        while not self._stop.wait(_POLL_EVERY_S):
            self.supervise_once()

    def _poll(self, now: float) -> dict[int, dict[str, tuple[int, str]]]:
        """This round's answers of every serving child, each kept with it (for the
        supervisor's /readyz and /metrics)."""
        answers = poll_children(self._children, _PATHS, self._watch_pool)
        for child in self._children:
            if child.index in answers:
                child.answers = {
                    path: (status, body, now)
                    for path, (status, body) in answers[child.index].items()
                }
        return answers

    def supervise_once(self) -> None:
        """One round: every serving child asked at once; a child that exited, did not
        start in time, or failed its polls too long is put down and its restart
        scheduled; a child whose delay is over is started again. One child's trouble
        (a failed fork, a bug) puts that child down, never the round."""
        answers = self._poll(self._clock())
        now = self._clock()
        for child in self._children:
            if self._stop.is_set():
                return
            livez = answers.get(child.index, {}).get("/livez")
            try:
                self._supervise(child, livez, now)
            except Exception as e:  # noqa: BLE001 - whatever it is, the others go on
                self._failed(child, e, now)
        self._last_round = self._clock()

    def _failed(self, child: Child, error: Exception, now: float) -> None:
        """``child``'s step raised: put it down and retry after its delay (which limits
        these lines, as it does restarts)."""
        why = f"could not be supervised ({type(error).__name__}: {error})"
        if not isinstance(error, OSError):  # a fork's failure needs no traceback; a bug does
            log.error("process %d: supervising it failed", child.index, exc_info=error)
        try:
            self._down(child, "failed", why, now)
        except Exception:  # reaping failed too: retry after the delay all the same
            log.exception("process %d: putting it down failed", child.index)
            child.restart_at = now + child.delay_s
            child.delay_s = min(2 * child.delay_s, _BACKOFF_MAX_S)

    def _supervise(self, child: Child, answer: tuple[int, str] | None, now: float) -> None:
        if child.killed_at is not None:
            self._reap_killed(child, now)
            return
        if child.restart_at is not None:
            if now >= child.restart_at:
                if child.process is not None:
                    # Its reaping failed (see _failed): reap it first, never a second
                    # process beside it (nor one _stop_children would not know of).
                    try:
                        child.reap(0)
                    except subprocess.TimeoutExpired:
                        return  # killed, not yet gone: the next round looks again
                child.restart_at = None
                log.info("starting process %d (worker %s) again", child.index,
                         child.settings.worker_id)  # fmt: skip
                child.spawn(now)
            return
        process = child.process
        if process is None:
            return
        code = process.poll()
        limit = child.start_limit
        if child.terminated_at is not None:
            if code is not None:
                why = f"did not start within {limit:g} s: stopped (code {code})"
                self._down(child, "exited", why, now)
            elif now - child.terminated_at >= TERM_GRACE_S:
                why = f"did not start within {limit:g} s, nor stop within {TERM_GRACE_S:g} s"
                self._down(child, "exited", why + ": killed", now)
            return
        if code is not None:
            self._down(child, "exited", f"exited (code {code})", now)
            return
        if not child.metrics:
            if limit is not None and now - child.started_at > limit:
                log.error("process %d (worker %s, pid %d) did not start within %g s: "
                          "stopping it", child.index, child.settings.worker_id,
                          process.pid, limit)  # fmt: skip
                child.terminate(now)
            return
        if child.serving_since is None:
            child.serving_since = now
        if answer is None:
            return  # became ready after this round's polls went out
        status, body = answer
        if status == 200:
            child.failed_polls, child.failing_since = 0, None
            return
        child.failed_polls += 1
        if child.failing_since is None:
            child.failing_since = now
        failing = now - child.failing_since
        state = process_state(process.pid)
        if state in STOPPED_STATES:
            why, bound = f"{_reason(body)}; its process is stopped (state {state})", UNRESPONSIVE_S
        elif status != NO_ANSWER:
            why, bound = _reason(body), UNRESPONSIVE_S  # it answered: it does not work
        else:
            why, bound = f"{_reason(body)}; its process runs", UNANSWERED_S
        if child.failed_polls >= UNRESPONSIVE_POLLS and failing >= bound:
            self._down(
                child, "unresponsive", f"failed /livez {child.failed_polls} times in "
                f"{failing:.1f} s ({why}): killed", now,
            )  # fmt: skip

    def _down(self, child: Child, reason: str, why: str, now: float) -> None:
        """Kill ``child`` and restart it after its delay, counted from its exit: one that
        does not exit at once (in uninterruptible sleep) is looked at each round."""
        process = child.process
        pid = process.pid if process is not None else None
        self.restarts[reason] += 1
        child.restarts += 1
        if child.serving_since is not None and now - child.serving_since >= _BACKOFF_RESET_S:
            child.delay_s = FIRST_DELAY_S
        delay = child.delay_s
        child.delay_s = min(2 * delay, _BACKOFF_MAX_S)
        child.serving_since = None
        try:
            child.reap(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            child.killed_at, child.killed_delay = now, delay
            child.why_down = f"{why}; killed, waiting for it to exit"
            log.error("process %d (worker %s, pid %s) %s: it has not exited yet; restarting "
                      "it %g s after it has", child.index, child.settings.worker_id, pid,
                      why, delay)  # fmt: skip
            return
        child.restart_at = now + delay
        child.why_down = f"{why}; restarting in {delay:g} s"
        log.error("process %d (worker %s, pid %s) %s: restarting it in %g s",
                  child.index, child.settings.worker_id, pid, why, delay)  # fmt: skip

    def _reap_killed(self, child: Child, now: float) -> None:
        """One look at a killed child that had not exited: reaped if it has, its restart
        scheduled then."""
        assert child.killed_at is not None
        try:
            child.reap(0)
        except subprocess.TimeoutExpired:
            process = child.process
            if process is not None:
                child.why_down = (
                    f"killed {now - child.killed_at:.1f} s ago, not exited yet "
                    f"(state {process_state(process.pid) or '?'})"
                )
            return
        log.info("process %d exited %.1f s after SIGKILL: restarting it in %g s",
                 child.index, now - child.killed_at, child.killed_delay)  # fmt: skip
        child.killed_at = None
        child.restart_at = now + child.killed_delay
        child.why_down = f"killed; restarting in {child.killed_delay:g} s"

    def _stop_children(self) -> int:
        code = 0
        self._signal_children(signal.SIGTERM)
        deadline = time.monotonic() + self._settings.drain_seconds + _STOP_TIMEOUT_S
        for child in self._children:
            process = child.process
            if process is None:
                continue
            try:
                if process.wait(max(0.1, deadline - time.monotonic())) != 0:
                    code = 1
            except subprocess.TimeoutExpired:
                code = 1
            try:
                child.reap(KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # killed; it dies when its I/O completes
                log.error("process %d (pid %d) did not exit on SIGKILL", child.index,
                          process.pid)  # fmt: skip
        return code

    def ready(self) -> tuple[str | None, dict[str, object]]:
        """Why the supervisor is not ready (None when it is), and the details its
        ``/readyz`` shows. Ready when every child is (and we are not stopping), by each
        child's answer of the latest supervision round (never asked here: this runs on
        the admin endpoint's one thread, which answers ``/livez`` too); an answer older than
        ``ANSWER_BOUND_S`` is none."""
        now = self._clock()
        unready: dict[str, str] = {}
        ages: dict[str, float | None] = {}
        for child in list(self._children):
            key = str(child.index)
            had = child.answers.get("/readyz")
            answer = _fresh(had, now)
            ages[key] = None if had is None else round(now - had[2], 1)
            if answer is None:
                if had is not None:
                    unready[key] = f"no answer for {now - had[2]:.1f} s"
                else:
                    unready[key] = child.why_down or "starting"
            elif answer[0] != 200:
                unready[key] = _reason(answer[1])
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
            # How old each process's answer is (s): they come from the supervision rounds.
            "checked_s_ago": ages,
        }


def _reason(body: str) -> str:
    """The ``reason`` of a probe's JSON answer, or the body itself."""
    try:
        return str(json.loads(body).get("reason", body))
    except (ValueError, AttributeError):
        return body
