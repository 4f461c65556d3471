"""The servers the benchmark measures, each in a session of its own on 127.0.0.1.

- ``start_ours``: ``snowflake-server`` of the working tree (``python -m snowflake_server``);
- ``start_baseline``: the same command on the server of an earlier commit, extracted by
  ``extract_baseline`` (the before of a before/after; its code is never copied here);
- ``start_java_anchor`` and ``start_go_anchor``: Apache Thrift's ``TThreadPoolServer``
  and ``TSimpleServer`` serving Twitter's IdWorker (``bench/anchors/``), built by
  ``make bench-build`` into ``bench/build/``;
- ``start_native_floor``: the floor, ``bench/native/floor.c`` built into ``bench/build/``:
  a C epoll server answering the fast path's ``get_id`` and nothing else, no Python;
- ``start_floor``: the bare thriftpy2 server of ``floor_server.py``, which returns a
  constant id (the tests use it to prove that the load generator's checks bite).

Each prints a ready line with ``thrift=HOST:PORT``; :func:`launch` reads it from the
process's stdout (no polling) and copies everything the process writes to files in a
log folder. :meth:`Server.cpu_seconds` sums the CPU time of the whole session,
so that a server with child processes (``--processes 2``) is measured whole.
"""

from __future__ import annotations

import contextlib
import io
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from snowflake_server._app.ready import READY_PREFIX, parse_ready_line

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bench" / "build"
FLOOR_SCRIPT = ROOT / "bench" / "floor_server.py"
FLOOR_READY = "floor-server ready"
ANCHOR_READY = "anchor ready"
NATIVE_FLOOR_READY = "native-floor ready"
BASELINE_REV = "300eb03"
"""The last commit of the pure-Python event-loop server before issue 27's native path: the
before that ours-pure must not fall behind. (``ec6aa28`` is the last thread-per-connection
server, issue 11's before.)"""
JAVA_LIBS = ("/usr/share/java/thrift.jar", "/usr/share/java/slf4j-nop.jar")
HOST_LOCK_SCOPE = f"bench-{os.getpid()}"
"""The host-wide worker locks of this process's servers: never those of a server that
runs beside the benchmark (a developer's, a test's) with the same worker id."""
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ServerFailed(RuntimeError):
    """A server could not be built, extracted or started; the message says why."""


@dataclass
class Server:
    """A running server process, the leader of its own session."""

    name: str
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_dir: Path

    @property
    def stderr(self) -> Path:
        return self.log_dir / f"{self.name}.err"

    def log_tail(self, lines: int = 20) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def group(self) -> list[int]:
        """The pids of the server's session: it and its children. By session, not process
        group: the supervisor of ``--processes 2`` puts each child in a process group of
        its own (so that a terminal's Ctrl-C reaches the supervisor alone)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                fields = _stat_fields(entry.name)
                if fields and int(fields[3]) == self.process.pid:  # the session id
                    pids.append(int(entry.name))
        return pids

    def cpu_seconds(self) -> float:
        """User + system CPU time of every live process of the group, all threads."""
        total = 0
        for pid in self.group():
            fields = _stat_fields(str(pid))
            if fields:
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / _CLOCK_TICKS

    def open_files(self) -> int:
        """File descriptors open in the group: its connections, and a few more."""
        count = 0
        for pid in self.group():
            with contextlib.suppress(OSError):  # a process that just ended
                count += len(os.listdir(f"/proc/{pid}/fd"))
        return count

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it lingers; the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        # Whatever is left of the session (children of a multi-process server) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in self.group():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
        return self.process.returncode


def _stat_fields(pid: str) -> list[str] | None:
    """/proc/PID/stat after the command name (field 3, the state, comes first)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not ours to read
        return None
    return text.rsplit(")", 1)[1].split()


