"""The generated parts of the docs: the options tables and the metrics table.

    .venv/bin/python -m tests.docs.render    # rewrites docs/configuration.md, docs/metrics.md

Each sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; the prose
around it is left alone. ``tests/docs/test_docs.py`` renders the same tables
from the code and fails when the docs differ.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from snowflake_server import ServerSettings
from snowflake_server._app.supervisor import Supervisor
from snowflake_server._cluster.gate import SessionGate
from snowflake_server._cluster.membership import Cluster
from snowflake_server._cluster.slot import CurrentReservation, WorkerSlot
from snowflake_server._config.options import GROUPS, OPTIONS, Option
from snowflake_server._ids.clocks import wall_clock_ms
from snowflake_server._observability.audit import AuditLog
from snowflake_server._state.reservation import MarkStore
from snowflake_server._state.worker import Worker
from tests.support.inprocess import InProcessServer

ROOT = Path(__file__).parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
METRICS = ROOT / "docs" / "metrics.md"


# -- sections ---------------------------------------------------------------------------


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def section(text: str, name: str) -> str:
    """What ``text`` holds between the markers of ``name``."""
    start, end = markers(name)
    _, found, rest = text.partition(start)
    body, closed, _ = rest.partition(end)
    if not found or not closed:
        raise ValueError(f"no {start} ... {end} section")
    return body


def replace_section(text: str, name: str, body: str) -> str:
    start, end = markers(name)
    old = section(text, name)
    return text.replace(start + old + end, start + body + end, 1)


def _cell(text: str) -> str:
    # argparse help escapes '%'; in Markdown a bare '|' ends the cell, '__' makes bold.
    return text.replace("%%", "%").replace("|", "\\|").replace("__", "\\_\\_")


# -- options ----------------------------------------------------------------------------


def default_text(option: Option) -> str:
    value = getattr(ServerSettings(), option.name)
    if isinstance(value, bool):
        return "off"
    if value == "":
        return "empty"
    if value is None:
        return "derived (see meaning)"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def options_section() -> str:
    """One table per ``--help`` group: flag, environment variable, default, help."""
    by_name = {option.name: option for option in OPTIONS}
    parts = []
    for title, names in GROUPS:
        rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
        for name in names:
            option = by_name[name]
            flag = f"{option.flag} {option.metavar}".strip()
            env = f"`{option.env}`" + (" (true/false)" if option.is_switch else "")
            rows.append(f"| `{flag}` | {env} | {default_text(option)} | {_cell(option.help)} |")
        parts.append(f"### {title}\n\n" + "\n".join(rows) + "\n")
    return "\n\n" + "\n".join(parts) + "\n"


# -- metrics ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family as Prometheus stores it."""

    name: str  # as queried: counters end in _total
    type: str
    labels: tuple[str, ...]
    when: str
    help: str


def _parse(text: str, when: str) -> list[Family]:
    families = []
    for family in text_string_to_metric_families(text):
        labels = sorted({key for s in family.samples for key in s.labels if key != "le"})
        name = family.name + ("_total" if family.type == "counter" else "")
        families.append(Family(name, family.type, tuple(labels), when, family.documentation))
    return families


def _collected(*collectors: Collector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


def _no_worker(
    worker_id: int,
    remote: tuple[MarkStore, int],
    waited: float | None,
    *,
    before_first_write: Callable[[], None] | None = None,
) -> Worker:
    raise AssertionError("collecting metrics never opens a worker")


WHEN = {
    "snowflake_clock_synchronized": "where `adjtimex` answers (Linux)",
    "snowflake_zookeeper_free_worker_ids": "cluster mode, without `--skip-sanity-checks`",
}
"""Families whose presence depends on the host rather than on the options."""


def metric_families(workdir: Path) -> list[Family]:
    """Every family a server exposes: a real standalone server with an audit log, and
    the collectors cluster mode adds (collected without a ZooKeeper)."""
    audit_path = workdir / "audit.log"
    with InProcessServer(ServerSettings(audit_log=str(audit_path)), workdir / "state") as server:
        server.raw_client().get_id("docs")  # so the agent label shows
        served = server.metrics()
    audit = AuditLog(str(workdir / "audit-only.log"))
    try:
        audit_names = {f.name for f in _parse(_collected(audit), "")}
    finally:
        audit.close()
    standalone = [
        Family(f.name, f.type, f.labels, "with `--audit-log`", f.help)
        if f.name in audit_names
        else Family(f.name, f.type, f.labels, WHEN.get(f.name, f.when), f.help)
        for f in _parse(served, "always")
    ]
    settings = ServerSettings()
    slot = WorkerSlot(settings.ids, SessionGate())
    cluster = Cluster(settings.cluster, slot, wall_clock_ms, "127.0.0.1:1", open_worker=_no_worker)
    cluster.saw_registrations([])  # as the peer checks at start-up do
    seen = {f.name for f in standalone}
    clustered = [
        Family(f.name, f.type, f.labels, WHEN.get(f.name, f.when), f.help)
        for f in _parse(_collected(cluster, CurrentReservation(slot)), "cluster mode")
    ]
    supervised = _parse(_collected(Supervisor(ServerSettings(processes=2))), "with `--processes`")
    return standalone + [f for f in clustered if f.name not in seen] + supervised


def metrics_section(families: list[Family]) -> str:
    rows = ["| metric | type | labels | when | meaning |", "|---|---|---|---|---|"]
    for f in families:
        labels = ", ".join(f"`{label}`" for label in f.labels) or "none"
        rows.append(f"| `{f.name}` | {f.type} | {labels} | {f.when} | {_cell(f.help)} |")
    return "\n\n" + "\n".join(rows) + "\n\n"


# -- rewriting --------------------------------------------------------------------------


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        families = metric_families(Path(tmp))
    for path, name, body in (
        (CONFIGURATION, "options", options_section()),
        (METRICS, "metrics", metrics_section(families)),
    ):
        text = path.read_text(encoding="utf-8")
        new = replace_section(text, name, body)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote the {name} section of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
