"""The partition nemesis: a cluster in network namespaces under recorded load, and the
checks run on the record afterwards.

The record (``nemesis_load.py``, in the clients' namespace) holds every get_id call of
every node with its monotonic start and end times, every /readyz poll likewise, and
every change of the registrations in ZooKeeper. Times are comparable across processes:
they all read the machine's one monotonic clock. An outcome happened at some instant
between a record's ``t0`` and ``t1``; each check below says which end it uses and why,
so that none is looser than the record allows.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from snowflake_thrift_client import decompose

from snowflake_server._native import native_core
from tests.support.netns import Host, Network
from tests.support.processes import ServerProcess, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeperEnsemble

THRIFT_PORT = 7609  # each node has a namespace, so a port, of its own: the defaults
ADMIN_PORT = 9990
SESSION_S = 4.0  # asked for; the ensemble grants less (ZooKeeperEnsemble's max_session_ms)
LOAD_SCRIPT = Path(__file__).with_name("nemesis_load.py")
RECORD_S = 90  # the recorder stops by itself after this long: a scenario takes under a minute


# -- the record ---------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One get_id: an id, or the failure's kind (``answered``: the server refused it,
    rather than no answer at all)."""

    node: str
    t0: float
    t1: float
    id: int | None = None
    err: str = ""
    msg: str = ""
    answered: bool = False

    def stamped_s(self) -> float:
        """The id's timestamp, in seconds since the Unix epoch (its node's clock)."""
        assert self.id is not None
        return decompose(self.id).timestamp_ms / 1000

    @property
    def worker(self) -> tuple[int, int]:
        assert self.id is not None
        decoded = decompose(self.id)
        return decoded.datacenter_id, decoded.worker_id


@dataclass(frozen=True)
class Sample:
    """One /readyz poll: its status (None: no answer) and the reason given."""

    node: str
    t0: float
    t1: float
    status: int | None
    reason: str


@dataclass(frozen=True)
class Claim:
    """A worker id leased by the recorder's own session, right after the registration of
    ``holder`` (a node's ``host:port``) was seen gone at ``gone``."""

    worker: int
    holder: str
    gone: float
    t0: float
    t1: float
    ok: bool
    err: str


@dataclass(frozen=True)
class Snapshot:
    """The registrations (worker id: ``data``, the node's ``host:port``, and ``owner``,
    its session) as read between ``t0`` and ``t``."""

    t0: float
    t: float
    nodes: dict[str, dict[str, str]]

    def holders(self) -> set[str]:
        return {node["data"] for node in self.nodes.values()}


@dataclass
class Recording:
    """The recorder's JSON lines, read as they grow (:meth:`refresh`)."""

    path: Path
    calls: list[Call] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    registrations: list[Snapshot] = field(default_factory=list)
    zk_events: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def refresh(self) -> Recording:
        if not self.path.exists():
            return self
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            self._add(json.loads(line))
        return self

    def _add(self, record: dict[str, Any]) -> None:
        kind = record.pop("k")
        if kind == "call":
            self.calls.append(Call(**record))
        elif kind == "ready":
            self.samples.append(Sample(**record))
        elif kind == "claim":
            self.claims.append(Claim(**record))
        elif kind == "znodes":
            self.registrations.append(Snapshot(**record))
        elif kind in ("zk-state", "zk-error"):
            self.zk_events.append(record)

    def successes(self, node: str, since: float = float("-inf")) -> list[Call]:
        return [c for c in self.calls if c.node == node and c.id is not None and c.t0 >= since]

    def failures(self, node: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.id is None and node in (None, c.node)]


# -- the checks -----------------------------------------------------------------------


def duplicates(calls: Iterable[Call]) -> dict[int, list[Call]]:
    """Every id handed out more than once, with the calls that got it."""
    by_id: dict[int, list[Call]] = defaultdict(list)
    for call in calls:
        if call.id is not None:
            by_id[call.id].append(call)
    return {i: got for i, got in by_id.items() if len(got) > 1}


