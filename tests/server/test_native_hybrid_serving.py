"""The hybrid as it runs in production: native threads answer get_id on the fast path and the
Python server the rest, from one worker's generator state, while the session gate closes,
reopens and expires, the worker is retired and the same worker id leased again, and the
ceiling is passed again and again (a reservation only ``MARGIN_MS`` ahead).

Real parts throughout: the serving core (``Server``) with two native threads on a real
loopback port, a ``WorkerSlot`` and a ``SessionGate`` on the boot clock (the one native threads
read), workers opened as cluster mode opens them (a second mark store, here a state file, with
its own margin, as ZooKeeper's is), eight client threads on real sockets pipelining calls.
The test plays the cluster: it opens and closes the gate as heartbeats and a lost session do,
and retires and installs workers as a re-lease does. Every reply carries when its request was
sent and when it came back, on the boot clock, so the checks need no guess of the timing:

- no id twice, and every id higher than every id whose reply came back before its request
  was sent (on any connection: one worker id, one sequence, across re-leases);
- on each connection the ids increase;
- no id for a request sent after ``gate.close()`` returned (or after the gate's deadline, or
  after ``retire()`` returned) and answered before the gate was opened again;
- every id covered by the marks on disk from the moment it was answered: a crash then would
  restart past it (the ceiling is raised only after the mark is stored).
"""

from __future__ import annotations

import bisect
import json
import random
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from snowflake_thrift_client._idl import snowflake_thrift
from thriftpy2.protocol import TCyBinaryProtocol
from thriftpy2.thrift import TMessageType
from thriftpy2.transport import TCyMemoryBuffer

from snowflake_server import ServerSettings, decompose
from snowflake_server._cluster.gate import SessionGate
from snowflake_server._cluster.slot import WorkerSlot
from snowflake_server._ids.clocks import boot_clock, wall_clock_ms
from snowflake_server._native import native_core
from snowflake_server._observability.metrics import ConnectionStats, ServiceMetrics
from snowflake_server._service import SnowflakeHandler
from snowflake_server._serving.listeners import listen_socket
from snowflake_server._serving.server import Endpoint, Native, Server
from snowflake_server._state.statefile import StateFile
from snowflake_server._state.worker import Worker
from snowflake_server._thrift.processor import Processor, frame, service_methods
from snowflake_server._thrift.protocol import thrift_protocols
from tests.support.serving import ThriftReader
from tests.support.waiting import wait_until

core: Any = native_core()
pytestmark = [
    pytest.mark.skipif(core is None, reason="the native core is not built"),
    pytest.mark.slow,
]

WORKER_ID = 27
CLIENTS = 8
THREADS = 2
LIMIT = 64 * 1024
MARGIN_MS = 25
"""The second store's margin: the ceiling is at most this far ahead, so native calls pass it
every few dozen ms and Python's slow path asks for a renewal."""
LONG_S = 60.0  # a session timeout that outlives the test: the gate stays open until closed
SHORT_S = 0.4  # one whose deadline passes while the clients call (0.9 x 0.4 s)
ROUNDS = 3
PROGRESS = 300  # calls answered (natively, or at all) before a phase moves on


def get_id(agent: str, seqid: int) -> bytes:
    return _call("get_id", seqid, useragent=agent)


def _call(method: str, seqid: int, **args: Any) -> bytes:
    out: Any = TCyMemoryBuffer()
    protocol: Any = TCyBinaryProtocol(out)  # type: ignore[no-untyped-call]
    protocol.write_message_begin(method, 1, seqid)
    getattr(snowflake_thrift().Snowflake, f"{method}_args")(**args).write(protocol)
    protocol.write_message_end()
    protocol.trans.flush()
    return frame(out.getvalue())


@dataclass
class Answer:
    """One reply: when its request was sent and when the reply was read (boot clock)."""

    sent: float
    got: float
    ids: list[int]


