"""The handler (snowflake_server/_service.py), driven directly: a real generator on a fake
clock, real metrics and a real audit trail. Every id it issues is counted once for its
agent and audited once; a bad agent or count issues, counts and audits nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest

from snowflake_server import (
    GeneratorSettings,
    IdGenerator,
    InvalidCountError,
    InvalidUserAgentError,
    decompose,
)
from snowflake_server._observability.audit import AuditLog
from snowflake_server._observability.metrics import OVERFLOW_AGENT, ServiceMetrics
from snowflake_server._service import MAX_USER_AGENT_LENGTH, SnowflakeHandler, check_user_agent
from snowflake_server._thrift.processor import service_methods
from tests.support.fakes import FakeClock
from tests.support.processes import parse_metrics

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z


@dataclass
class Service:
    handler: SnowflakeHandler
    generator: IdGenerator
    metrics: ServiceMetrics
    clock: FakeClock
    audit: AuditLog

    def counted(self) -> dict[str, float]:
        """The ids counted per agent, as a scrape reads them."""
        samples = parse_metrics(generate_latest(self.metrics.registry()).decode())
        prefix = "snowflake_ids_by_agent_total{agent="
        return {k[len(prefix) + 1 : -2]: v for k, v in samples.items() if k.startswith(prefix)}

    def audited(self) -> list[dict[str, str]]:
        """Every line of the audit trail so far (closes it: what was queued is written)."""
        self.audit.close()
        text = Path(self.audit.path).read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines()]


def make_service(tmp_path: Path, *, max_agents: int = 100) -> Service:
    clock = FakeClock(T0)
    generator = IdGenerator(
        GeneratorSettings(datacenter_id=2, worker_id=5),
        clock=clock,
        sleep=clock.sleep,
    )
    metrics = ServiceMetrics(generator, service_methods(), max_agents=max_agents)
    tmp_path.mkdir()
    audit = AuditLog(str(tmp_path / "audit.jsonl"))  # its writer not started: close() writes
    handler = SnowflakeHandler(generator, metrics, metrics.open_connection(), clock, audit)
    return Service(handler, generator, metrics, clock, audit)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Makes services (each its own audit trail), and closes their trails after."""
    made: list[Service] = []

    def make(**kwargs: int) -> Service:
        made.append(make_service(tmp_path / str(len(made)), **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.audit.close()


@pytest.fixture
def service(services: Callable[..., Service]) -> Service:
    return services()


def test_get_id_issues_an_id_of_this_worker_counted_and_audited_for_its_agent(
    service: Service,
) -> None:
    first = service.handler.get_id("alpha")
    service.clock.now += 1
    second = service.handler.get_id("beta-2")
    assert second > first
    parts = decompose(first)
    assert (parts.timestamp_ms, parts.datacenter_id, parts.worker_id) == (T0, 2, 5)
    assert service.counted() == {"alpha": 1, "beta-2": 1}
    assert service.audited() == [
        {"id": str(first), "useragent": "alpha", "time": "2023-11-14T22:13:20.000Z"},
        {"id": str(second), "useragent": "beta-2", "time": "2023-11-14T22:13:20.001Z"},
    ]


def test_get_ids_issues_a_sorted_batch_counted_and_audited_once_each(service: Service) -> None:
    ids = service.handler.get_ids("batch", 5)
    assert len(ids) == 5 and ids == sorted(set(ids))
    assert service.counted() == {"batch": 5}
    assert [line["id"] for line in service.audited()] == [str(i) for i in ids]


def test_ids_are_counted_per_agent_across_calls(service: Service) -> None:
    for _ in range(3):
        service.handler.get_id("alpha")
    service.handler.get_ids("alpha", 4)
    service.handler.get_ids("beta", 2)
    assert service.counted() == {"alpha": 7, "beta": 2}
    assert len(service.audited()) == 9


@pytest.mark.parametrize(
    ("agent", "said"),
    [
        (None, "user agent missing (field 1 must be a string)"),
        (b"alpha", "user agent is not valid UTF-8"),
        (7, "must be a string matching [a-zA-Z][a-zA-Z\\-0-9]*, got int"),
        ("", "invalid user agent '' (0 chars)"),
        ("9lives", "invalid user agent '9lives' (6 chars)"),
        ("a b", "invalid user agent 'a b' (3 chars)"),
        ("a" * (MAX_USER_AGENT_LENGTH + 1), f"'{'a' * 40}...' ({MAX_USER_AGENT_LENGTH + 1} chars)"),
    ],
)
def test_a_bad_agent_is_refused_and_nothing_is_issued_counted_or_audited(
    service: Service, agent: object, said: str
) -> None:
    for call in (
        lambda: service.handler.get_id(agent),
        lambda: service.handler.get_ids(agent, 3),
    ):
        with pytest.raises(InvalidUserAgentError) as raised:
            call()
        assert said in str(raised.value)
    assert service.generator.counters().ids_generated == 0, "no id was taken"
    assert service.counted() == {} and service.audited() == []


def test_the_longest_agent_allowed_is_served(service: Service) -> None:
    longest = "a" * MAX_USER_AGENT_LENGTH
    assert check_user_agent(longest) == longest
    service.handler.get_id(longest)
    assert service.counted() == {longest: 1}


@pytest.mark.parametrize("count", [0, -1, 4097, "3", None])
def test_a_bad_count_issues_counts_and_audits_nothing(service: Service, count: object) -> None:
    with pytest.raises(InvalidCountError):
        service.handler.get_ids("batch", count)
    assert service.counted() == {} and service.audited() == []


def test_agents_past_the_label_bound_are_counted_as_the_overflow_agent(
    services: Callable[..., Service],
) -> None:
    service = services(max_agents=2)
    for agent in ("a", "b", "c", "d", "a"):
        service.handler.get_id(agent)
    assert service.counted() == {"a": 2, "b": 1, OVERFLOW_AGENT: 2}
    assert [line["useragent"] for line in service.audited()] == ["a", "b", "c", "d", "a"]


def test_a_client_cycling_agents_is_labelled_right_past_the_connection_s_cache(
    services: Callable[..., Service],
) -> None:
    """The per-connection cache of labels is bounded; past it each agent is still checked
    and labelled, and a bad agent is still refused."""
    service = services(max_agents=1000)
    agents = [f"agent-{i}" for i in range(200)]
    for agent in agents + agents:
        assert service.handler.label(agent) == agent
        service.handler.issue_id(service.handler.label(agent), agent)
    with pytest.raises(InvalidUserAgentError):
        service.handler.label("bad agent")
    assert service.counted() == dict.fromkeys(agents, 2)


def test_the_id_settings_and_the_time_are_the_generator_s_and_the_clock_s(
    service: Service,
) -> None:
    assert (service.handler.get_worker_id(), service.handler.get_datacenter_id()) == (5, 2)
    assert service.handler.settings == service.generator.settings
    service.clock.now += 1234
    assert service.handler.get_timestamp() == T0 + 1234


def test_without_an_audit_trail_ids_are_still_counted() -> None:
    clock = FakeClock(T0)
    generator = IdGenerator(GeneratorSettings(worker_id=1), clock=clock, sleep=clock.sleep)
    metrics = ServiceMetrics(generator, service_methods())
    handler = SnowflakeHandler(generator, metrics, metrics.open_connection(), clock)
    handler.get_id("alpha")
    handler.get_ids("alpha", 2)
    samples = parse_metrics(generate_latest(metrics.registry()).decode())
    assert samples['snowflake_ids_by_agent_total{agent="alpha"}'] == 3
