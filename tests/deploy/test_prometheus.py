"""The Grafana dashboard and the alert rules, against a real Prometheus scraping real servers.

The quick tests check the dashboard's form and that each panel query parses (promtool).
The slow one runs a cluster (a real ZooKeeper, a server, a server of two processes) and a
standalone server that reuses a worker id of the cluster, has a real Prometheus scrape
them every second with the alert rules loaded, and evaluates every panel query (each must
return series) and every alert expression (each must evaluate) through its HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from snowflake_thrift_client._idl import snowflake_thrift

from tests.deploy.test_alerts import ALERTS, RULES, alert_rules, run_promtool
from tests.support.endpoints import free_port
from tests.support.processes import Load, ServerProcess, start_server
from tests.support.waiting import wait_until
from tests.support.zookeeper import ZooKeeper

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "snowflake-dashboard.json"
JOB = "snowflake"
# What Grafana puts for its interval variables: ranges short enough for the few seconds
# of data scraped every second here, long enough to hold several samples.
INTERVALS = {"__rate_interval": "10s", "__interval": "5s", "__range": "1m"}
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
# Alerts that a healthy cluster must not raise (the others depend on timing and load).
QUIET_ON_A_HEALTHY_FLEET = {
    "SnowflakeClockBackwardsRefused",
    "SnowflakeClockSteppedBack",
    "SnowflakeFewFreeWorkerIds",
    "SnowflakeStateWriteErrors",
    "SnowflakeNodeNotReady",
    "SnowflakeTargetDown",
    "SnowflakeZooKeeperSessionLost",
    "SnowflakeZooKeeperNotRegistered",
}
thrift = snowflake_thrift()


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def all_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    source: str  # which panel target or alert it comes from
    expr: str


def panel_queries(board: dict[str, Any]) -> list[Query]:
    return [
        Query(f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"])
        for panel in all_panels(board)
        for target in panel.get("targets", [])
    ]


def alert_queries() -> list[Query]:
    return [Query(f"alert {rule['alert']}", rule["expr"].strip()) for rule in alert_rules()]


def regex_of(values: list[str]) -> str:
    """A multi-value variable as Grafana puts it in a PromQL regex matcher."""
    escaped = [re.escape(value).replace("\\", "\\\\") for value in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with each ``$name`` and ``${name}`` replaced; unknown variables fail."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"unknown variable ${name} in {expr}"
        return variables[name]

    return _VARIABLE.sub(value, expr)


def example_variables() -> dict[str, str]:
    return {
        **INTERVALS,
        "job": JOB,
        "instance": regex_of(["10.0.0.1:9990", "10.0.0.2:9990"]),
        "protocol": regex_of(["http", "thrift"]),
    }


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["schemaVersion"] == 39 and board["uid"] and board["title"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "protocol"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for name in ("job", "instance", "protocol"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == datasource
    panels = list(all_panels(board))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"{panel['title']!r} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == datasource and panel.get("description"), panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']!r} has no query"
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in targets:
            assert target["datasource"] == datasource and target["expr"].strip(), panel["title"]


def test_every_panel_query_parses(tmp_path: Path) -> None:
    """promtool parses each query (variables substituted) as a recording rule's expression."""
    queries = panel_queries(dashboard())
    variables = example_variables()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": substitute(query.expr, variables)}
                    for i, query in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    checked = run_promtool("check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_substitution_follows_grafana() -> None:
    variables = {**INTERVALS, "job": JOB, "instance": regex_of(["127.0.0.1:1", "127.0.0.1:2"])}
    assert substitute('up{job=~"$job",instance=~"${instance}"}[$__rate_interval]', variables) == (
        'up{job=~"snowflake",instance=~"(127\\\\.0\\\\.0\\\\.1:1|127\\\\.0\\\\.0\\\\.1:2)"}[10s]'
    )
    with pytest.raises(AssertionError, match="unknown variable"):
        substitute("up[$nope]", variables)


class Prometheus:
    """A real Prometheus on a free loopback port, its data and log in ``directory``."""

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus (Debian's package) is unpacked into .tools/ by `make test`"
        directory.mkdir(parents=True, exist_ok=True)
        config_file = directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log = directory / "prometheus.log"
        self.port = free_port()
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={directory / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def get(self, path: str, **params: str) -> Any:
        """The decoded JSON answer of ``GET path?params``; errors (4xx, 5xx) too."""
        assert self._process.poll() is None, f"prometheus exited:\n{self.log_tail()}"
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            with e:
                return json.load(e)

    def ready(self) -> bool:
        assert self._process.poll() is None, f"prometheus exited:\n{self.log_tail()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:  # not listening yet, or 503 while starting
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def instance(server: ServerProcess) -> str:
    return f"127.0.0.1:{server.metrics_port}"


def exercise(server: ServerProcess) -> None:
    """One call of each method, and calls that fail, so that every outcome is counted;
    over HTTP too where the server serves it."""
    if server.http is not None:
        host, port = server.http
        for path in ("/v1/id?agent=deploy-test", "/v1/ids?agent=deploy-test&count=3"):
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as reply:
                assert reply.status == 200
    client = server.raw_client()
    client.get_id("deploy-test")
    client.get_ids("deploy-test", 3)
    client.get_worker_id()
    client.get_datacenter_id()
    client.get_timestamp()
    client.get_layout()
    with pytest.raises(thrift.InvalidUserAgentError):
        client.get_id("not a valid agent!")
    with pytest.raises(thrift.InvalidCountError):
        client.get_ids("deploy-test", 0)


@pytest.mark.slow
@pytest.mark.zookeeper
@pytest.mark.timeout(240)
def test_prometheus_evaluates_every_panel_and_alert(
    zookeeper: ZooKeeper, zk_path: str, tmp_path: Path
) -> None:
    cluster = (
        "--zookeeper", zookeeper.hosts, "--zk-path", zk_path, "--advertise-host", "127.0.0.1",
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        node = start_server(*cluster, "--worker-id", "1", "--http-port", "0")
        stack.callback(node.stop)
        pair = start_server(*cluster, "--worker-id", "2", "--processes", "2")  # workers 2, 3
        stack.callback(pair.stop)
        # Standalone, nothing stops it from taking worker 1 of datacenter 0 as well.
        rogue = start_server("--worker-id", "1")
        stack.callback(rogue.stop)
        servers = [node, pair, rogue]
        instances = sorted(instance(server) for server in servers)
        for server in servers:
            exercise(server)
        stack.enter_context(Load(servers, per_server=1, batch=10))

        prometheus = Prometheus(
            tmp_path / "prometheus",
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": instances}]}],
            },
        )
        stack.callback(prometheus.stop)
        try:
            check_prometheus(prometheus, instances, node, rogue, tmp_path)
        except BaseException:
            print(f"prometheus log (end):\n{prometheus.log_tail()}")
            raise


def check_prometheus(
    prometheus: Prometheus,
    instances: list[str],
    node: ServerProcess,
    rogue: ServerProcess,
    tmp_path: Path,
) -> None:
    wait_until(prometheus.ready, "prometheus ready", 30)

    def targets_up() -> bool:
        targets = prometheus.get("/api/v1/targets")["data"]["activeTargets"]
        return sorted(t["labels"]["instance"] for t in targets if t["health"] == "up") == instances

    wait_until(targets_up, f"every target scraped: {instances}", 30)
    scraped = f'min(count_over_time(up{{job="{JOB}"}}[1m])) >= 2'
    wait_until(lambda: prometheus.query(scraped), "two scrapes of every target", 30)
    moving = f'count by (instance) (rate(snowflake_ids_generated_total{{job="{JOB}"}}[10s]) > 0)'
    wait_until(
        lambda: len(prometheus.query(moving)) == len(instances), "a rate for every target", 30
    )

    def rules_evaluated() -> bool:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        assert [(g["name"], g["file"]) for g in groups] == [("snowflake", str(RULES))], groups
        rules = groups[0]["rules"]
        assert [rule["name"] for rule in rules] == ALERTS
        failed = [
            (rule["name"], rule.get("lastError")) for rule in rules if rule["health"] == "err"
        ]
        assert failed == [], f"rules failing to evaluate: {failed}"
        return all(rule["health"] == "ok" for rule in rules)

    wait_until(rules_evaluated, "every rule evaluated", 30)

    # The dashboard's variables list what Grafana would offer.
    jobs = prometheus.get(
        "/api/v1/label/job/values", **{"match[]": "snowflake_ids_generated_total"}
    )
    assert jobs["data"] == [JOB]
    offered = prometheus.get(
        "/api/v1/label/instance/values",
        **{"match[]": f'snowflake_ids_generated_total{{job=~"{JOB}"}}'},
    )
    assert offered["data"] == instances

    offered = prometheus.get(
        "/api/v1/label/protocol/values",
        **{"match[]": f'snowflake_requests_total{{job=~"{JOB}"}}'},
    )
    assert offered["data"] == ["http", "thrift"]
    variables = {
        **INTERVALS,
        "job": JOB,
        "instance": regex_of(instances),
        "protocol": regex_of(offered["data"]),
    }
    queries = [
        Query(q.source, substitute(q.expr, variables)) for q in panel_queries(dashboard())
    ] + alert_queries()
    answers = {query: prometheus.get("/api/v1/query", query=query.expr) for query in queries}
    record = "\n".join(
        f"{query.source}\t{series(answer)}\t{' '.join(query.expr.split())}"
        for query, answer in answers.items()
    )
    artifact = tmp_path / "evaluated-queries.tsv"
    artifact.write_text("source\tseries\tquery\n" + record + "\n", encoding="utf-8")
    print(f"\n{len(queries)} queries evaluated (also in {artifact}):\n{record}")

    failed = {q.source: a for q, a in answers.items() if a["status"] != "success"}
    assert failed == {}, f"queries Prometheus refused: {failed}"
    empty = [
        q.source
        for q, a in answers.items()
        if q.source.startswith("panel") and not a["data"]["result"]
    ]
    assert empty == [], f"panels without data: {empty}"
    raised = {
        q.source: a["data"]["result"]
        for q, a in answers.items()
        if q.source.removeprefix("alert ") in QUIET_ON_A_HEALTHY_FLEET and a["data"]["result"]
    }
    assert raised == {}, f"alert expressions true on a healthy fleet: {raised}"
    duplicates = next(a for q, a in answers.items() if q.source == "alert SnowflakeDuplicateNodeId")
    assert [(r["metric"], r["value"][1]) for r in duplicates["data"]["result"]] == [
        ({"datacenter_id": "0", "worker_id": "1"}, "2")
    ]

    # The rule itself: pending (for: 1m) with both holders of worker 1 in its description.
    def duplicate_alert() -> dict[str, Any] | None:
        alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
        found = [a for a in alerts if a["labels"]["alertname"] == "SnowflakeDuplicateNodeId"]
        return found[0] if found else None

    wait_until(duplicate_alert, "SnowflakeDuplicateNodeId pending", 30)
    alert = duplicate_alert()
    assert alert is not None and alert["state"] in {"pending", "firing"}
    assert alert["labels"]["worker_id"] == "1" and alert["labels"]["datacenter_id"] == "0"
    holders = ", ".join(sorted([instance(node), instance(rogue)]))
    assert f"({holders})" in alert["annotations"]["description"], alert
    check_the_new_series(prometheus, instances, node, rogue)


def check_the_new_series(
    prometheus: Prometheus, instances: list[str], node: ServerProcess, rogue: ServerProcess
) -> None:
    """Sums by method still see every call; protocol splits them; the clock and worker-id
    gauges are there where they should be."""
    # One instant (the load keeps calling): a sum by method minus its Thrift part is
    # exactly the node's HTTP calls.
    ok = f'snowflake_requests_total{{job="{JOB}",outcome="ok"}}'
    thrift_ok = f'snowflake_requests_total{{job="{JOB}",outcome="ok",protocol="thrift"}}'
    http_part = prometheus.query(f"sum by (method) ({ok}) - sum by (method) ({thrift_ok})")
    assert {r["metric"]["method"]: float(r["value"][1]) for r in http_part} == {
        "get_id": 1.0, "get_ids": 1.0, "get_layout": 0.0,
        "get_datacenter_id": 0.0, "get_timestamp": 0.0, "get_worker_id": 0.0,
    }  # fmt: skip
    by_protocol = prometheus.query(f"sum by (protocol) ({ok})")
    assert sorted(r["metric"]["protocol"] for r in by_protocol) == ["http", "thrift"]
    synced = prometheus.query(f'count by (instance) (snowflake_clock_synchronized{{job="{JOB}"}})')
    assert sorted(r["metric"]["instance"] for r in synced) == instances  # Linux: adjtimex
    steps = prometheus.query(f'snowflake_clock_max_backward_step_seconds{{job="{JOB}"}}')
    assert len(steps) == 4, steps  # node, the pair's two processes, rogue
    free = prometheus.query(f'snowflake_zookeeper_free_worker_ids{{job="{JOB}"}}')
    holders = {(r["metric"]["instance"], r["metric"].get("process", "")) for r in free}
    assert instance(rogue) not in {at for at, _ in holders}  # standalone: no gauge
    assert (instance(node), "") in holders and len(holders) == 3, holders


def series(answer: dict[str, Any]) -> str:
    """How many series a query's answer holds, or the error Prometheus gave."""
    if answer["status"] != "success":
        return f"error: {answer.get('error')}"
    return str(len(answer["data"]["result"]))