@dataclass
class Calls:
    """What the clients saw, shared with the test (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    answers: list[list[Answer]] = field(default_factory=list)  # per connection, in order
    refused: list[tuple[float, float]] = field(default_factory=list)  # UnavailableError
    unexpected: list[str] = field(default_factory=list)

    def count(self, since: float, *, ids: bool) -> int:
        """Replies (with ids, or refusals) to requests sent after ``since``."""
        with self.lock:
            if ids:
                return sum(1 for conn in self.answers for a in conn if a.sent > since)
            return sum(1 for sent, _ in self.refused if sent > since)


def client(port: int, index: int, calls: Calls, stop: threading.Event) -> None:
    """Pipeline batches of whole calls (mostly get_id, a few get_ids and get_layout, which
    Python serves) until ``stop``, reading every reply before the next batch."""
    rng = random.Random(index)
    agent = f"hybrid-{index}"
    mine: list[Answer] = []
    with calls.lock:
        calls.answers.append(mine)
    seqid = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reader = ThriftReader(sock, framed=True)
        while not stop.is_set():
            batch = []
            for _ in range(rng.randrange(1, 13)):
                seqid += 1
                pick = rng.random()
                if pick < 0.04:
                    batch.append(("get_ids", _call("get_ids", seqid, useragent=agent, count=3)))
                elif pick < 0.07:
                    batch.append(("get_layout", _call("get_layout", seqid)))
                else:
                    batch.append(("get_id", get_id(agent, seqid)))
            first = seqid - len(batch) + 1
            sent = boot_clock()
            sock.sendall(b"".join(data for _, data in batch))
            for k, (method, _) in enumerate(batch):
                name, mtype, got_seqid, result = reader.reply()
                got = boot_clock()
                if name != method or got_seqid != first + k or mtype != TMessageType.REPLY:
                    calls.unexpected.append(f"{method} #{first + k}: {name} #{got_seqid} {mtype}")
                    return
                if method == "get_layout":
                    continue
                if result.success is not None:
                    ids = [result.success] if method == "get_id" else list(result.success)
                    with calls.lock:
                        mine.append(Answer(sent, got, ids))
                elif getattr(result, "unavailable", None) is not None:
                    with calls.lock:
                        calls.refused.append((sent, got))
                else:
                    calls.unexpected.append(f"{method} #{got_seqid}: {result}")


class Hybrid:
    """A serving core with native threads over a slot whose worker and gate the test drives."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        settings = ServerSettings(
            worker_id=WORKER_ID,
            state_dir=str(tmp_path / "state"),
            first_start_wait=0.0,
            host_lock_scope=str(tmp_path),
        )
        self.worker_settings = replace(settings.worker, native_state=True)
        self.gate = SessionGate()  # the boot clock: native threads read the same
        self.slot = WorkerSlot(settings.ids, self.gate)
        self.remote: StateFile | None = None
        self.slot.install(self.open_worker())
        self.metrics = ServiceMetrics(self.slot, service_methods(), max_agents=CLIENTS + 1)
        self.registry = core.AgentRegistry()
        self.stats = core.NativeStats(THREADS)
        self.machine = core.Listener(THREADS, self.registry, self.stats, LIMIT)
        self.slot.watch(self.machine.set_state)
        self.metrics.add_native(self.stats, self.registry)
        self.prometheus = self.metrics.registry()

        def processor(stats: ConnectionStats) -> Processor:
            return Processor(SnowflakeHandler(self.slot, self.metrics, stats, wall_clock_ms), stats)

        sock = listen_socket("127.0.0.1", 0, reuse_port=False)
        self.port = sock.getsockname()[1]
        endpoint = Endpoint(
            "thrift",
            sock,
            thrift_protocols(processor, framed=True, limit=LIMIT),
            CLIENTS + 4,
            native=Native(self.machine, core, self.registry, self.metrics.agent_index),
        )
        self.server = Server([endpoint], self.metrics)
        self.server.listen()
        assert self.server.native_endpoints == {"thrift"}, "the native threads started"
        self.thread = threading.Thread(target=self.server.serve_forever, name="hybrid-server")
        self.thread.start()

    def open_worker(self) -> Worker:
        """The worker of ``WORKER_ID``, as cluster mode opens it: past its marks in both
        stores (the state file's 1 s ahead, the second store's ``MARGIN_MS``)."""
        remote = StateFile.open(self.tmp_path / "remote", 0, WORKER_ID, self.worker_settings.layout)
        remote.load()
        self.remote = remote
        worker = Worker.open(
            self.worker_settings, WORKER_ID, clock=wall_clock_ms, remote=(remote, MARGIN_MS)
        )
        assert worker.native_state is not None, "the native core is built: the state is native"
        return worker

    def open_gate(self, timeout_s: float) -> None:
        """A registration proven by a heartbeat ZooKeeper answers now."""
        self.gate.reopen(self.gate.registering())
        assert self.gate.confirm(self.gate.send(), timeout_s)

    def retire(self) -> None:
        """Retire the worker (its gate closed, its state closed and sealed, its marks final)."""
        assert self.slot.retire("re-leasing") is not None
        assert self.remote is not None
        self.remote.close()

    def stored_mark(self) -> int:
        """The lowest of the marks the two state files hold now (-1: none yet)."""
        marks = []
        for directory in ("state", "remote"):
            path = self.tmp_path / directory / f"worker-0-{WORKER_ID}.json"
            try:
                marks.append(int(json.loads(path.read_text())["high_water_mark_ms"]))
            except FileNotFoundError:
                return -1
        return min(marks)

    def native(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = self.stats.snapshot()
        return snapshot

    def sample(self, name: str, **labels: str) -> float:
        value = self.prometheus.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def close(self) -> None:
        self.server.request_shutdown()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server did not stop within 10 s"
        worker = self.slot.retire("test over")
        if worker is not None:
            worker.close()
        if self.remote is not None:
            self.remote.close()


@pytest.fixture
def hybrid(tmp_path: Path) -> Iterator[Hybrid]:
    made = Hybrid(tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_native_and_python_share_one_state_through_gate_expiries_re_leases_and_ceilings(
    hybrid: Hybrid,
) -> None:
    calls = Calls()
    stop = threading.Event()
    closed: list[tuple[str, float, float]] = []  # (what, from, until): no id may be issued

    def natively_served(at_least: int) -> Callable[[], bool]:
        start = hybrid.native()["calls"]
        return lambda: hybrid.native()["calls"] >= start + at_least

    def serving_phase(what: str) -> None:
        since = boot_clock()
        native = natively_served(PROGRESS)
        wait_until(
            lambda: native() and calls.count(since, ids=True) >= PROGRESS,
            f"native threads and Python serve after {what}",
        )

    def refusing_phase(what: str, since: float) -> None:
        wait_until(
            lambda: calls.count(since, ids=False) >= CLIENTS,
            f"calls are refused after {what}",
        )

    marks: list[tuple[float, int]] = []  # (when, the lowest mark stored then), boot clock

    def watch_marks() -> None:
        while not stop.is_set():
            marks.append((boot_clock(), hybrid.stored_mark()))
            stop.wait(0.001)  # a sample a ms: the mark moves every few dozen

    hybrid.open_gate(LONG_S)
    sampler = threading.Thread(target=watch_marks, name="marks")
    sampler.start()
    clients = [
        threading.Thread(target=client, args=(hybrid.port, i, calls, stop), name=f"client-{i}")
        for i in range(CLIENTS)
    ]
    for thread in clients:
        thread.start()
    try:
        for _ in range(ROUNDS):
            serving_phase("the gate opened")
            # A lost session: the gate closes at once.
            hybrid.gate.close("the session was lost")
            shut = boot_clock()
            refusing_phase("the gate closed", shut)
            reopening = boot_clock()
            closed.append(("gate closed", shut, reopening))
            hybrid.open_gate(SHORT_S)
            # ZooKeeper out of reach: nothing closes the gate, its deadline passes.
            deadline = hybrid.gate.open_until
            serving_phase("the gate reopened")
            wait_until(lambda: not hybrid.gate.is_open(), "the gate's deadline passes")
            refusing_phase("the deadline passed", deadline)
            reopening = boot_clock()
            closed.append(("deadline passed", deadline, reopening))
            hybrid.open_gate(LONG_S)
            serving_phase("a heartbeat proved the session again")
            # A re-lease: the worker retired, the same worker id leased and opened again.
            hybrid.retire()
            retired = boot_clock()
            refusing_phase("the worker retired", retired)
            hybrid.slot.install(hybrid.open_worker())
            refusing_phase("a worker installed, its registration not proven yet", boot_clock())
            reopening = boot_clock()
            closed.append(("retired", retired, reopening))
            hybrid.open_gate(LONG_S)
        serving_phase("the last re-lease")
    finally:
        stop.set()
        for thread in clients:
            thread.join(10)
        sampler.join(10)
    marks.append((boot_clock(), hybrid.stored_mark()))
    assert not any(thread.is_alive() for thread in clients), "a client is stuck"
    assert not calls.unexpected, calls.unexpected[:5]

    answers = [a for conn in calls.answers for a in conn]
    ids = [i for a in answers for i in a.ids]
    assert len(set(ids)) == len(ids), "an id was issued twice"
    assert {decompose(i).worker_id for i in ids} == {WORKER_ID}
    for conn in calls.answers:
        on_conn = [i for a in conn for i in a.ids]
        assert on_conn == sorted(on_conn), "ids went down on one connection"
    # Every id above every id answered before its request left: one sequence, whoever
    # issued it, across re-leases.
    answers.sort(key=lambda a: a.got)
    got = [a.got for a in answers]
    highest: list[int] = []
    for a in answers:
        highest.append(max(a.ids) if not highest else max(highest[-1], max(a.ids)))
    for a in answers:
        before = bisect.bisect_left(got, a.sent)
        if before:
            assert min(a.ids) > highest[before - 1], "an id lower than one issued before it"
    # Covered on disk from when it was answered on: the first sample taken after the reply.
    times = [t for t, _ in marks]
    for a in answers:
        at = bisect.bisect_right(times, a.got)
        newest = max(decompose(i).timestamp_ms for i in a.ids)
        assert newest <= marks[at][1], f"id of ms {newest} answered, the mark {marks[at][1]}"
    for what, since, until in closed:
        issued = [a for a in answers if since < a.sent and a.got < until]
        assert not issued, f"ids issued after {what}: {issued[:3]}"

    native_calls = hybrid.sample("snowflake_native_calls_total")
    gate_handoffs = hybrid.sample("snowflake_native_handoffs_total", reason="gate")
    stalls = hybrid.slot.counters().reservation_stalls
    print(
        f"\n{len(ids)} ids in {len(answers)} replies, {len(calls.refused)} refused; "
        f"native calls {native_calls:.0f}, handoffs {hybrid.native()['handoffs']}, "
        f"reservation stalls {stalls}"
    )
    assert native_calls > 0.25 * len(answers), "native threads served a good share"
    assert gate_handoffs > 0, "native handed calls to Python at the closed gate"
    assert stalls > 0, "calls passed the ceiling while they were served"
