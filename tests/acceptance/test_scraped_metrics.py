"""Metrics scraped from a real server process match the calls made on it."""

from __future__ import annotations

import pytest
from snowflake_thrift_client._transports import Transport

from snowflake_server._observability.metrics import OVERFLOW_AGENT
from tests.support.processes import parse_metrics, start_server
from tests.support.waiting import wait_until

P = 'protocol="thrift"'  # every call here is a Thrift call


@pytest.mark.parametrize("transport", ["framed", "buffered"])
def test_scraped_metrics_match_the_calls_made(transport: Transport) -> None:
    server = start_server("--worker-id", "3", "--max-agents", "2", transport=transport)
    try:
        client = server.raw_client()
        for _ in range(7):
            client.get_id("alpha")
        client.get_ids("beta", 100)
        client.get_ids("gamma", 5)  # past --max-agents 2: counted under the overflow label
        for bad in ["1bad", "a b"]:
            with pytest.raises(Exception, match="user agent"):
                client.get_id(bad)
        with pytest.raises(Exception, match="count"):
            client.get_ids("alpha", 0)
        client.get_worker_id()
        expected = {
            "snowflake_ids_generated_total": 112,
            'snowflake_ids_by_agent_total{agent="alpha"}': 7,
            'snowflake_ids_by_agent_total{agent="beta"}': 100,
            f'snowflake_ids_by_agent_total{{agent="{OVERFLOW_AGENT}"}}': 5,
            f'snowflake_exceptions_total{{kind="invalid_user_agent",method="get_id",{P}}}': 2,
            f'snowflake_exceptions_total{{kind="invalid_user_agent",method="get_ids",{P}}}': 0,
            f'snowflake_exceptions_total{{kind="invalid_count",method="get_ids",{P}}}': 1,
            f'snowflake_exceptions_total{{kind="invalid_system_clock",method="get_id",{P}}}': 0,
            f'snowflake_exceptions_total{{kind="internal_error",method="get_id",{P}}}': 0,
            f'snowflake_exceptions_total{{kind="protocol_error",method="none",{P}}}': 0,
            f'snowflake_requests_total{{method="get_id",outcome="ok",{P}}}': 7,
            f'snowflake_requests_total{{method="get_id",outcome="invalid_user_agent",{P}}}': 2,
            f'snowflake_requests_total{{method="get_ids",outcome="ok",{P}}}': 2,
            f'snowflake_requests_total{{method="get_ids",outcome="invalid_count",{P}}}': 1,
            f'snowflake_requests_total{{method="get_worker_id",outcome="ok",{P}}}': 1,
            f'snowflake_requests_total{{method="get_layout",outcome="ok",{P}}}': 0,
            'snowflake_info{datacenter_id="0",worker_id="3",worker_id_source="number"}': 1,
            "snowflake_ready": 1,
            f'snowflake_request_duration_seconds_count{{method="get_id",{P}}}': 9,
            f'snowflake_request_duration_seconds_count{{method="get_ids",{P}}}': 3,
            f'snowflake_request_duration_seconds_count{{method="get_worker_id",{P}}}': 1,
            f'snowflake_request_duration_seconds_count{{method="get_layout",{P}}}': 0,
            'snowflake_clock_backwards_total{action="refused"}': 0,
            "snowflake_worker_id": 3,
            'snowflake_connections_open{protocol="thrift"}': 1,
        }
        counts = parse_metrics(server.metrics())  # the connection is still open
        assert {k: counts[k] for k in expected} == expected
        client.close()
        # The server's connection thread sees the close a moment later.
        wait_until(
            lambda: (
                parse_metrics(server.metrics())['snowflake_connections_open{protocol="thrift"}']
                == 0
            ),
            "the closed connection counted out",
            5,
        )
        after_close = parse_metrics(server.metrics())
        expected['snowflake_connections_open{protocol="thrift"}'] = 0
        assert {k: after_close[k] for k in expected} == expected
    finally:
        assert server.stop() == 0
