"""The nemesis's clients, in a process of their own: get_id on every node, /readyz of
every node, and the worker ids' registrations in ZooKeeper, every outcome written as
a JSON line with the monotonic time before and after it (the clock every process of
the machine shares), for the test to check afterwards.

    python nemesis_load.py CONFIG.json

The test runs it inside the clients' network namespace. It stops when its standard
input closes (the test ends it, or the test died) or at the config's deadline, so it
never outlives a run. Standalone (no import from ``tests``): it runs as a script.

With ``claim`` set, a registration that vanishes from ``<zk_path>/nodes/<dc>`` is taken
at once by this process's own ZooKeeper session, as another node leasing that worker
id would: from then on, ids of that worker id from the node that held it are
duplicates in waiting, which the test looks for. Against a secured ensemble
(``zk_auth`` sasl, ``zk_tls``: kazoo's TLS arguments) it logs in as the service, as a
node would, and gives its claims the service's ACL.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.security import make_acl
from snowflake_thrift_client._transports import open_client
from snowflake_thrift_client._zkauth import kazoo_auth, load_credentials
from thriftpy2.protocol.exc import TProtocolException
from thriftpy2.thrift import TException
from thriftpy2.transport import TTransportException

CLAIM = b"nemesis-claim"
NO_ANSWER = (TTransportException, TProtocolException)


class Output:
    """JSON lines, flushed one by one so that the test can follow them as they come."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a")
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def call_ids(
    node: dict[str, Any], config: dict[str, Any], out: Output, stop: threading.Event
) -> None:
    """get_id on ``node``, one call at a time, one every ``pace_s``. A call the server
    refused (a declared exception) is followed by the next on the same connection, as a
    client keeps its connection: so the native path meets a closed gate too (a new
    connection's first call is Python's). Any other failure is followed by a new
    connection."""
    pace, timeout = config["pace_s"], config["call_timeout_s"]
    client: Any = None
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            if client is None:
                client = open_client(node["host"], node["port"], "framed", timeout)
            new_id = client.get_id("nemesis")
            out.write(k="call", node=node["name"], t0=t0, t1=time.monotonic(), id=new_id)
        except Exception as e:  # noqa: BLE001 - every failure is recorded for the test
            t1 = time.monotonic()
            # A declared exception or an application error is the server's answer;
            # anything else is the network's or the client's (no answer).
            answered = isinstance(e, TException) and not isinstance(e, NO_ANSWER)
            out.write(k="call", node=node["name"], t0=t0, t1=t1, err=type(e).__name__,
                      msg=str(getattr(e, "message", "") or e)[:300], answered=answered)  # fmt: skip
            if client is not None and not answered:
                client.close()
                client = None
        stop.wait(max(0.0, t0 + pace - time.monotonic()))
    if client is not None:
        client.close()


def poll_ready(
    node: dict[str, Any], config: dict[str, Any], out: Output, stop: threading.Event
) -> None:
    """/readyz of ``node`` every ``poll_s``: its status (None: no answer) and reason."""
    url = f"http://{node['host']}:{node['metrics_port']}/readyz"
    while not stop.is_set():
        t0 = time.monotonic()
        status: int | None = None
        reason = ""
        try:
            with urllib.request.urlopen(url, timeout=config["call_timeout_s"]) as response:
                status = response.status
        except urllib.error.HTTPError as e:
            with e:
                status = e.code
                reason = str(json.loads(e.read().decode()).get("reason", ""))[:300]
        except (OSError, ValueError) as e:
            reason = f"{type(e).__name__}: {e}"[:300]
        out.write(k="ready", node=node["name"], t0=t0, t1=time.monotonic(), status=status,
                  reason=reason)  # fmt: skip
        stop.wait(max(0.0, t0 + config["poll_s"] - time.monotonic()))