def _clean_env() -> dict[str, str]:
    """This environment without SNOWFLAKE_* settings (the server would read them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SNOWFLAKE_")}


def launch(
    name: str,
    command: list[str],
    ready_prefix: str,
    log_dir: Path,
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Server:
    """Start ``command`` and wait for ``ready_prefix ... thrift=HOST:PORT`` on its stdout.

    ``env``: its whole environment (default: this one without SNOWFLAKE_* settings).
    stdout goes on to ``log_dir/NAME.out`` (a thread copies it), stderr to ``NAME.err``.
    Raises :class:`ServerFailed` with the log's tail if the line does not come in time.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / f"{name}.err").open("wb") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, cwd=cwd, env=env or _clean_env(),
            start_new_session=True,
        )  # fmt: skip
    assert process.stdout is not None
    server = Server(name, process, "127.0.0.1", 0, log_dir)
    out = (log_dir / f"{name}.out").open("wb")
    line = _read_ready_line(process.stdout, out, ready_prefix, timeout_s)
    if line is None:
        out.close()
        server.stop()
        process.stdout.close()
        raise ServerFailed(
            f"{name} did not print its ready line within {timeout_s:g} s "
            f"(exit code {process.returncode}); {' '.join(command)}\n{server.log_tail()}"
        )
    fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
    host, port = fields["thrift"].rsplit(":", 1)
    server.host, server.port = host, int(port)
    # The rest of stdout is copied on, so that a chatty server never blocks on a pipe.
    threading.Thread(target=_copy_rest, args=(process.stdout, out), daemon=True).start()
    return server


def _read_ready_line(
    stdout: IO[bytes], out: IO[bytes], prefix: str, timeout_s: float
) -> str | None:
    """The first line starting with ``prefix``; None at EOF or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                return None
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                return None
            out.write(chunk)
            out.flush()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if line.startswith(prefix):
                    return line


def _copy_rest(stdout: IO[bytes], out: IO[bytes]) -> None:
    with out, stdout:
        shutil.copyfileobj(stdout, out)


def _snowflake_command(state_dir: Path, args: tuple[str, ...]) -> list[str]:
    state_dir.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable, "-m", "snowflake_server", "--host", "127.0.0.1", "--port", "0",
        "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--state-dir", str(state_dir),
        "--log-level", "warning", "--first-start-wait", "0",
        "--host-lock-scope", HOST_LOCK_SCOPE, *args,
    ]  # fmt: skip


def start_ours(
    name: str, log_dir: Path, state_dir: Path, *args: str, cpu: int | None = None
) -> Server:
    """``snowflake-server`` of the working tree on free loopback ports, with a fresh state
    folder, no first-start wait and this process's host lock scope; ``args`` come last
    and so win. Started on CPU ``cpu`` alone, if given (``taskset``): what it sizes by the
    CPUs it may use (``--native-threads auto``) it sizes for that one."""
    command = _snowflake_command(state_dir, args)
    if cpu is not None:
        command = ["taskset", "--cpu-list", str(cpu), *command]
    return launch(name, command, READY_PREFIX, log_dir)


def metrics_address(server: Server) -> tuple[str, int]:
    """The admin endpoint of a snowflake server, from the ready line in its stdout log."""
    out = (server.log_dir / f"{server.name}.out").read_text(errors="replace")
    for line in out.splitlines():
        ready = parse_ready_line(line)
        if ready is not None:
            return ready.metrics
    raise ServerFailed(f"no {READY_PREFIX!r} line in {server.name}'s output")


Sample = tuple[str, dict[str, str], float]
"""A Prometheus sample: its name (``snowflake_native_calls_total``), labels and value."""


def scrape(server: Server, timeout_s: float = 10.0) -> list[Sample]:
    """Every sample of the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    host, port = metrics_address(server)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as answer:
        text = answer.read().decode()
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (over every
    process of a multi-process server, each labelled with its own)."""
    return sum(
        value
        for sample, have, value in samples
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


def extract_baseline(rev: str, dest: Path) -> Path:
    """``git archive REV snowflake_server`` unpacked into ``dest``; returns ``dest``.

    The extracted package runs in this virtualenv, with the client distribution of the
    working tree (unchanged by the event-loop rewrite). Checks that Python imports the
    extracted package there, not the working tree's.
    """
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "snowflake_server"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise ServerFailed(
            f"git archive {rev} snowflake_server failed: {done.stderr.decode().strip()} "
            "(--baseline-rev names the commit of the server to compare with)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(dest, filter="data")
        else:  # Python before 3.11.4 (Debian 12 has 3.11.2): this repository's own archive
            archive.extractall(dest)
    dest = dest.resolve()  # compared with the path Python reports
    probe = subprocess.run(
        [sys.executable, "-c", "import snowflake_server; print(snowflake_server.__file__)"],
        capture_output=True, text=True, cwd=dest, env=_baseline_env(dest), timeout=60,
        check=False,
    )  # fmt: skip
    where = probe.stdout.strip()
    if probe.returncode != 0 or not Path(where).is_relative_to(dest):
        raise ServerFailed(
            f"the server of {rev} does not import from {dest}: {where or probe.stderr}"
        )
    return dest


def _baseline_env(source: Path) -> dict[str, str]:
    """The extracted package first on the path. Coverage is off: under ``make test`` it
    would measure this copy of snowflake_server, in a folder gone by the report."""
    env = {k: v for k, v in _clean_env().items() if not k.startswith("COVERAGE_")}
    return env | {"PYTHONPATH": str(source)}


def start_baseline(name: str, log_dir: Path, state_dir: Path, source: Path, *args: str) -> Server:
    """The server extracted into ``source``, with the flags of :func:`start_ours`. It runs
    in ``source`` so that Python finds it there before the working tree's package."""
    command = _snowflake_command(state_dir, args)
    return launch(name, command, READY_PREFIX, log_dir, cwd=source, env=_baseline_env(source))


