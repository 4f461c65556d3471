"""The session gate: whether this node may hand out the ids of the worker id it leased.

**The proof.** A node serves a leased worker id only while ZooKeeper has confirmed,
within ``0.9 x`` the granted session timeout, that the registration is still ours.

ZooKeeper keeps an ephemeral znode while the session that made it lives, and expires a
session no sooner than the session timeout *it granted* after it last heard from that
session. A heartbeat reads our registration; an answer that the znode exists and is
owned by our session means the server heard from that session after the read was sent,
at ``sent`` on our clock. Nobody else can lease the worker id before the session
expires, so not before ``sent + timeout`` (``timeout``: the lower of the requested
and the granted one; see ``session``). The gate opens until ``sent + 0.9 x timeout``:
the 10 % covers clocks that run at slightly different rates. The clock is
CLOCK_BOOTTIME, which counts while the machine is suspended and the process frozen,
so a node that wakes after its session expired finds its gate closed before any
check runs.

Any sign against the proof closes the gate at once, and only a new registration
begun after it reopens it (:meth:`SessionGate.reopen`): a lost session, a registration gone or
another session's, a mark write refused. An answer to a heartbeat sent before a
closure proves nothing and opens nothing, nor does one while the gate is held (the
cluster's layout record is another layout's). ``SUSPENDED`` closes nothing: the
deadline runs out by itself, whatever the session state says.

The gate knows nothing of leasing or of the layout; ``membership.Cluster`` composes
them. Safe from any thread (kazoo's, the reservation's, the supervision's).

**The native state's copy.** Native threads serve from the worker's native generator state
without Python, so they cannot ask the gate: the gate writes its deadline into the state
(:meth:`SessionGate.attach`), under the state's mutex, whenever the deadline changes, and
each change is there before the call that made it returns. The copy is written outside the
gate's lock, reading the deadline current then (with the state's mutex held): a write that
waited for the mutex carries the newest deadline, never the one of its own change, so
writes that cross cannot leave an older deadline behind a newer one. A thread that holds
the state already (a clock-sequence switch's mark write, refused, closes the gate) writes in
place. The deadline is on the gate's clock, which native threads read as CLOCK_BOOTTIME:
the default clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .._ids.clocks import boot_clock
from .session import GrantedTimeout
from .zk import OP_TIMEOUT_S

if TYPE_CHECKING:
    from .._native._core import GeneratorState

__all__ = ["OPEN_FRACTION", "UNREACHABLE", "Heartbeat", "SessionGate"]

OPEN_FRACTION = 0.9
"""The share of the session timeout a confirmation keeps the gate open for."""

UNREACHABLE = "ZooKeeper unreachable for longer than the session allows"
"""Why ids stopped once a confirmed gate ran out."""


class Heartbeat(NamedTuple):
    """A heartbeat on its way: when it was sent, and how many closures had happened."""

    sent: float
    closures: int


class SessionGate:
    """Open while ZooKeeper's last confirmation of our registration is recent enough
    (see the module docstring: the proof is stated there, once).

    ``clock`` is in seconds (CLOCK_BOOTTIME by default); tests move a fake one.
    Starts closed (``"not registered yet"``) and shut: nothing opens it before
    :meth:`reopen`.
    """

    def __init__(self, clock: Callable[[], float] = boot_clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until = float("-inf")
        self._reason = "not registered yet"
        self._closures = 0
        self._shut = True
        self._shuts = 0  # closures that shut it (not holds): see reopen()
        self._held: str | None = None
        self.last_contact = float("-inf")
        """When the last confirmed heartbeat was sent (the gate's clock)."""
        self._native: GeneratorState | None = None

    # -- what callers read ------------------------------------------------------

    def is_open(self) -> bool:
        """Whether ids may be handed out now."""
        return self._clock() <= self._open_until

    @property
    def open_until(self) -> float:
        """The deadline on the gate's clock (-inf: closed)."""
        return self._open_until

    @property
    def reason(self) -> str:
        """Why the gate is closed (or why it closes when its deadline passes)."""
        return self._reason

    @property
    def shut(self) -> bool:
        """Closed until a new registration :meth:`reopen` s it: the registration it
        guarded is not to be trusted any more."""
        return self._shut

    @property
    def held(self) -> str | None:
        """Why the gate stays closed whatever ZooKeeper confirms (see :meth:`hold`)."""
        return self._held

    def age(self) -> float:
        """Seconds since the last confirmed heartbeat was sent."""
        return self._clock() - self.last_contact

    # -- what closes and opens it -----------------------------------------------

    def close(self, reason: str | None = None) -> None:
        """Stop handing out ids at once, until a new registration (:meth:`reopen`); calls
        are told ``reason`` (None: the reason already given). An answer to a heartbeat
        sent before this opens nothing."""
        with self._lock:
            self._closures += 1
            self._shuts += 1
            self._shut = True
            self._open_until = float("-inf")
            if reason is not None:
                self._reason = reason
        self._copy()

    def registering(self) -> int:
        """Note a registration about to start; hand the token to :meth:`reopen`."""
        return self._shuts

    def reopen(self, token: int) -> bool:
        """The registration that began with ``token`` (:meth:`registering`) stands: the
        next confirmation may open the gate. False, and the gate stays shut, if it was
        closed meanwhile (a mark write refused while the worker opened): what closed it
        was about this registration, so it must be made again."""
        with self._lock:
            if self._shuts != token:
                return False
            self._shut = False
            return True

    def hold(self, reason: str | None) -> None:
        """Keep the gate closed for ``reason`` whatever ZooKeeper confirms (None: stop
        holding; the next confirmation opens it)."""
        with self._lock:
            self._held = reason
            if reason is not None:
                self._closures += 1
                self._open_until = float("-inf")
                self._reason = reason
        if reason is not None:
            self._copy()

    def unreachable(self) -> None:
        """ZooKeeper is out of reach (``SUSPENDED``): nothing closes, but once the deadline
        passes calls are told why."""
        with self._lock:
            self._reason = UNREACHABLE

    # -- the native state's copy (see the module docstring) ---------------------------

    def attach(self, state: GeneratorState | None) -> None:
        """Keep ``state``'s gate (a worker's native generator state) the copy of this
        one's from now on, starting with the deadline now; None: stop (``state`` keeps
        the last copy: close the gate before detaching it).

        Native threads compare the copy with CLOCK_BOOTTIME, so only a gate on the default
        clock may feed threads that serve: the node turns native serving off when a clock
        is injected, and tests that attach a gate on a fake clock only read the copy."""
        with self._lock:
            self._native = state
        self._copy()

    @property
    def attached(self) -> GeneratorState | None:
        """The native state whose gate copies this one's (None: none)."""
        return self._native

    def _copy(self) -> None:
        """Write the deadline current now into the attached native state."""
        state = self._native
        if state is None:
            return
        if state.held():
            self._write(state)
        else:
            with state:
                self._write(state)

    def _write(self, state: GeneratorState) -> None:
        # With the state's mutex held, so the newest deadline is what a copy writes.
        until = self._open_until
        if until == float("-inf"):
            state.close()
        else:
            state.set_gate(until)

    # -- the proof --------------------------------------------------------------

    def send(self) -> Heartbeat:
        """Note a heartbeat about to be sent (before the request leaves)."""
        # The clock before the count: a closure between the two makes the answer void
        # (the count moved on), never a proof dated later than it was sent.
        return Heartbeat(self._clock(), self._closures)

    def confirm(self, beat: Heartbeat, timeout_s: float) -> bool:
        """ZooKeeper answered ``beat``: our registration exists and belongs to our
        session, whose timeout is ``timeout_s``. Opens the gate until ``beat.sent +
        0.9 x timeout_s`` unless it was closed since ``beat`` was sent, is shut or is
        held; True if it opened."""
        with self._lock:
            self.last_contact = max(self.last_contact, beat.sent)
            if self._shut or self._held is not None or self._closures != beat.closures:
                return False
            self._open_until = beat.sent + OPEN_FRACTION * timeout_s
            self._reason = UNREACHABLE
        self._copy()
        return True

    def heartbeat(self, client: Any, node: str, granted: GrantedTimeout) -> bool:
        """Read ``node`` (our registration) and :meth:`confirm` what ZooKeeper says.

        False if the registration is gone or another session's (register again); True
        otherwise, whether or not it proved anything (a disconnection since the answer,
        or a session whose granted timeout is not known yet, proves nothing). Kazoo's
        errors, and a silence past ``OP_TIMEOUT_S``, are raised."""
        beat = self.send()
        stat = client.exists_async(node).get(timeout=OP_TIMEOUT_S)
        session = client.client_id
        if stat is not None and session is None:
            return True  # disconnected since it answered: not proven
        timeout = None if session is None else granted.for_session(session[0])
        if stat is not None and timeout is None:
            return True  # another session answered than the one whose timeout we know
        if stat is None or stat.ephemeralOwner != session[0]:
            return False
        assert timeout is not None
        self.confirm(beat, timeout)
        return True
