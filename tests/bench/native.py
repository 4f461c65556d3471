"""Building and running the benchmark's compiled programs, for the tests of tests/bench.

Each build goes through the Makefile's own targets, into a folder of the test session's
(``BENCH_BUILD``, and ``CLIENTS`` for the stubs), so the work tree is left alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def require(tool: str, package: str) -> None:
    assert shutil.which(tool), f"`{tool}` is missing: `make test` installs it (Debian {package})"


def make(target: str, *variables: str) -> str:
    """``make -s TARGET VAR=...`` in the repository; its output (compiler warnings)."""
    done = subprocess.run(
        ["make", "-s", "-C", str(REPO), target, *variables],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"make {target} failed:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@dataclass(frozen=True)
class Outcome:
    """One run of the load generator: exit code, its JSON (None if none), stderr."""

    code: int
    report: dict[str, Any] | None
    stderr: str

    @property
    def errors(self) -> list[str]:
        assert self.report is not None, self.stderr
        shown: list[str] = self.report["first_errors"]
        return shown


def loadgen(binary: Path, port: int, *args: str, timeout_s: float = 60.0) -> Outcome:
    """Run the load generator on 127.0.0.1:``port`` (short runs unless told otherwise)."""
    defaults = ["--warmup", "0.1", "--duration", "0.5"]
    done = subprocess.run(
        [str(binary), "--port", str(port), *defaults, *args],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    report = json.loads(done.stdout) if done.stdout.strip() else None
    return Outcome(done.returncode, report, done.stderr)


def assert_clean(outcome: Outcome, connections: int, count: int = 1) -> dict[str, Any]:
    """A run without errors whose figures add up; its report."""
    report = outcome.report
    assert outcome.code == 0 and report is not None, (outcome.code, outcome.stderr, report)
    assert report["errors"] == 0 and report["first_errors"] == [], report["first_errors"]
    assert report["connections"] == connections and report["count"] == count
    assert report["calls"] > 0 and report["ids"] == report["calls"] * count
    # Every id of the run (warm-up too) went through the uniqueness check.
    assert report["ids_checked_unique"] == (report["calls"] + report["warmup_calls"]) * count
    assert report["ids_unchecked"] == 0
    assert 0 < report["p50_us"] <= report["p99_us"] <= report["p999_us"] <= report["max_us"]
    assert report["histogram"]["count"] == report["calls"]
    assert report["client_cpu_us_per_call"] > 0
    assert report["calls_per_s"] == pytest.approx(report["calls"] / report["seconds"], abs=0.1)
    return report
