"""Server processes for the benchmark: ``snowflake-server`` and the bare floor server.

Each runs in its own process group on free loopback ports; its stdout and stderr go
to files in a log folder, and the ready line is read from the stdout file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from snowflake_server._app.ready import READY_PREFIX

ROOT = Path(__file__).resolve().parent.parent
FLOOR_SCRIPT = ROOT / "bench" / "floor_server.py"
FLOOR_READY = "floor-server ready"


class ServerFailed(RuntimeError):
    """A server did not start; the message ends with its log."""


@dataclass
class Server:
    """A running server process (and its process group)."""

    name: str
    process: subprocess.Popen[bytes]
    host: str
    port: int
    stdout: Path
    stderr: Path

    def log_tail(self, lines: int = 20) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL to the whole group if it lingers; the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        # Whatever is left of the group (children of a multi-process server) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
        return self.process.returncode


def _clean_env() -> dict[str, str]:
    """This environment without SNOWFLAKE_* settings (the server would read them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SNOWFLAKE_")}


def launch(
    name: str, command: list[str], ready_prefix: str, log_dir: Path, timeout_s: float = 30.0
) -> Server:
    """Start ``command`` and wait for ``ready_prefix ... thrift=HOST:PORT`` on its stdout."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        process = subprocess.Popen(
            command, stdout=out, stderr=err, env=_clean_env(), cwd=ROOT, start_new_session=True
        )
    server = Server(name, process, "127.0.0.1", 0, out_path, err_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in out_path.read_text(errors="replace").splitlines():
            if line.startswith(ready_prefix):
                fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
                host, port = fields["thrift"].rsplit(":", 1)
                server.host, server.port = host, int(port)
                return server
        if process.poll() is not None:
            break
        time.sleep(0.05)
    server.stop()
    raise ServerFailed(
        f"{name} did not print its ready line within {timeout_s:g} s "
        f"(exit code {process.returncode}):\n{server.log_tail()}"
    )


def start_ours(name: str, log_dir: Path, state_dir: Path, *args: str) -> Server:
    """``snowflake-server`` on free ports, with a fresh state folder."""
    state_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "snowflake_server", "--host", "127.0.0.1", "--port", "0",
        "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--state-dir", str(state_dir),
        "--log-level", "warning", "--first-start-wait", "0", *args,
    ]  # fmt: skip
    return launch(name, command, READY_PREFIX, log_dir)


def start_floor(name: str, log_dir: Path, transport: str = "framed") -> Server:
    """The bare thriftpy2 server of ``floor_server.py`` on a free port."""
    command = [sys.executable, str(FLOOR_SCRIPT), "--port", "0", "--transport", transport]
    return launch(name, command, FLOOR_READY, log_dir)
