"""Twitter's start-up sanity checks: every registered peer's ids and clock, and its layout.

A node asks each registered peer for its worker id, datacenter id and time
before it registers, and for its layout: a peer answering with ids other than
those registered at its address (worker or datacenter insanity), a layout
other than ours (layout insanity), an unreachable peer, or a mean clock offset
beyond ``--max-peer-skew`` refuses start-up. A peer without ``get_layout``
(Twitter's server) is not asked for it; the layout recorded in ZooKeeper
covers it. A peer refusing connections is asked again for a while: a node
registers first and listens only once it can serve, which may take its start-up
waits (``--first-start-wait``, then ``--max-startup-wait`` for its clock; the
cluster's nodes are assumed to share them), so a check in between meets a
refused connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kazoo.exceptions import NoNodeError
from snowflake_thrift_client import Layout
from snowflake_thrift_client._idl import layout_from_thrift
from snowflake_thrift_client._transports import open_client
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from .._config.settings import ClusterSettings
from .._errors import StartupRefused
from .zkmarks import describe_layout, zk_call

__all__ = ["check_peers", "children", "refused_retry_s"]

log = logging.getLogger(__name__)

_PEER_TIMEOUT_S = 1.0
_REFUSED_POLL_S = 0.05
_MAX_STARTUP_COUNTED_S = 60.0  # an unbounded --max-startup-wait counts as this much
_REFUSED_MARGIN_S = 5.0


def refused_retry_s(settings: ClusterSettings) -> float:
    """How long a registered peer that refuses connections is asked again: as long as
    a node may take between registering and listening, and a margin."""
    startup = min(settings.max_startup_wait, _MAX_STARTUP_COUNTED_S)
    return settings.first_start_wait + startup + _REFUSED_MARGIN_S


def children(client: Any, path: str, timeout_s: float = 10.0) -> list[str]:
    """The children of ``path`` in numeric order (none if it does not exist), read
    within ``timeout_s`` (``StartupRefused`` otherwise)."""
    try:
        names = zk_call(client, timeout_s, f"reading the registrations in {path}",
                        "get_children", path)  # fmt: skip
        return sorted(names, key=lambda n: (len(n), n))
    except NoNodeError:
        return []


def check_peers(
    client: Any,
    settings: ClusterSettings,
    address: str,
    clock: Callable[[], int],
    sleep: Callable[[float], object] = time.sleep,
) -> None:
    """Check every peer registered under ``settings.zk_path`` (except ``address``,
    our own); ``StartupRefused`` naming the peer and the number that was wrong.
    ``sleep`` waits between the tries of a peer that refuses connections."""
    if settings.skip_sanity_checks:
        log.warning("--skip-sanity-checks: not asking registered peers")
        return
    root = f"{settings.zk_path}/nodes"
    # One address may hold several registrations (a node run with --processes: any
    # of its processes may answer), so each address is asked once.
    registered: dict[str, set[tuple[int, int]]] = {}
    wait = settings.zk_connect_timeout
    for dc_name in children(client, root, wait):
        for worker_name in children(client, f"{root}/{dc_name}", wait):
            path = f"{root}/{dc_name}/{worker_name}"
            try:
                data, _ = zk_call(client, wait, f"reading the registration {path}", "get", path)
            except NoNodeError:
                continue  # gone meanwhile
            peer = data.decode(errors="replace")
            registered.setdefault(peer, set()).add((int(dc_name), int(worker_name)))
    # Our own address: sibling processes on this host and clock (and our own socket,
    # which refuses connections until we listen).
    registered.pop(address, None)
    transport, layout = settings.transport, settings.layout
    retry_s = refused_retry_s(settings)
    skews = [
        (peer, _check_peer(peer, ids, transport, clock, layout, _Dial(sleep, retry_s)))
        for peer, ids in registered.items()
    ]
    if not skews:
        log.info("no registered peers to check")
        return
    mean = sum(skew for _, skew in skews) / len(skews)
    if abs(mean) > settings.max_peer_skew * 1000:
        detail = ", ".join(f"{peer} {skew:+d} ms" for peer, skew in skews)
        raise StartupRefused(
            f"our clock is {abs(mean):.0f} ms {'behind' if mean > 0 else 'ahead of'} the "
            f"mean of {len(skews)} peers' clocks, more than --max-peer-skew "
            f"{settings.max_peer_skew:g} s (peers relative to us: {detail}); fix "
            "the clocks (NTP)"
        )
    log.info("%d peer(s) sane; mean clock offset %+.0f ms", len(skews), mean)


def _check_peer(
    peer: str,
    registered: set[tuple[int, int]],
    transport: str,
    clock: Callable[[], int],
    layout: Layout,
    dial: _Dial,
) -> int:
    """The peer's clock minus ours, in ms, after checking its ids against the
    (datacenter, worker) pairs registered at its address, and its layout against ours.

    Several pairs at one address are the processes of one node (``--processes``):
    the kernel picks which one answers a connection, so connections are opened
    (up to 8 per pair) until each registered pair has answered. An answer that is
    not registered there, or a registered pair that never answers, is insanity.
    """
    as_text = ", ".join(f"datacenter {dc}, worker {w}" for dc, w in sorted(registered))
    where = f"peer {peer} (registered as {as_text})"
    answered: set[tuple[int, int]] = set()
    skew: int | None = None
    for _ in range(8 * len(registered)):
        pair, offset, theirs = _ask_peer(peer, where, transport, clock, dial)
        if theirs is None:
            log.warning(
                "%s has no get_layout (Twitter's server?): its layout is not checked; the "
                "layout recorded in ZooKeeper still is",
                where,
            )
        elif theirs != layout:
            raise StartupRefused(
                f"Layout insanity: {where} makes ids with {describe_layout(theirs)}, this node "
                f"would make them with {describe_layout(layout)}; two layouts in one cluster "
                "hand out the same ids: start with the cluster's --epoch and --*-bits"
            )
        if pair[1] not in {w for _, w in registered}:
            raise StartupRefused(f"Worker id insanity: {where} says it is worker {pair[1]}")
        if pair not in registered:
            raise StartupRefused(
                f"Datacenter id insanity: {where} says it is in datacenter {pair[0]}"
            )
        answered.add(pair)
        skew = offset if skew is None else skew
        if answered == registered:
            return skew
    missing = "; ".join(f"datacenter {dc}, worker {w}" for dc, w in sorted(registered - answered))
    raise StartupRefused(
        f"Worker id insanity: {where} never answered as {missing} in "
        f"{8 * len(registered)} connections"
    )


class _Dial:
    """Opens clients of peers, asking a peer that refuses connections again every
    ``_REFUSED_POLL_S`` for at most ``retry_s`` (``sleep`` waits between tries)."""

    def __init__(self, sleep: Callable[[float], object], retry_s: float) -> None:
        self._sleep = sleep
        self.retry_s = retry_s

    def __call__(self, host: str, port: int, transport: str) -> Any:
        retries = int(self.retry_s / _REFUSED_POLL_S)
        for retry in range(retries + 1):
            try:
                return open_client(host, port, transport, _PEER_TIMEOUT_S)
            except TTransportException as e:
                if not isinstance(e.__context__, ConnectionRefusedError):
                    raise
                if retry == retries:
                    raise TTransportException(
                        e.type, f"{e.message}: refused connections for {self.retry_s:g} s"
                    ) from None
            self._sleep(_REFUSED_POLL_S)
        raise AssertionError("unreachable: the last try returns or raises")


def _ask_peer(
    peer: str, where: str, transport: str, clock: Callable[[], int], dial: _Dial
) -> tuple[tuple[int, int], int, Layout | None]:
    """One connection: the (datacenter, worker) that answers, its clock minus ours,
    and its layout (None if it has no ``get_layout``)."""
    host, _, port = peer.rpartition(":")
    try:
        client = dial(host, int(port), transport)
        try:
            peer_worker = client.get_worker_id()
            peer_dc = client.get_datacenter_id()
            before = clock()
            peer_time = client.get_timestamp()
            after = clock()
            theirs: Layout | None
            try:
                theirs = layout_from_thrift(client.get_layout())[0]
            except TApplicationException as e:
                if e.type != TApplicationException.UNKNOWN_METHOD:
                    raise
                theirs = None
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - any failure to get an answer
        raise StartupRefused(
            f"{where} is unreachable: {e}; if it is gone for good its node expires with "
            "its session, or start with --skip-sanity-checks"
        ) from None
    return (int(peer_dc), int(peer_worker)), int(peer_time - (before + after) // 2), theirs
