"""Twitter's start-up sanity checks: every registered peer's ids and clock, and its layout.

A node asks each registered peer for its worker id, datacenter id and time
before it registers, and for its layout: a peer answering with ids other than
those registered at its address (worker or datacenter insanity) or a layout
other than ours (layout insanity) refuses start-up (``StartupRefused``, exit 3:
a registration that lies, or two layouts, does not pass by itself). A peer
without ``get_layout`` (Twitter's server) is not asked for it; the layout
recorded in ZooKeeper covers it.

A peer that does not answer (it refuses connections, times out, hangs up) is
asked again for a while: a node registers first and listens only once it can
serve, which may take its start-up waits (``--first-start-wait``, then
``--max-startup-wait`` for its clock; the cluster's nodes are assumed to share
them), so a check in between meets a refused connection. Meanwhile its
registrations are read again: a node that crashed leaves its registration
behind until its session expires, and once it is gone the address is no peer
any more (skipped, and logged). A peer still registered and silent after
:func:`refused_retry_s` (one bound for the whole check) defers the start
(``StartupDeferred``, exit 75: try again later). So does a mean clock offset
beyond ``--max-peer-skew``: the clocks must be fixed (NTP), but nothing was
registered and a later start passes once they are, so a supervisor's restarts
pick the node up without an operator; its log says why at each try.
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
from thriftpy2.protocol.exc import TProtocolException
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TTransportException

from .._config.settings import ClusterSettings
from .._errors import StartupDeferred, StartupInterrupted, StartupRefused
from .._ids.layouts import describe_layout
from .zk import children, zk_call

__all__ = ["check_peers", "refused_retry_s"]

log = logging.getLogger(__name__)

# What a peer that does not speak the protocol raises: the Cython protocol's own error
# (when thriftpy2 was built with it), the pure Python one's, or a short read.
_NOT_THRIFT: tuple[type[Exception], ...] = (EOFError, TProtocolException)
try:
    from thriftpy2.protocol.cybin import ProtocolError  # type: ignore[attr-defined]

    _NOT_THRIFT += (ProtocolError,)
except ImportError:  # pragma: no cover - thriftpy2 without its Cython extensions
    pass

_PEER_TIMEOUT_S = 1.0
_REFUSED_POLL_S = 0.05
_REREAD_EVERY = 10  # failed tries of a peer between two reads of its registrations
_MAX_STARTUP_COUNTED_S = 60.0  # an unbounded --max-startup-wait counts as this much
_REFUSED_MARGIN_S = 5.0

Pair = tuple[int, int]  # (datacenter, worker)


def refused_retry_s(settings: ClusterSettings) -> float:
    """How long the checks wait for registered peers that do not answer: as long as
    a node may take between registering and listening, and a margin."""
    startup = min(settings.max_startup_wait, _MAX_STARTUP_COUNTED_S)
    return settings.first_start_wait + startup + _REFUSED_MARGIN_S


def _never() -> bool:
    return False


def check_peers(
    client: Any,
    settings: ClusterSettings,
    address: str,
    clock: Callable[[], int],
    sleep: Callable[[float], object] = time.sleep,
    stopped: Callable[[], bool] = _never,
) -> set[Pair] | None:
    """Check every peer registered under ``settings.zk_path`` (except ``address``,
    our own), naming the peer and the number that was wrong: ``StartupRefused`` for
    insanity, ``StartupDeferred`` for a peer silent past the bound or clocks too far
    apart. ``sleep`` waits between the tries of a peer that does not answer; once
    ``stopped()`` says so after a wait, ``StartupInterrupted``. Returns the
    (datacenter, worker) pairs registered, ours included (None with
    --skip-sanity-checks: nothing was read)."""
    if settings.skip_sanity_checks:
        log.warning("--skip-sanity-checks: not asking registered peers")
        return None
    root = f"{settings.zk_path}/nodes"
    wait = settings.zk_connect_timeout
    registered = _registrations(client, root, wait)
    pairs = {pair for held in registered.values() for pair in held}
    # Our own address: sibling processes on this host and clock (and our own socket,
    # which refuses connections until we listen).
    registered.pop(address, None)

    def still_registered(peer: str, pairs: set[Pair]) -> set[Pair]:
        return {pair for pair in pairs if _registered_at(client, root, pair, wait) == peer}

    budget = _Budget(sleep, stopped, refused_retry_s(settings))
    transport, layout = settings.transport, settings.layout
    skews: list[tuple[str, int]] = []
    for at, ids in registered.items():
        skew = _check_peer(_Peer(at, ids, still_registered, budget), transport, clock, layout)
        if skew is not None:
            skews.append((at, skew))
    if not skews:
        log.info("no registered peers to check")
        return pairs
    mean = sum(skew for _, skew in skews) / len(skews)
    if abs(mean) > settings.max_peer_skew * 1000:
        detail = ", ".join(f"{peer} {skew:+d} ms" for peer, skew in skews)
        raise StartupDeferred(
            f"our clock is {abs(mean):.0f} ms {'behind' if mean > 0 else 'ahead of'} the "
            f"mean of {len(skews)} peers' clocks, more than --max-peer-skew "
            f"{settings.max_peer_skew:g} s (peers relative to us: {detail}); fix "
            "the clocks (NTP): a later start passes once they agree"
        )
    log.info("%d peer(s) sane; mean clock offset %+.0f ms", len(skews), mean)
    return pairs


def _registrations(client: Any, root: str, wait: float) -> dict[str, set[Pair]]:
    """The (datacenter, worker) pairs registered at each address under ``root``.

    One address may hold several registrations (a node run with --processes: any
    of its processes may answer), so each address is asked once."""
    registered: dict[str, set[Pair]] = {}
    for dc_name in children(client, root, f"reading the registrations in {root}", wait):
        where = f"{root}/{dc_name}"
        for worker_name in children(client, where, f"reading the registrations in {where}", wait):
            pair = (_number(root, dc_name), _number(where, worker_name))
            peer = _registered_at(client, root, pair, wait)
            if peer is not None:
                registered.setdefault(peer, set()).add(pair)
    return registered


def _number(parent: str, name: str) -> int:
    """A datacenter's or worker's id, the name of a znode under ``parent``."""
    if not name.isdigit() or not name.isascii():
        raise StartupRefused(
            f"{parent}/{name} is not a node's registration (its name is not a number): "
            "registrations that cannot be read cannot be checked; remove it by hand"
        )
    return int(name)


def _registered_at(client: Any, root: str, pair: Pair, wait: float) -> str | None:
    """The address registered for ``pair``; None if it is not registered.
    ``StartupRefused`` if it is not a ``host:port``: a registration nobody can check."""
    path = f"{root}/{pair[0]}/{pair[1]}"
    try:
        data, _ = zk_call(client, wait, f"reading the registration {path}", "get", path)
    except NoNodeError:
        return None  # gone meanwhile
    address = str(data.decode(errors="replace"))
    if _host_port(address) is None:
        # Deferred, not refused: the registration is ephemeral and goes with its session.
        raise StartupDeferred(
            f"the registration {path} holds {address!r}, not a node's host:port: a "
            "registration that cannot be read cannot be checked; remove it by hand (a node "
            "registers as its --advertise-host:--advertise-port)"
        )
    return address


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port``; None if it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not port.isascii() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


class _Budget:
    """The seconds the checks may spend on peers that do not answer, shared by all
    of them (they start and wait side by side): the waits between tries, counted by
    what was asked of ``sleep``, and the time the failed tries took."""

    def __init__(
        self, sleep: Callable[[float], object], stopped: Callable[[], bool], bound_s: float
    ) -> None:
        self._sleep = sleep
        self._stopped = stopped
        self.bound_s = bound_s
        self.spent_s = 0.0

    @property
    def exhausted(self) -> bool:
        return self.spent_s >= self.bound_s

    def wait(self) -> None:
        """Wait before the next try; ``StartupInterrupted`` if a stop came meanwhile."""
        self._sleep(_REFUSED_POLL_S)
        self.spent_s += _REFUSED_POLL_S
        if self._stopped():
            raise StartupInterrupted(
                "stopping while the peer checks waited for a peer; nothing was registered"
            )


class _Peer:
    """A registered peer: its address, the pairs still registered there, and its tries."""

    def __init__(
        self,
        address: str,
        registered: set[Pair],
        still_registered: Callable[[str, set[Pair]], set[Pair]],
        budget: _Budget,
    ) -> None:
        self.address = address
        self.registered = set(registered)
        self._still_registered = still_registered
        self._budget = budget

    @property
    def where(self) -> str:
        as_text = ", ".join(f"datacenter {dc}, worker {w}" for dc, w in sorted(self.registered))
        return f"peer {self.address} (registered as {as_text})"

    def ask(
        self, transport: str, clock: Callable[[], int]
    ) -> tuple[Pair, int, Layout | None] | None:
        """An answer (see :func:`_ask_peer`), asking again while it does not answer;
        None once none of its registrations is left: not a peer any more.
        ``StartupDeferred`` if it is still registered and silent past the bound."""
        failures = 0
        while True:
            started = time.monotonic()
            try:
                return _ask_peer(self.address, transport, clock)
            except _NoAnswer as e:
                problem = str(e)
            self._budget.spent_s += time.monotonic() - started
            if failures % _REREAD_EVERY == 0 or self._budget.exhausted:
                before = self.where
                self.registered = self._still_registered(self.address, self.registered)
                if not self.registered:
                    log.warning(
                        "%s does not answer (%s) and is not registered any more: not a peer "
                        "(a node gone, its session expired); skipping it", before, problem,
                    )  # fmt: skip
                    return None
            failures += 1
            if self._budget.exhausted:
                raise StartupDeferred(
                    f"{self.where} is unreachable: {problem}; it stayed registered and silent "
                    f"for the {self._budget.bound_s:g} s the peer checks wait (as long as a node "
                    "may take to listen after registering): try again later; if it is gone for "
                    "good its registration expires with its session, or start with "
                    "--skip-sanity-checks"
                )
            self._budget.wait()


def _check_peer(
    peer: _Peer, transport: str, clock: Callable[[], int], layout: Layout
) -> int | None:
    """The peer's clock minus ours, in ms, after checking its ids against the
    (datacenter, worker) pairs registered at its address, and its layout against ours;
    None if it is not registered any more (see :meth:`_Peer.ask`).

    Several pairs at one address are the processes of one node (``--processes``):
    the kernel picks which one answers a connection, so connections are opened
    (up to 8 per pair) until each registered pair has answered. An answer that is
    not registered there, or a registered pair that never answers, is insanity.
    """
    answered: set[Pair] = set()
    skew: int | None = None
    tries = 0
    while tries < 8 * len(peer.registered):
        answer = peer.ask(transport, clock)
        if answer is None:
            return None
        tries += 1
        pair, offset, theirs = answer
        where = peer.where
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
        if pair[1] not in {w for _, w in peer.registered}:
            raise StartupRefused(f"Worker id insanity: {where} says it is worker {pair[1]}")
        if pair not in peer.registered:
            raise StartupRefused(
                f"Datacenter id insanity: {where} says it is in datacenter {pair[0]}"
            )
        answered.add(pair)
        skew = offset if skew is None else skew
        if peer.registered <= answered:
            return skew
    missing = "; ".join(
        f"datacenter {dc}, worker {w}" for dc, w in sorted(peer.registered - answered)
    )
    raise StartupRefused(
        f"Worker id insanity: {peer.where} never answered as {missing} in {tries} connections"
    )


class _NoAnswer(Exception):
    """A peer gave no answer (refused, timed out, hung up, not an address): why."""


def _ask_peer(
    peer: str, transport: str, clock: Callable[[], int]
) -> tuple[Pair, int, Layout | None]:
    """One connection: the (datacenter, worker) that answers, its clock minus ours,
    and its layout (None if it has no ``get_layout``); ``_NoAnswer`` if it gives none."""
    parsed = _host_port(peer)
    assert parsed is not None, peer  # registrations are checked when read
    host, port = parsed
    try:
        client = open_client(host, port, transport, _PEER_TIMEOUT_S)
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
    except TTransportException as e:
        cause = e.__context__  # the OSError says why: refused, timed out, no route
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else ""
        raise _NoAnswer(f"{e.message} ({why.lower()})" if why else str(e.message)) from None
    except Exception as e:  # noqa: BLE001 - any failure to get an answer
        raise _NoAnswer(_no_answer(e)) from None
    return (int(peer_dc), int(peer_worker)), int(peer_time - (before + after) // 2), theirs


def _no_answer(error: Exception) -> str:
    """Why a peer gave no answer, in words; an unexpected failure named in parentheses."""
    if isinstance(error, TApplicationException):
        return f"it answered with an error: {error.message or 'no message'}"
    if isinstance(error, TimeoutError):
        return "it did not answer in time"
    if isinstance(error, ConnectionError):
        return "it hung up"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    if isinstance(error, _NOT_THRIFT):
        return "it answered with something that is not the Snowflake protocol"
    detail = f": {error}" if str(error) else ""
    return f"no answer ({type(error).__name__}{detail})"