class Registrations:
    """The registrations under ``<zk_path>/nodes/<dc>``: a snapshot (worker id: data and
    owning session) at each change, read at once when a watch fires."""

    def __init__(self, config: dict[str, Any], out: Output, stop: threading.Event) -> None:
        self._path = f"{config['zk_path']}/nodes/{config['datacenter']}"
        self._claim: bool = config["claim"]
        self._out = out
        self._stop = stop
        self._changed = threading.Event()
        self._client = KazooClient(
            hosts=config["zookeeper"], timeout=config["zk_session_s"], **zk_options(config)
        )
        self._client.add_listener(self._on_state)

    def _on_state(self, state: str) -> None:
        self._out.write(k="zk-state", t=time.monotonic(), state=str(state))
        if state == KazooState.CONNECTED:
            self._changed.set()  # watches may have been missed meanwhile

    def _on_change(self, _event: object) -> None:
        self._changed.set()

    def run(self) -> None:
        self._client.start(timeout=30)
        held: dict[str, dict[str, str]] = {}
        try:
            while not self._stop.is_set():
                self._changed.clear()
                asked = time.monotonic()
                try:
                    now = self._read()
                except (KazooException, KazooTimeoutError) as e:
                    self._out.write(k="zk-error", t=time.monotonic(), err=type(e).__name__)
                    self._stop.wait(0.1)
                    continue
                # Every read, changed or not: the registrations missing were gone by
                # ``seen``, and those new were made after the ``asked`` of the read before.
                seen = time.monotonic()
                self._out.write(k="znodes", t0=asked, t=seen, nodes=now)
                gone = {w: node["data"] for w, node in held.items()
                        if node["data"] != CLAIM.decode() and w not in now}  # fmt: skip
                held = now
                if self._claim:
                    for worker, holder in gone.items():
                        self._take(worker, holder, seen)
                self._changed.wait(0.5)  # and now and then, whatever the watches say
        finally:
            self._client.stop()
            self._client.close()

    def _read(self) -> dict[str, dict[str, str]]:
        nodes: dict[str, dict[str, str]] = {}
        for worker in self._client.get_children(self._path, watch=self._on_change):
            try:
                data, stat = self._client.get(f"{self._path}/{worker}")
            except NoNodeError:
                continue  # gone since the listing: the next watch says so
            nodes[worker] = {"data": data.decode(errors="replace"),
                             "owner": f"{stat.ephemeralOwner:#x}"}  # fmt: skip
        return nodes

    def _take(self, worker: str, holder: str, gone: float) -> None:
        """Lease ``worker`` as another node would, right after the registration of
        ``holder`` was seen gone (at ``gone``)."""
        t0 = time.monotonic()
        try:
            self._client.create(f"{self._path}/{worker}", CLAIM, ephemeral=True)
            ok, err = True, ""
        except (NodeExistsError, KazooException, KazooTimeoutError) as e:
            ok, err = False, type(e).__name__
        self._out.write(k="claim", worker=int(worker), holder=holder, gone=gone, t0=t0,
                        t1=time.monotonic(), ok=ok, err=err)  # fmt: skip
        self._changed.set()


def zk_options(config: dict[str, Any]) -> dict[str, Any]:
    """kazoo's arguments to reach the ensemble as the nodes do: TLS, and the service's
    SASL login and ACL (a claim open to anyone would make a node refuse to start)."""
    options = dict(config.get("zk_tls") or {})
    auth = config.get("zk_auth", "none")
    if auth != "none":
        assert auth == "sasl", auth
        credentials = load_credentials(config["zk_credentials_file"])
        options.update(kazoo_auth(auth, credentials))
        options["default_acl"] = [
            make_acl("sasl", credentials.user, all=True),
            make_acl("world", "anyone", read=True),
        ]
    return options


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Output(Path(config["out"]))
    stop = threading.Event()
    threads = [
        threading.Thread(target=work, args=(node, config, out, stop), daemon=True)
        for node in config["nodes"]
        for work in (call_ids, poll_ready)
    ]
    threads.append(threading.Thread(target=Registrations(config, out, stop).run, daemon=True))
    for thread in threads:
        thread.start()
    out.write(k="start", t=time.monotonic())

    def watch_stdin() -> None:
        sys.stdin.read()  # until the test closes it, or dies
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    stop.wait(config["deadline_s"])
    stop.set()
    for thread in threads:
        thread.join(10)
    out.write(k="end", t=time.monotonic())
    out.close()


if __name__ == "__main__":
    main()