def _built(path: Path) -> Path:
    if not path.exists():
        raise ServerFailed(f"{path} is missing: build it with `make bench-build`")
    return path


def start_java_anchor(name: str, log_dir: Path, build: Path, worker_id: int) -> Server:
    """The Java anchor (``TThreadPoolServer``) built into ``build/java``."""
    classes = _built(build / "java" / "SnowflakeAnchor.class").parent
    classpath = ":".join([str(classes), *JAVA_LIBS])
    command = ["java", "-cp", classpath, "SnowflakeAnchor", "--worker-id", str(worker_id)]
    return launch(name, command, ANCHOR_READY, log_dir)


def start_go_anchor(name: str, log_dir: Path, build: Path, worker_id: int) -> Server:
    """The Go anchor (``TSimpleServer``) built into ``build/anchor-go``."""
    command = [str(_built(build / "anchor-go")), "--worker-id", str(worker_id)]
    return launch(name, command, ANCHOR_READY, log_dir)


def start_native_floor(
    name: str, log_dir: Path, build: Path, worker_id: int, *args: str, cpu: int | None = None
) -> Server:
    """The floor (``bench/native/floor.c``) built into ``build/floor``, on a free port of
    127.0.0.1, with a thread per CPU it may run on unless ``args`` say otherwise
    (``--threads N``); started on CPU ``cpu`` alone (so with one thread), if given."""
    command = [str(_built(build / "floor")), "--worker-id", str(worker_id), *args]
    if cpu is not None:
        command = ["taskset", "--cpu-list", str(cpu), *command]
    return launch(name, command, NATIVE_FLOOR_READY, log_dir)


def start_floor(name: str, log_dir: Path, transport: str = "framed") -> Server:
    """The bare thriftpy2 server of ``floor_server.py`` on a free port."""
    command = [sys.executable, str(FLOOR_SCRIPT), "--port", "0", "--transport", transport]
    return launch(name, command, FLOOR_READY, log_dir)
