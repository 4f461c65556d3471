"""The nemesis's checks against records made up to break them: each check finds what it
is there to find (and no more), so that a nemesis run that passes means something.
No namespaces here, except where the harness must fail saying why it cannot make any.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from snowflake_thrift_client import compose

from snowflake_server import GeneratorSettings, IdGenerator
from snowflake_server._native import native_core
from snowflake_server._observability.metrics import ServiceMetrics
from snowflake_server._thrift.processor import service_methods
from tests.support.nemesis import (
    Call,
    Claim,
    NativeCounts,
    Recording,
    Sample,
    Snapshot,
    duplicates,
    lease_violations,
    longest_outage,
    order_violations,
    readiness_violations,
)
from tests.support.netns import NamespacesRefused, Network

MS = 1_795_000_000_000
N3 = "10.215.6.2:7609"


def got(node: str, t0: float, worker: int = 2, ms: int = MS, sequence: int = 0) -> Call:
    """A get_id that took 1 ms from ``t0`` and returned an id of ``worker``."""
    return Call(node, t0, t0 + 0.001, compose(ms, 0, worker, sequence))


def refused(node: str, t0: float) -> Call:
    return Call(node, t0, t0 + 0.001, None, "UnavailableError", "not handing out ids", True)


def ready(node: str, t0: float, status: int | None) -> Sample:
    return Sample(node, t0, t0 + 0.002, status, "" if status == 200 else "why")


# -- duplicates and order ---------------------------------------------------------------


def test_an_id_received_twice_is_a_duplicate_whichever_node_gave_it() -> None:
    calls = [got("n1", 1.0), got("n2", 2.0, sequence=1), got("n3", 3.0)]
    assert list(duplicates(calls)) == [calls[0].id]
    assert duplicates(calls[:2]) == {}


def test_an_id_below_one_its_worker_issued_before_is_reported() -> None:
    earlier = got("n3", 1.0, ms=MS + 10)
    later = got("n1", 2.0, ms=MS + 5)  # another node, the same worker id, lower
    (found,) = order_violations([earlier, later])
    assert f"n1 issued {later.id}" in found and f"n3 had issued {earlier.id}" in found


def test_ids_in_order_per_worker_or_of_calls_that_overlap_pass() -> None:
    calls = [got("n1", 1.0, worker=0, ms=MS + 10), got("n2", 2.0, worker=1, ms=MS + 5)]
    assert order_violations(calls) == []
    # Two calls in flight at once: which id was issued first cannot be told.
    overlapping = [Call("n1", 1.0, 1.5, compose(MS + 10, 0, 2, 0)),
                   Call("n3", 1.2, 1.3, compose(MS + 5, 0, 2, 0))]  # fmt: skip
    assert order_violations(overlapping) == []


# -- /readyz inside failures --------------------------------------------------------------


def failing(node: str, start: float, stop: float) -> list[Call]:
    """Failed get_ids every 5 ms from ``start`` to ``stop``, then a success."""
    count = round((stop - start) / 0.005)
    return [refused(node, start + 0.005 * i) for i in range(count)] + [got(node, stop)]


def test_readyz_200_inside_a_run_of_failures_is_reported() -> None:
    calls = [got("n3", 0.9), *failing("n3", 1.0, 1.2)]
    (found,) = readiness_violations(calls, [ready("n3", 1.05, 200)]).violations
    assert found.startswith("n3: /readyz said 200 1 of 1 times (first at 1.050) while 40 get_ids")


def test_not_ready_or_no_answer_inside_a_run_of_failures_passes() -> None:
    calls = failing("n3", 1.0, 1.2)
    for status in (503, None):  # not ready, or no answer at all (a stopped process)
        judged = readiness_violations(calls, [ready("n3", 1.05, status), ready("n3", 1.1, status)])
        assert (judged.violations, judged.runs, judged.witnessed) == ([], 1, 1)


def test_only_polls_of_that_node_inside_the_run_are_judged() -> None:
    calls = failing("n3", 1.0, 1.2)
    # Before the first failure ended, after the last began, or another node's: not inside.
    outside = [ready("n3", 0.999, 200), ready("n3", 1.195, 200), ready("n1", 1.05, 200)]
    judged = readiness_violations(calls, outside)
    assert (judged.violations, judged.runs, judged.witnessed) == ([], 1, 0)


def test_a_run_shorter_than_the_polls_gap_is_counted_not_judged() -> None:
    calls = [got("n3", 0.99), *failing("n3", 1.0, 1.02), got("n1", 1.0)]
    judged = readiness_violations(calls, [ready("n3", 0.95, 200), ready("n3", 1.03, 200)])
    assert (judged.violations, judged.runs, judged.witnessed) == ([], 1, 0)


# -- after the registration is gone -------------------------------------------------------


def recording_with(calls: list[Call], samples: list[Sample], tmp_path: Path) -> Recording:
    recording = Recording(tmp_path / "record.jsonl")
    recording.calls += calls
    recording.samples += samples
    recording.registrations += [
        Snapshot(0.0, 0.01, {"2": {"data": N3, "owner": "0x1"}}),
        Snapshot(4.99, 5.0, {}),  # n3's registration seen gone at 5.0
        Snapshot(5.01, 5.02, {"2": {"data": "nemesis-claim", "owner": "0x9"}}),
        Snapshot(5.5, 5.51, {"2": {"data": "nemesis-claim", "owner": "0x9"}}),
        Snapshot(
            6.0,
            6.01,
            {"2": {"data": "nemesis-claim", "owner": "0x9"}, "3": {"data": N3, "owner": "0x2"}},
        ),
    ]
    recording.claims.append(Claim(2, N3, 5.0, 5.001, 5.01, True, ""))
    return recording


def test_an_id_of_a_worker_id_received_after_its_registration_was_gone_is_reported(
    tmp_path: Path,
) -> None:
    names = {N3: "n3"}
    before = recording_with([got("n3", 4.99)], [], tmp_path)
    assert lease_violations(before, names) == []
    late = recording_with([got("n3", 4.99), got("n3", 5.0)], [], tmp_path)
    (found,) = lease_violations(late, names)
    assert found.startswith("n3 handed out 1 ids of worker 2 after its registration was gone")
    # Another worker id, leased after, is not the one that was taken.
    moved = recording_with([got("n3", 6.5, worker=3)], [], tmp_path)
    assert lease_violations(moved, names) == []


def test_readyz_200_between_the_loss_and_the_next_registration_is_reported(
    tmp_path: Path,
) -> None:
    names = {N3: "n3"}
    (found,) = lease_violations(recording_with([], [ready("n3", 5.2, 200)], tmp_path), names)
    assert found.startswith("n3's /readyz said 200 1 times from 5.200")
    # After the t0 of the last read that did not show it registered again, it may be.
    assert lease_violations(recording_with([], [ready("n3", 5.6, 200)], tmp_path), names) == []
    assert lease_violations(recording_with([], [ready("n3", 5.2, 503)], tmp_path), names) == []


# -- the record -----------------------------------------------------------------------------


def test_the_record_is_read_as_it_grows_a_whole_line_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "record.jsonl"
    call = {"k": "call", "node": "n1", "t0": 1.0, "t1": 1.001, "id": 5}
    with path.open("w") as f:
        f.write(json.dumps(call) + "\n" + '{"k": "ready", "node"')
    recording = Recording(path).refresh()
    assert recording.calls == [Call("n1", 1.0, 1.001, 5)] and recording.samples == []
    with path.open("a") as f:
        f.write(': "n1", "t0": 1.0, "t1": 1.01, "status": 503, "reason": "why"}\n')
    assert recording.refresh().samples == [Sample("n1", 1.0, 1.01, 503, "why")]


def test_the_longest_outage_runs_from_a_failure_to_the_next_id() -> None:
    calls = [got("n3", 1.0), refused("n3", 2.0), refused("n3", 3.0), got("n3", 4.0),
             refused("n3", 5.0), got("n3", 5.5)]  # fmt: skip
    assert longest_outage(calls, "n3") == pytest.approx(2.001)
    assert longest_outage(calls, "n1") == 0.0


# -- where namespaces are refused -----------------------------------------------------------


def test_a_machine_that_refuses_namespaces_fails_the_nemesis_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "unshare"
    fake.write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(NamespacesRefused) as refusal, Network(["a"]):
        pass
    assert "unshare --net refused a network namespace here (exit 1)" in str(refusal.value)
    assert "Operation not permitted" in str(refusal.value)
    assert isinstance(refusal.value, AssertionError), "a failure, never a skip"


# -- native serving -------------------------------------------------------------------


@pytest.mark.skipif(native_core() is None, reason="the native core is not built")
def test_a_nodes_native_counts_are_read_from_its_metrics_text() -> None:
    core = native_core()
    assert core is not None
    metrics = ServiceMetrics(IdGenerator(GeneratorSettings()), service_methods())
    registry, stats = core.AgentRegistry(), core.NativeStats(2)
    metrics.add_native(stats, registry)
    text = generate_latest(metrics.registry()).decode()
    assert NativeCounts.parse(text) == NativeCounts(2, 0, dict.fromkeys(core.HANDOFF_REASONS, 0))
    index = registry.add(b"nemesis", metrics.agent_index(metrics.agent_label("nemesis")))
    for thread in (0, 1, 1):
        stats.record_call(thread, index, 1000)
    stats.record_handoff(0, "gate")
    stats.record_handoff(1, "gate")
    counts = NativeCounts.parse(generate_latest(metrics.registry()).decode())
    assert (counts.threads, counts.calls, counts.handoffs["gate"]) == (2, 3, 2)
    assert counts.line() == "3/gate:2"
