"""The partition nemesis: a 3-server ZooKeeper ensemble and 3 nodes (``--worker-id
auto``), each in a network namespace of its own behind one router, under load from a
client that records every id, every failure and every /readyz answer. The faults:
partitions in the router, a killed ZooKeeper leader, a stopped node, a stepped clock.

After every scenario (``Scenario.finish``): no id twice; no id below one that its
worker id issued before; no id, and no /readyz 200, from a node after its
registration was gone (the recorder leases the worker id at once, as another node
would); /readyz not ready around every failed get_id; and every node serving again
once the fault ends. Each prints a ``NEMESIS`` line: ``pytest -s tests/nemesis | grep
NEMESIS``. How it works: CONTRIBUTING.md, "The partition nemesis".

The ensemble grants sessions of at most 3 s while the nodes ask for 4 s, as an
ensemble with a lower ``maxSessionTimeout`` does (issue 15). Every scenario runs twice:
against a plain ensemble, and with auth and TLS on (``/sasl+tls`` in its line). The
namespaces need root: where the machine refuses them, the tests fail saying why (they
never skip).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.nemesis import (
    CLIENT,
    HOSTS,
    SESSION_S,
    ZOOKEEPERS,
    Recording,
    Scenario,
)
from tests.support.netns import Network, portal
from tests.support.processes import FakeTime
from tests.support.zookeeper import SECURITY, ZooKeeperEnsemble

pytestmark = [pytest.mark.nemesis, pytest.mark.zookeeper, pytest.mark.slow]


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    with Network(HOSTS) as net:
        yield net


@pytest.fixture(scope="module", params=SECURITY)
def ensemble(
    network: Network, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ZooKeeperEnsemble]:
    """Every scenario runs against a plain ensemble and once more against a secured one:
    the nodes and the recorder log in by SASL, their znodes carry the service's ACL,
    and clients speak TLS (client certificates required) to every member."""
    with portal(network[CLIENT]) as door:
        zk = ZooKeeperEnsemble(
            tmp_path_factory.mktemp("ensemble"), [network[n] for n in ZOOKEEPERS], door,
            security=str(request.param),
        )  # fmt: skip
        try:
            zk.start()
            yield zk
        finally:
            zk.stop()


@pytest.fixture
def nemesis(
    network: Network, ensemble: ZooKeeperEnsemble, zk_path: str, tmp_path: Path
) -> Iterator[Scenario]:
    scenario = Scenario(network, ensemble, zk_path, tmp_path)
    try:
        yield scenario
    finally:
        scenario.close()


def leased(recording: Recording) -> bool:
    """The recorder saw a registration gone and leased its worker id."""
    return any(claim.ok for claim in recording.claims)


def test_a_node_cut_off_from_zookeeper_stops_before_its_id_is_leased_elsewhere(
    nemesis: Scenario,
) -> None:
    nemesis.start_all()
    nemesis.record("node-partition", claim=True)
    cut = nemesis.event("n3 cut off from the three ZooKeeper servers")
    nemesis.network.partition(["n3"], ZOOKEEPERS)
    # Its session expires on ZooKeeper's side, with its registration.
    nemesis.wait(leased, "n3's registration expires and its worker id is leased", 30)
    taken = nemesis.event("n3's worker id leased by the recorder")
    healed = nemesis.heal()
    nemesis.wait_serving(healed, "every node serves again after healing")
    nemesis.finish(gate_closed=["n3"], cut_to_lease=f"{taken - cut:.2f}s")


@pytest.mark.parametrize("fault", ["partition", "kill"])
def test_the_zookeeper_leader_cut_off_from_its_followers_or_killed(
    nemesis: Scenario, fault: str
) -> None:
    nemesis.start_all()
    nemesis.record(f"leader-{fault}", claim=True)
    ensemble = nemesis.ensemble
    leader = ensemble.leader()
    others = [m for m in ensemble.members if m is not leader]
    if fault == "partition":
        began = nemesis.event(f"{leader.name} (leader) cut off from its followers")
        nemesis.network.partition([leader.name], [m.name for m in others])
    else:
        began = nemesis.event(f"{leader.name} (leader) killed")
        ensemble.kill(leader)
    elected = ensemble.wait_leader(others)
    election = nemesis.event(f"{elected.name} leads") - began
    # Sessions held through the old leader move to the others: the nodes serve on for
    # longer than a session lasts.
    nemesis.wait_serving(began + SESSION_S, "every node serves without the old leader")
    if fault == "partition":
        ended = nemesis.heal()
    else:
        ensemble.start_member(leader)
        ended = nemesis.ended(f"{leader.name} restarted")
    ensemble.wait_whole()
    nemesis.wait_serving(ended, "every node serves with the old leader back")
    nemesis.finish(old_leader=leader.name, new_leader=elected.name, election=f"{election:.2f}s")


def test_a_node_paused_past_its_session_does_not_serve_its_old_id(nemesis: Scenario) -> None:
    nemesis.start_all()
    nemesis.record("node-pause", claim=True)
    victim = nemesis.nodes["n3"]
    paused = nemesis.event("n3 stopped (SIGSTOP)")
    victim.process.send_signal(signal.SIGSTOP)
    try:
        nemesis.wait(leased, "n3's registration expires and its worker id is leased", 30)
        taken = nemesis.event("n3's worker id leased by the recorder")
    finally:
        victim.process.send_signal(signal.SIGCONT)
    continued = nemesis.ended("n3 continued (SIGCONT)")
    nemesis.wait_serving(continued, "every node serves after SIGCONT")
    nemesis.finish(gate_closed=["n3"], pause_to_lease=f"{taken - paused:.2f}s")


def test_a_node_whose_clock_steps_an_hour_ahead_and_back(nemesis: Scenario) -> None:
    clock = FakeTime(nemesis.directory)
    nemesis.start("n1")
    nemesis.start("n2")
    victim = nemesis.start("n3", env=clock.env)
    nemesis.record("clock-step", claim=False)
    ahead = nemesis.event("n3's clock stepped 1 h ahead")
    clock.set("+3600")
    nemesis.wait(
        lambda r: any(c.stamped_s() > time.time() + 3500 for c in r.successes("n3", ahead)),
        "n3 hands out ids an hour ahead",
    )
    back = nemesis.event("n3's clock stepped back")
    clock.set("+0")

    def refused_a_while(recording: Recording) -> bool:
        # Long enough for n3's /readyz to be asked a few times while get_id is refused.
        refused = [c.t1 for c in recording.failures("n3") if c.err == "InvalidSystemClock"]
        polls = [s for s in recording.samples if s.node == "n3" and refused and s.t0 > refused[0]]
        return len(polls) >= 5

    nemesis.wait(refused_a_while, "n3 refuses ids with its clock an hour behind them")
    # It would refuse for an hour: the operator restarts it, on its own disk. The mark
    # of its worker id is an hour ahead, so it must lease another id.
    victim.stop()
    restarted = nemesis.ended("n3 restarted")
    nemesis.start("n3", env=clock.env, state_dir=victim.state_dir)
    nemesis.wait_serving(restarted, "every node serves after n3's restart")
    nemesis.finish(step_back_to_restart=f"{restarted - back:.2f}s")
