"""deploy/systemd/snowflake-server.service: valid for this machine's systemd, hardened,
and true to the server (its options, exit codes, drain and signals).

``systemd-analyze verify`` checks that ExecStart is executable, so it reads a copy whose
ExecStart is this checkout's ``.venv/bin/snowflake-server``; nothing is installed or
started through systemd.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from snowflake_server import ServerSettings
from snowflake_server._config.options import OPTIONS

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "snowflake-server.service"
# The Kubernetes kit's pods: the same drain and the same stop budget as this unit's.
STATEFULSET = REPO / "deploy" / "kubernetes" / "base" / "statefulset.yaml"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
INSTALLED = "/opt/snowflake/bin/snowflake-server"
CHECKOUT = Path(sys.executable).parent / "snowflake-server"
# systemd-analyze security rates 0.0 (locked down) to 10.0 (fully exposed); up to 2 is
# its "OK". What remains is what a network server needs: the host's network, no IP
# allow-list (the operator's), /proc/stat (the process metrics), the RTC read-only.
MAX_EXPOSURE = 2.0
# After the drain the server still stops: calls in flight (1.5 s), final marks to disk
# and ZooKeeper, deregistration. TimeoutStopSec must leave this much after the drain.
STOP_MARGIN_S = 10


def _directives() -> list[tuple[str, str, str]]:
    """(section, key, value) of each line of the unit, in order; keys may repeat."""
    section, out = "", []
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def _one(key: str) -> str:
    (value,) = [v for _, k, v in _directives() if k == key]
    return value


def _environment() -> dict[str, str]:
    return dict(v.split("=", 1) for _, k, v in _directives() if k == "Environment")


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing (Debian package systemd; `make system-deps`)"
    return tool


@pytest.fixture
def checkout_unit(tmp_path: Path) -> Path:
    """The unit under its own name in ``tmp_path``, ExecStart this checkout's server."""
    assert CHECKOUT.is_file(), CHECKOUT
    text = UNIT.read_text()
    assert f"\nExecStart={INSTALLED}\n" in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(f"\nExecStart={INSTALLED}\n", f"\nExecStart={CHECKOUT}\n"))
    return copy


def test_systemd_analyze_verify(checkout_unit: Path) -> None:
    """No error and no warning about the unit (an unknown key or a bad value is only a
    warning to systemd: it ignores the line, which here would drop a protection)."""
    done = subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", str(checkout_unit)],
        capture_output=True, text=True, timeout=60, check=False, cwd=checkout_unit.parent,
    )  # fmt: skip
    output = done.stdout + done.stderr
    about_unit = [line for line in output.splitlines() if UNIT.name in line]
    assert done.returncode == 0 and not about_unit, output


def test_systemd_analyze_security(checkout_unit: Path) -> None:
    done = subprocess.run(
        [_systemd_analyze(), "security", "--offline=yes", "--no-pager",
         f"--threshold={round(MAX_EXPOSURE * 10)}", str(checkout_unit)],
        capture_output=True, text=True, timeout=60, check=False, cwd=checkout_unit.parent,
    )  # fmt: skip
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert level, done.stdout + done.stderr
    assert float(level[1]) <= MAX_EXPOSURE, done.stdout
    assert done.returncode == 0, done.stdout + done.stderr


def test_start_stop_and_readiness_protocol() -> None:
    assert _one("Type") == "notify"  # the server sends READY=1 and STOPPING=1
    assert _one("NotifyAccess") == "main"
    assert _one("ExecStart") == INSTALLED
    # The image installs the server at the same place.
    assert f'ENTRYPOINT ["{INSTALLED}"]' in DOCKERFILE.read_text()
    assert _one("KillSignal") == "SIGTERM"
    assert _one("KillMode") == "mixed"
    assert _one("ExecReload") == "/bin/kill -HUP $MAINPID"
    drain = float(_environment()["SNOWFLAKE_DRAIN_SECONDS"])
    assert float(_one("TimeoutStopSec")) >= drain + STOP_MARGIN_S


def test_the_same_drain_and_stop_budget_as_the_kubernetes_pods() -> None:
    """One stop budget everywhere the server is deployed (deploy/README.md says it once):
    the drain the unit sets is the pods', and TimeoutStopSec is their grace period. The
    server's own default (0: no drain) is for a developer's `make run`."""
    drain = _environment()["SNOWFLAKE_DRAIN_SECONDS"]
    assert float(drain) > ServerSettings().drain_seconds == 0
    pod = yaml.safe_load(STATEFULSET.read_text())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pod_env = {e["name"]: e.get("value") for e in container["env"]}
    assert pod_env["SNOWFLAKE_DRAIN_SECONDS"] == drain
    assert int(_one("TimeoutStopSec")) == pod["terminationGracePeriodSeconds"]


def test_settings_are_options_the_server_reads() -> None:
    known = {option.env for option in OPTIONS}
    env = _environment()
    assert set(env) <= known, f"no option reads {sorted(set(env) - known)}"
    # The state directory is the one systemd makes, owns and keeps for the service.
    assert env["SNOWFLAKE_STATE_DIR"] == "%S/" + _one("StateDirectory")
    assert _one("EnvironmentFile") == "-/etc/snowflake/snowflake.env"
    directives = _directives()
    position = {k: i for i, (_, k, _) in enumerate(directives)}
    assert position["EnvironmentFile"] > position["Environment"], "the file overrides"


def test_limits_and_hardening() -> None:
    assert int(_one("LimitNOFILE")) >= 10 * ServerSettings().max_connections
    assert _one("CapabilityBoundingSet") == ""
    # AF_UNIX: $NOTIFY_SOCKET and the host-wide worker lock (an abstract Unix socket).
    assert _one("RestrictAddressFamilies").split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    filters = [v for _, k, v in _directives() if k == "SystemCallFilter"]
    assert filters[0] == "@system-service"
    # The server raises its own file limit with setrlimit (@resources): keep it allowed.
    assert not any("@resources" in f for f in filters)
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "ProtectClock"):  # fmt: skip
        assert _one(key) == "yes", key
    assert _one("ProtectSystem") == "strict"
    assert _one("User") == "snowflake"


def _run_server(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNOWFLAKE_")}
    return subprocess.run(
        [str(CHECKOUT), "--port", "0", "--metrics-port", "0", "--first-start-wait", "0",
         "--host-lock-scope", f"test-{uuid.uuid4().hex[:12]}", *args],
        capture_output=True, text=True, timeout=30, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip


def test_no_restart_on_the_exit_codes_of_refusals(tmp_path: Path) -> None:
    """The codes the unit does not restart on are the ones the server exits with for a
    bad setting and for a refusal to start (here: a corrupt state file)."""
    assert _one("Restart") == "on-failure"
    prevented = {int(code) for code in _one("RestartPreventExitStatus").split()}
    bad_setting = _run_server("--worker-id", "99", tmp_path=tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    (state / "worker-0-0.json").write_text("{not json")
    refusal = _run_server("--state-dir", str(state), tmp_path=tmp_path)
    assert "error:" in bad_setting.stderr, bad_setting.stderr
    assert "refusing to start" in refusal.stderr, refusal.stderr
    assert prevented == {bad_setting.returncode, refusal.returncode} == {2, 3}