def order_violations(calls: Iterable[Call]) -> list[str]:
    """Ids not above every id of the same worker id (datacenter, worker) that was received
    before the call started: that earlier id was surely issued first, whichever node or
    process issued either."""
    by_worker: dict[tuple[int, int], list[tuple[Call, int]]] = defaultdict(list)
    for call in calls:
        if call.id is not None:
            by_worker[call.worker].append((call, call.id))
    found = []
    for worker, got in sorted(by_worker.items()):
        ended = sorted(got, key=lambda pair: pair[0].t1)
        done, highest = 0, None
        for call, new_id in sorted(got, key=lambda pair: pair[0].t0):
            while done < len(ended) and ended[done][0].t1 < call.t0:
                if highest is None or ended[done][1] > highest[1]:
                    highest = ended[done]
                done += 1
            if highest is not None and new_id <= highest[1]:
                before, before_id = highest
                found.append(
                    f"worker {worker}: {call.node} issued {new_id} at {call.t0:.3f} after "
                    f"{before.node} had issued {before_id} (received at {before.t1:.3f})"
                )
    return found


def failure_runs(calls: Iterable[Call]) -> list[list[Call]]:
    """Each node's failed get_ids in runs: a run ends at the node's next success."""
    runs: list[list[Call]] = []
    current: dict[str, list[Call]] = {}
    for call in sorted(calls, key=lambda c: c.t0):
        if call.id is not None:
            if call.node in current:
                runs.append(current.pop(call.node))
        else:
            current.setdefault(call.node, []).append(call)
    return runs + list(current.values())


@dataclass(frozen=True)
class Readiness:
    """What :func:`readiness_violations` found, and how much it could judge."""

    violations: list[str]
    runs: int  # failure runs
    witnessed: int  # of them, with a /readyz poll inside


def readiness_violations(calls: Iterable[Call], samples: Iterable[Sample]) -> Readiness:
    """/readyz polls that said 200 inside a run of failed get_ids.

    Between two failed calls of a run no call of that node succeeded, and the calls
    come every few ms: the node was unable to serve from the first failure to the last
    (a node that served for longer than a call's pace would have answered one). So a
    poll that started after the run's first failure ended and ended before its last
    failure started saw a node that could not serve, and must not say 200 (503, or no
    answer at all from a stopped process, is right). A run shorter than the gap
    between two polls (50 ms) may have no poll inside: it is counted, not judged.
    """
    polls: dict[str, list[Sample]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: s.t0):
        polls[sample.node].append(sample)
    found: list[str] = []
    runs = failure_runs(calls)
    witnessed = 0
    for run in runs:
        first, last = run[0], run[-1]
        inside = [s for s in polls[first.node] if s.t0 >= first.t1 and s.t1 <= last.t0]
        witnessed += bool(inside)
        wrong = [s for s in inside if s.status == 200]
        if wrong:
            found.append(
                f"{first.node}: /readyz said 200 {len(wrong)} of {len(inside)} times (first at "
                f"{wrong[0].t0:.3f}) while {len(run)} get_ids failed from {first.t0:.3f} to "
                f"{last.t1:.3f} ({first.err}: {first.msg})"
            )
    return Readiness(found, len(runs), witnessed)


def lease_violations(recording: Recording, names: dict[str, str]) -> list[str]:
    """Ids, and /readyz 200s, from a node after its registration was gone (and the
    recorder had leased its worker id, as another node would).

    The registration was gone when the recorder's read showing it missing completed
    (``Claim.gone``). Every id of that worker id from that node must have been received
    before then. And until the node registers again (after the ``t0`` of the last
    snapshot that did not show it, when it was surely not registered yet), no /readyz
    poll that started after ``gone`` may say 200: it holds no worker id at all.
    """
    found = []
    for claim in recording.claims:
        node = names.get(claim.holder)
        if not claim.ok or node is None:
            continue
        late = [
            c for c in recording.successes(node)
            if c.worker[1] == claim.worker and c.t1 >= claim.gone
        ]  # fmt: skip
        if late:
            found.append(
                f"{node} handed out {len(late)} ids of worker {claim.worker} after its "
                f"registration was gone at {claim.gone:.3f} (leased elsewhere at "
                f"{claim.t1:.3f}): first {late[0].id} received at {late[0].t1:.3f}, last "
                f"{late[-1].id} at {late[-1].t1:.3f}"
            )
        unregistered = float("inf")
        without = None  # the latest snapshot, from the one that saw it gone, without it
        for snapshot in recording.registrations:
            if snapshot.t < claim.gone:
                continue
            if claim.holder in snapshot.holders():
                unregistered = without.t0 if without is not None else claim.gone
                break
            without = snapshot
        ready = [
            s for s in recording.samples
            if s.node == node and s.status == 200 and s.t0 >= claim.gone
            and s.t1 <= unregistered
        ]  # fmt: skip
        if ready:
            found.append(
                f"{node}'s /readyz said 200 {len(ready)} times from {ready[0].t0:.3f} to "
                f"{ready[-1].t1:.3f}, after its registration of worker {claim.worker} was "
                f"gone at {claim.gone:.3f} and before it registered again"
            )
    return found


def margin_before_lease(recording: Recording, names: dict[str, str]) -> dict[str, float]:
    """Per claimed registration: how long before it was seen gone its node's last id of
    that worker id was received (what makes the lease check pass)."""
    margins = {}
    for claim in recording.claims:
        node = names.get(claim.holder)
        if claim.ok and node is not None:
            ids = [c.t1 for c in recording.successes(node) if c.worker[1] == claim.worker]
            margins[f"{node}/w{claim.worker}"] = claim.gone - max(ids, default=claim.gone)
    return margins


def longest_outage(calls: Sequence[Call], node: str) -> float:
    """The longest time ``node`` handed out nothing: from the start of a failed call to
    the end of the next successful one (or the last call)."""
    longest, since = 0.0, None
    for call in sorted((c for c in calls if c.node == node), key=lambda c: c.t0):
        if call.id is None and since is None:
            since = call.t0
        elif call.id is not None and since is not None:
            longest = max(longest, call.t1 - since)
            since = None
    if since is not None:
        longest = max(longest, max(c.t1 for c in calls if c.node == node) - since)
    return longest


# -- native serving -------------------------------------------------------------------

NATIVE = native_core() is not None
"""The nodes serve get_id on native threads (the core is built here, as for them, and
``SNOWFLAKE_NO_NATIVE`` is not set: they inherit this environment)."""

_SCRAPE = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
)


@dataclass(frozen=True)
class NativeCounts:
    """A node's native serving as its /metrics says: threads serving, calls answered
    natively, frames handed to Python by reason."""

    threads: float
    calls: float
    handoffs: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> NativeCounts:
        threads = calls = 0.0
        handoffs: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "snowflake_native_threads":
                    threads = sample.value
                elif sample.name == "snowflake_native_calls_total":
                    calls = sample.value
                elif sample.name == "snowflake_native_handoffs_total":
                    handoffs[sample.labels["reason"]] = sample.value
        return cls(threads, calls, handoffs)

    def line(self) -> str:
        handed = ",".join(f"{k}:{v:.0f}" for k, v in sorted(self.handoffs.items()) if v)
        return f"{self.calls:.0f}/{handed or 'none'}"


# -- the cluster under load -----------------------------------------------------------

ZOOKEEPERS = ("zk1", "zk2", "zk3")
NODES = ("n1", "n2", "n3")
CLIENT = "client"
HOSTS = (*ZOOKEEPERS, *NODES, CLIENT)
BASELINE = 200  # ids from every node before a fault, and again after it ends


def node_flags(host: Host, ensemble: ZooKeeperEnsemble, zk_path: str) -> list[str]:
    """A node in ``host``'s namespace, on its own address, leasing its worker id,
    reaching the ensemble as it is secured."""
    return [
        "--zookeeper", ensemble.hosts, "--zk-path", zk_path, "--worker-id", "auto",
        "--host", host.address, "--advertise-host", host.address,
        "--metrics-host", host.address,
        "--port", str(THRIFT_PORT), "--metrics-port", str(ADMIN_PORT),
        "--zk-session-timeout", f"{SESSION_S:g}", "--zk-connect-timeout", "10",
        *ensemble.access_flags(),
    ]  # fmt: skip


def load_zk_config(ensemble: ZooKeeperEnsemble) -> dict[str, Any]:
    """How ``nemesis_load.py`` reaches ``ensemble``: as the nodes do (JSON)."""
    config: dict[str, Any] = {"zk_auth": "none", "zk_tls": {}}
    if ensemble.tls is not None:
        config["zk_tls"] = ensemble.tls.client_options()
    if ensemble.service is not None:
        config["zk_auth"] = "sasl"
        config["zk_credentials_file"] = str(ensemble.service.credentials_file)
    return config


class Recorder:
    """``nemesis_load.py`` in ``client``'s namespace, against ``nodes``."""

    def __init__(
        self,
        client: Host,
        directory: Path,
        nodes: Sequence[Host],
        ensemble: ZooKeeperEnsemble,
        zk_path: str,
        *,
        claim: bool,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.recording = Recording(directory / "record.jsonl")
        config = {
            "out": str(self.recording.path),
            "deadline_s": RECORD_S,
            "pace_s": 0.005,  # a get_id every 5 ms per node
            "call_timeout_s": 1.0,
            "poll_s": 0.05,  # a /readyz poll every 50 ms per node
            "nodes": [
                {"name": h.name, "host": h.address, "port": THRIFT_PORT, "metrics_port": ADMIN_PORT}
                for h in nodes
            ],
            "zookeeper": ensemble.hosts,
            "zk_path": zk_path,
            "datacenter": 0,
            "zk_session_s": 10.0,
            "claim": claim,
            **load_zk_config(ensemble),
        }
        path = directory / "load.json"
        path.write_text(json.dumps(config))
        self._log = directory / "load.log"
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                client.command(sys.executable, str(LOAD_SCRIPT), str(path)),
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def stop(self) -> Recording:
        """End the load (closing its standard input) and read the whole record."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        finally:
            if self._process.poll() is None:
                self._process.kill()
                self._process.wait()
        assert self._process.returncode == 0, self._log.read_text()
        return self.recording.refresh()

    def wait(self, condition: Callable[[Recording], object], what: str, timeout_s: float) -> None:
        def seen() -> object:
            assert self._process.poll() is None, (
                f"the recorder ended (its {RECORD_S} s deadline, or a crash): "
                f"{self._log.read_text()}"
            )
            return condition(self.recording.refresh())

        wait_until(seen, what, timeout_s)


class Scenario:
    """One scenario: the nodes it starts, its recorder, its faults, the checks at the end."""

    def __init__(
        self, network: Network, ensemble: ZooKeeperEnsemble, zk_path: str, directory: Path
    ) -> None:
        self.name = ""
        self.network = network
        self.ensemble = ensemble
        self.zk_path = zk_path
        self.directory = directory
        self.nodes: dict[str, ServerProcess] = {}  # the node process in each host now
        self.started: list[tuple[str, ServerProcess]] = []  # and every one started
        self.recorder: Recorder | None = None
        self.events: list[tuple[float, str]] = []
        self.healed: float | None = None
        self.native: dict[str, NativeCounts] = {}  # each node's, as finish() read them

    def event(self, what: str) -> float:
        """Note a fault (or its end) for the timeline; its time."""
        at = time.monotonic()
        self.events.append((at, what))
        return at

    def start(self, name: str, **kwargs: Any) -> ServerProcess:
        """Start the node of host ``name`` (``start_server``'s ``env``, ``state_dir``)."""
        host = self.network[name]
        node = start_server(
            *node_flags(host, self.ensemble, self.zk_path), wrapper=host.command(),
            timeout_s=60, **kwargs,
        )  # fmt: skip
        self.nodes[name] = node
        self.started.append((name, node))
        self.event(f"{name} started (pid {node.process.pid})")
        return node

    def start_all(self) -> None:
        # One after the other: a node checks the peers registered before it, and a peer
        # registers before it listens.
        for name in NODES:
            self.start(name)

    def record(self, name: str, *, claim: bool) -> None:
        """Start the load of the scenario ``name`` (``/sasl+tls`` added when the ensemble
        is secured so), and wait until every node serves."""
        secured = self.ensemble.security != "plain"
        self.name = f"{name}/{self.ensemble.security}" if secured else name
        self.recorder = Recorder(
            self.network[CLIENT], self.directory / "load", [self.network[n] for n in NODES],
            self.ensemble, self.zk_path, claim=claim,
        )  # fmt: skip
        self.wait_serving(time.monotonic(), "every node serves before the fault")

    def wait(
        self, condition: Callable[[Recording], object], what: str, timeout_s: float = 30.0
    ) -> None:
        assert self.recorder is not None
        self.recorder.wait(condition, what, timeout_s)

    def wait_serving(self, since: float, what: str, timeout_s: float = 30.0) -> None:
        self.wait(
            lambda r: all(len(r.successes(n, since)) >= BASELINE for n in NODES),
            f"{what}: {BASELINE} ids from each node asked for after {since:.3f}",
            timeout_s,
        )

    def ended(self, what: str) -> float:
        """The fault ends now (recovery is counted from here): its time."""
        self.healed = self.event(what)
        return self.healed

    def heal(self) -> float:
        """End the partitions."""
        self.network.heal()
        return self.ended("partitions healed")

    def native_counts(self, name: str) -> NativeCounts:
        """Node ``name``'s native serving now, read from its /metrics (from the clients'
        namespace, as the recorder reaches it)."""
        url = f"http://{self.network[name].address}:{ADMIN_PORT}/metrics"
        scraped = subprocess.run(
            self.network[CLIENT].command(sys.executable, "-c", _SCRAPE, url),
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return NativeCounts.parse(scraped.stdout)

    def finish(self, *, gate_closed: Sequence[str] = (), **extra: str) -> Recording:
        """Stop the load, print the scenario's ``NEMESIS`` line, and check the record, and
        (with the native core) that native threads answered get_id on every node and handed
        calls to Python at the closed session gate of each node in ``gate_closed``."""
        assert self.recorder is not None and self.healed is not None
        recording = self.recorder.stop()
        self.recorder = None
        self.native = {name: self.native_counts(name) for name in NODES}
        extra = {**extra, **{f"native[{n}]": c.line() for n, c in self.native.items()}}
        summary, problems = self._judge(recording, extra)
        if NATIVE:
            problems += [
                f"{n} served ids but native threads answered none: {c}"
                for n, c in self.native.items()
                if not (c.threads > 0 and c.calls > 0)
            ]
            problems += [
                f"{n}'s gate closed but native handed no call to Python for it: {self.native[n]}"
                for n in gate_closed
                if not self.native[n].handoffs.get("gate")
            ]
        print(summary.line())
        assert not problems, "\n".join(
            [summary.line(), *problems, "timeline:", *timeline(recording, self.events),
             *self.logs()]
        )  # fmt: skip
        return recording

    def _judge(self, recording: Recording, extra: dict[str, str]) -> tuple[Summary, list[str]]:
        names = {f"{self.network[n].address}:{THRIFT_PORT}": n for n in NODES}
        doubles = duplicates(recording.calls)
        readiness = readiness_violations(recording.calls, recording.samples)
        margins = margin_before_lease(recording, names)
        recovered = None if self.healed is None else first_success_after(
            recording, NODES, self.healed
        )  # fmt: skip
        summary = Summary(
            self.name,
            ids=sum(c.id is not None for c in recording.calls),
            duplicates=sum(len(got) - 1 for got in doubles.values()),
            errors=Counter(f"{c.node}:{c.err}" for c in recording.failures()),
            recovery_s=recovered,
            outages={n: longest_outage(recording.calls, n) for n in NODES},
            extra={
                **extra,
                **{f"margin[{k}]": f"{v:.2f}s" for k, v in margins.items()},
                "failure_runs_witnessed": f"{readiness.witnessed}/{readiness.runs}",
            },
        )
        problems = [
            *(f"id {i} twice: {got}" for i, got in list(doubles.items())[:10]),
            *order_violations(recording.calls),
            *readiness.violations,
            *lease_violations(recording, names),
        ]
        return summary, problems

    def logs(self) -> list[str]:
        return [
            f"--- {name} (pid {node.process.pid}):\n{node.log()}" for name, node in self.started
        ]

    def close(self) -> None:
        """Stop everything the scenario started and leave the ensemble whole."""
        try:
            self.network.heal()
            if self.recorder is not None:  # the test failed before finish(): say what was seen
                recording = self.recorder.stop()
                self.recorder = None
                summary, problems = self._judge(recording, {"unfinished": "yes"})
                print("\n".join([summary.line(), *problems]))
        finally:
            for _, node in self.started:
                if not node.stderr.closed:
                    node.process.send_signal(signal.SIGCONT)  # in case it was left stopped
                    node.stop()
            self.ensemble.restore()  # the next scenario starts from a whole ensemble


@dataclass
class Summary:
    """What a scenario's closing line says."""

    scenario: str
    ids: int
    duplicates: int
    errors: Counter[str]
    recovery_s: float | None  # None: the scenario did not get to its end
    outages: dict[str, float]
    extra: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        errors = ",".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        outages = ",".join(f"{n}={s:.2f}s" for n, s in sorted(self.outages.items()))
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        recovered = "never" if self.recovery_s is None else f"{self.recovery_s:.2f}s"
        return (
            f"NEMESIS {self.scenario}: ids={self.ids} duplicates={self.duplicates} "
            f"errors={sum(self.errors.values())} ({errors}) "
            f"recovered_in={recovered} longest_outage=[{outages}]{extra}"
        )


def first_success_after(recording: Recording, nodes: Iterable[str], since: float) -> float | None:
    """Seconds from ``since`` until every one of ``nodes`` had handed out an id asked
    for after it (None if one never did)."""
    firsts = [recording.successes(node, since)[:1] for node in nodes]
    if not all(firsts):
        return None
    return max(first[0].t1 for first in firsts) - since


def timeline(recording: Recording, events: Iterable[tuple[float, str]]) -> list[str]:
    """The record as changes (a node's get_id outcome or /readyz answer changing kind,
    the registrations, claims) with the scenario's events, in time order."""
    lines: list[tuple[float, str]] = [(t, f"** {what}") for t, what in events]
    last: dict[tuple[str, str], str] = {}

    def change(t: float, node: str, what: str, state: str) -> None:
        kind = re.sub(r"\d+", "N", state)  # the same failure, whatever its numbers
        if last.get((node, what)) != kind:
            last[node, what] = kind
            lines.append((t, f"{node} {what}: {state}"))

    for call in recording.calls:
        change(call.t0, call.node, "get_id", "ok" if call.id is not None else
               f"{call.err}: {call.msg[:160]}")  # fmt: skip
    for sample in recording.samples:
        change(sample.t0, sample.node, "/readyz", f"{sample.status} {sample.reason[:160]}")
    held = None
    for snapshot in recording.registrations:
        now = ", ".join(f"{w}={n['data']}" for w, n in sorted(snapshot.nodes.items()))
        if now != held:
            held = now
            lines.append((snapshot.t, f"registrations: {now}"))
    lines += [(c.t0, f"recorder leases worker {c.worker}: {c}") for c in recording.claims]
    lines.sort()
    start = lines[0][0] if lines else 0.0
    return [f"{t - start:8.3f} {text}" for t, text in lines]
