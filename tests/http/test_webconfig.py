"""The admin endpoint under a web configuration (--web-config-file, the Prometheus
exporters' format): HTTPS, mutual TLS, basic auth priced by bcrypt, the probes open to
all; and the file checked as promtool checks it."""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import trustme
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.registry import CollectorRegistry

from snowflake_server import ServerSettings, load_settings
from snowflake_server._app import node as node_module
from snowflake_server._app.child import Child
from snowflake_server._app.node_id import configured_origin
from snowflake_server._app.supervisor import Supervisor
from snowflake_server._errors import ConfigurationError
from snowflake_server._http.admin import AdminServer
from snowflake_server._http.webconfig import (
    _HTTP,
    _TLS,
    _TOP,
    BasicAuth,
    WebConfig,
    client_key,
    load_web_config,
)
from snowflake_server._serving.listeners import listen_socket
from tests.support.inprocess import InProcessServer
from tests.support.processes import parse_metrics
from tests.support.waiting import wait_until

PASSWORD = "scrape-me"
# Cost 4: the format is the same as cost 10's, and a test checks many in little time.
# Fixed, not made at import: a salt drawn per process gave each xdist worker other test
# ids (parameters hold it), and pytest-xdist refuses to run then.
HASH = "$2b$04$iyMkM.i/a7Twni0q1bJZJec45VF7qsXgQb5EtP.AMe42bpCb59QTK"
assert bcrypt.checkpw(PASSWORD.encode(), HASH.encode())
HASH13 = "$2b$13$7L5r1iiqYnd5prgn0/.IkOhpZAEybzPpYHH7/nvZpgD4Z8NFWc0WO"  # of "x"


@dataclass
class Pki:
    """The admin endpoint's certificate (server CA), a client CA, and a rogue CA."""

    directory: Path
    server_ca: trustme.CA
    client_ca: trustme.CA
    rogue_ca: trustme.CA

    @classmethod
    def make(cls, directory: Path) -> Pki:
        pki = cls(directory, trustme.CA(), trustme.CA(), trustme.CA())
        cert = pki.server_ca.issue_cert("127.0.0.1")
        cert.cert_chain_pems[0].write_to_path(str(directory / "admin.pem"))
        cert.private_key_pem.write_to_path(str(directory / "admin-key.pem"))
        pki.client_ca.cert_pem.write_to_path(str(directory / "client-ca.pem"))
        return pki

    def context(self, client_cert_from: trustme.CA | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.server_ca.configure_trust(context)
        if client_cert_from is not None:
            client_cert_from.issue_cert("prometheus@example.com").configure_cert(context)
        return context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.make(tmp_path)


def web_config(directory: Path, text: str) -> str:
    path = directory / "web.yml"
    path.write_text(text, encoding="utf-8")
    return str(path)


TLS = "tls_server_config:\n  cert_file: admin.pem\n  key_file: admin-key.pem\n"
MTLS = (
    "tls_server_config:\n  cert_file: admin.pem\n  key_file: admin-key.pem\n"
    "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: client-ca.pem\n"
)
USERS = f"basic_auth_users:\n  prometheus: '{HASH}'\n"


def serve(tmp_path: Path, config: str, **settings: object) -> InProcessServer:
    """A standalone server whose admin endpoint reads ``config`` (the file's text)."""
    return InProcessServer(
        ServerSettings(web_config_file=web_config(tmp_path, config), **settings),  # type: ignore[arg-type]
        tmp_path,
    )


def get(
    server: InProcessServer,
    path: str,
    context: ssl.SSLContext | None = None,
    auth: tuple[str, str] | None = None,
    source: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """``GET path`` of the admin endpoint: its status, headers and body (from the
    loopback address ``source``, if given)."""
    bind = None if source is None else (source, 0)
    if context is None:
        connection: http.client.HTTPConnection = http.client.HTTPConnection(
            "127.0.0.1", server.metrics_port, timeout=5, source_address=bind
        )
    else:
        connection = http.client.HTTPSConnection(
            "127.0.0.1", server.metrics_port, timeout=5, context=context, source_address=bind
        )
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    with contextlib.closing(connection):
        connection.request("GET", path, headers=headers)
        answer = connection.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()


def test_the_admin_endpoint_serves_https(tmp_path: Path, pki: Pki) -> None:
    with serve(tmp_path, TLS + "http_server_config: {headers: {X-Frame-Options: deny}}\n") as s:
        status, headers, body = get(s, "/metrics", pki.context())
        assert status == 200 and b"snowflake_info" in body
        assert headers["X-Frame-Options"] == "deny"
        assert get(s, "/readyz", pki.context())[0] == 200
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            get(s, "/readyz")  # plain HTTP to a TLS port: no answer
        assert s.node.admin_scheme == "https"


def test_basic_auth_guards_all_but_the_probes(tmp_path: Path) -> None:
    with serve(tmp_path, USERS) as s:
        status, headers, _ = get(s, "/metrics")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        assert get(s, "/metrics", auth=("prometheus", "wrong"))[0] == 401
        assert get(s, "/metrics", auth=("nobody", PASSWORD))[0] == 401
        assert get(s, "/nowhere")[0] == 401  # what exists is not told either
        status, _, body = get(s, "/metrics", auth=("prometheus", PASSWORD))
        assert status == 200 and b"snowflake_info" in body
        for probe in ("/livez", "/readyz", "/health"):
            assert get(s, probe)[0] == 200, probe
        denied = parse_metrics(get(s, "/metrics", auth=("prometheus", PASSWORD))[2].decode())
        assert denied['snowflake_admin_requests_denied_total{reason="no_credentials"}'] == 2
        assert denied['snowflake_admin_requests_denied_total{reason="wrong_credentials"}'] == 2


def test_mutual_tls_with_basic_auth(tmp_path: Path, pki: Pki) -> None:
    with serve(tmp_path, MTLS + USERS) as s:
        with_cert = pki.context(client_cert_from=pki.client_ca)
        right = ("prometheus", PASSWORD)
        assert get(s, "/metrics", with_cert, right)[0] == 200
        assert get(s, "/metrics", with_cert)[0] == 401
        # No certificate: the handshake completes (the probes need it), the rest is 403.
        status, _, body = get(s, "/metrics", pki.context(), right)
        assert status == 403 and b"client_certificate_required" in body
        assert get(s, "/livez", pki.context())[0] == 200
        assert get(s, "/readyz", pki.context())[0] == 200
        # A certificate of another CA fails the handshake, probe or not.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            get(s, "/livez", pki.context(client_cert_from=pki.rogue_ca))
        counts = parse_metrics(get(s, "/metrics", with_cert, right)[2].decode())
        assert counts['snowflake_admin_requests_denied_total{reason="no_certificate"}'] == 1
        assert counts['snowflake_admin_connections_rejected_total{reason="tls"}'] >= 1


@pytest.mark.slow
def test_password_checks_are_remembered_and_throttled(tmp_path: Path) -> None:
    """One bcrypt check per second allowed: a scraper that passed once is let in from
    memory, while a guesser's concurrent tries are told to wait (429) instead of burning
    the CPU: one address has one check running or waiting at a time."""
    right = ("prometheus", PASSWORD)
    settings_ = ServerSettings(web_config_file=web_config(tmp_path, USERS))
    with InProcessServer(settings_, tmp_path) as s:
        admin = s.node.admin
        assert admin is not None
        admin.checks_per_s = 1.0  # one check, then one a second
        admin.reload(load_web_config(settings_.web_config_file))
        assert get(s, "/metrics", auth=right)[0] == 200  # the one check
        with ThreadPoolExecutor(5) as pool:
            tries = [("prometheus", f"guess{i}") for i in range(5)]
            statuses = list(pool.map(lambda auth: get(s, "/metrics", auth=auth)[0], tries))
        assert statuses.count(429) >= 4, statuses  # at most one waited its turn (401)
        for _ in range(5):
            assert get(s, "/metrics", auth=right)[0] == 200  # remembered: no check
        assert admin.denied["throttled"] >= 4


def starts(auth: BasicAuth, client: str) -> bool:
    """Whether a check for ``client`` starts at once: asked, and started by the dispatch
    that follows, as the admin endpoint does (with ``wait_s=0`` one not started then is
    turned away)."""
    return auth.ask(client) and client_key(client) in auth.dispatch()[0]


def test_the_token_bucket_refills_with_time() -> None:
    now = [0.0]
    auth = BasicAuth(
        {"u": HASH.encode()},
        checks_per_s=2.0,
        client_checks_per_s=100.0,
        wait_s=0,
        clock=lambda: now[0],
    )

    def tries(n: int) -> list[bool]:
        allowed = [starts(auth, f"10.0.0.{i}") for i in range(n)]
        for i in range(n):
            auth.checked(f"10.0.0.{i}")
        return allowed

    assert tries(3) == [True, True, False]
    now[0] = 0.5
    assert tries(2) == [True, False]
    now[0] = 100.0  # a long quiet time refills the burst, no more
    assert tries(3) == [True, True, False]


def test_a_flooding_address_spends_its_own_budget_not_anothers() -> None:
    """Finding 5: wrong passwords from one address, as fast as it likes, leave another
    address (Prometheus) its checks; each address has one check in flight at most."""
    now = [0.0]
    auth = BasicAuth({"u": HASH.encode()}, wait_s=0, clock=lambda: now[0])
    attacker, prometheus = "192.0.2.66", "198.51.100.9"
    allowed = []
    for _ in range(1000):
        allowed.append(starts(auth, attacker))
        auth.checked(attacker)
    assert allowed.count(True) == 3  # its burst, then its rate: no time passed
    assert starts(auth, prometheus)  # not 429
    assert not auth.ask(prometheus)  # its first check is still running
    auth.checked(prometheus)
    for step in range(1, 61):  # a minute of flooding, ten tries every 100 ms
        now[0] = step / 10
        for _ in range(10):
            if starts(auth, attacker):
                allowed.append(True)
                auth.checked(attacker)
    assert allowed.count(True) <= 3 + 60 + 1  # one a second: the global cap is untouched
    assert starts(auth, prometheus)
    auth.checked(prometheus)
    # Another address of the attacker's IPv6 /64 is the same client.
    assert starts(auth, "2001:db8::1")
    assert not auth.ask("2001:db8::2")  # in flight: the /64's one
    assert starts(auth, "::ffff:198.51.100.9")  # Prometheus over IPv4-mapped IPv6


def test_password_checks_running_are_bounded() -> None:
    """At most max_pending checks run at once; the next waits for one to end."""
    auth = BasicAuth({"u": HASH.encode()}, checks_per_s=100.0, max_pending=3, clock=lambda: 0.0)
    assert [auth.ask(f"10.0.0.{i}") for i in range(5)] == [True] * 5
    assert auth.dispatch() == (["10.0.0.0", "10.0.0.1", "10.0.0.2"], [])
    assert (auth.pending, auth.waiting) == (3, 2)
    assert auth.next_event() == 1.0  # no token is due: only the waits' end
    auth.checked("10.0.0.0")
    assert auth.dispatch() == (["10.0.0.3"], [])


class _Flood:
    """Addresses asking for checks on a clock of its own: each ends 50 ms after it
    starts, and asks again at once while flooding (one a second: its own budget)."""

    def __init__(self, auth: BasicAuth, now: list[float]) -> None:
        self.auth, self.now = auth, now
        self.running: dict[str, float] = {}  # client -> when its check ends
        self.started: list[tuple[float, str]] = []
        self.turned_away: list[tuple[float, str]] = []

    def step(self, flooding: list[str], dt: float = 0.01) -> None:
        self.now[0] = round(self.now[0] + dt, 6)
        for client, ends in list(self.running.items()):
            if ends <= self.now[0]:
                del self.running[client]
                self.auth.checked(client)
        for client in flooding:
            if client not in self.running:
                self.auth.ask(client)
        self.dispatch()

    def dispatch(self) -> None:
        started, away = self.auth.dispatch()
        for client in started:
            self.running[client] = self.now[0] + 0.05
            self.started.append((self.now[0], client))
        self.turned_away += [(self.now[0], client) for client in away]


def test_a_quiet_address_gets_its_check_while_many_addresses_guess() -> None:
    """Eight addresses guessing at once (eight checks a second wanted, six allowed) kept
    the global budget empty, and a scraper whose password was not remembered yet got
    429 for as long as the flood lasted (measured: 15 of 15). Now it waits its turn and
    goes first: it has not checked lately, the guessers have."""
    now = [0.0]
    auth = BasicAuth({"u": HASH.encode()}, clock=lambda: now[0])
    flood = _Flood(auth, now)
    attackers = [f"192.0.2.{i}" for i in range(1, 9)]
    while now[0] < 10:
        flood.step(attackers)
    assert flood.turned_away, "the flood wanted more than the global budget"
    assert {c for _, c in flood.started} == set(attackers)
    asked = now[0]
    assert auth.ask("198.51.100.9")
    flood.dispatch()
    while not any(c == "198.51.100.9" for _, c in flood.started):
        flood.step(attackers)
        assert not any(c == "198.51.100.9" for _, c in flood.turned_away)
    # The next global token: six a second.
    assert now[0] - asked <= 1 / 6 + 0.011
    rate = sum(1 for t, _ in flood.started if t > 5) / (now[0] - 5)
    assert rate <= 6.5, "the global budget held"


def test_waiting_is_bounded_and_a_newcomer_ranks_by_its_last_check() -> None:
    now = [0.0]
    auth = BasicAuth(
        {"u": HASH.encode()},
        checks_per_s=1.0,
        max_pending=2,
        max_waiting=2,
        wait_s=2.0,
        clock=lambda: now[0],
    )
    assert auth.ask("10.0.0.1") and auth.dispatch() == (["10.0.0.1"], [])
    auth.checked("10.0.0.1")
    now[0] = 3.0
    assert auth.ask("10.0.0.1") and auth.dispatch() == (["10.0.0.1"], [])  # the burst: 1
    auth.checked("10.0.0.1")
    now[0] = 3.5
    assert auth.ask("10.0.0.1") and auth.ask("10.0.0.2")  # both wait: no global token
    assert auth.dispatch() == ([], [])
    assert not auth.ask("10.0.0.1")  # one wait at a time
    # The waiting room is full: a never-seen address takes the place of the one that
    # checked last; one that checked as recently is refused.
    assert auth.ask("10.0.0.3")
    assert auth.dispatch() == ([], ["10.0.0.1"])
    assert not auth.ask("10.0.0.5")  # never seen either: it ranks no better, refused
    assert auth.next_event() == 4.0  # the next token
    now[0] = 4.0
    assert auth.dispatch() == (["10.0.0.2"], [])  # arrival order among the never-seen
    now[0] = 4.5
    assert auth.next_event() == 4.5 + 0.5
    now[0] = 5.0
    assert auth.dispatch() == (["10.0.0.3"], [])
    assert auth.next_event() is None
    # A wait ends at its deadline, turned away: the two checks still run.
    assert auth.ask("10.0.0.4")
    assert auth.next_event() == 7.0
    now[0] = 7.0
    assert auth.dispatch() == ([], ["10.0.0.4"])


def test_the_clients_remembered_are_bounded_and_a_forgotten_one_ranks_as_new() -> None:
    """At most max_clients buckets and start times are kept (the least recent go first):
    memory is bounded whatever the number of addresses, at the price the docstring says."""
    now = [0.0]
    auth = BasicAuth({"u": HASH.encode()}, checks_per_s=1.0, max_clients=1, clock=lambda: now[0])
    for client in ("10.0.0.1", "10.0.0.2"):  # the second pushes the first out
        assert auth.ask(client)
        now[0] += 1.0
        assert auth.dispatch() == ([client], [])
        auth.checked(client)
    now[0] += 0.5
    assert auth.ask("10.0.0.1") and auth.ask("10.0.0.3")  # both wait for the next token
    now[0] += 0.5
    # Remembered, 10.0.0.1 would rank after the never-seen 10.0.0.3; forgotten, it ties
    # with it and goes first, having asked first.
    assert auth.dispatch() == (["10.0.0.1"], [])


def test_a_flood_of_wrong_passwords_does_not_lock_prometheus_out(tmp_path: Path) -> None:
    """Finding 5, over sockets: 127.0.0.2 floods wrong passwords (no time passes: the
    buckets' clock is frozen); Prometheus on 127.0.0.1 still gets in with the right one
    (before, one bucket for everyone: 429)."""
    settings_ = ServerSettings(web_config_file=web_config(tmp_path, USERS))
    with InProcessServer(settings_, tmp_path) as s:
        admin = s.node.admin
        assert admin is not None
        admin.clock = lambda: 0.0
        admin.reload(load_web_config(settings_.web_config_file))
        attacker = [
            get(s, "/metrics", auth=("prometheus", f"guess{i}"), source="127.0.0.2")[0]
            for i in range(20)
        ]
        assert attacker.count(429) >= 17, attacker
        assert get(s, "/metrics", auth=("prometheus", PASSWORD), source="127.0.0.1")[0] == 200
        assert get(s, "/metrics", auth=("prometheus", PASSWORD), source="127.0.0.1")[0] == 200


@pytest.mark.slow
def test_many_guessing_addresses_do_not_lock_a_new_scraper_out(tmp_path: Path) -> None:
    """Over sockets, on the real clock: eight addresses (127.0.0.2-9) guess wrong
    passwords flat out, more checks than the budget allows; Prometheus from 127.0.0.1,
    its password not remembered yet, waits its turn and gets in (before: 429 as long as
    the flood lasted, 15 scrapes of 15 measured)."""
    settings_ = ServerSettings(web_config_file=web_config(tmp_path, USERS))
    stop = threading.Event()
    with InProcessServer(settings_, tmp_path) as s:
        admin = s.node.admin
        assert admin is not None

        def guess(source: str) -> None:
            for i in itertools.count():
                if stop.is_set():
                    return
                get(s, "/metrics", auth=("prometheus", f"guess{i}"), source=source)

        with ThreadPoolExecutor(8) as pool:
            for n in range(2, 10):
                pool.submit(guess, f"127.0.0.{n}")
            try:
                # The budget is spent and guessers are being turned away.
                wait_until(lambda: admin.denied["throttled"] >= 20, "the guessers throttled", 20)
                scrapes = [get(s, "/metrics", auth=("prometheus", PASSWORD), source="127.0.0.1")[0]]
                scrapes.append(get(s, "/metrics", auth=("prometheus", PASSWORD))[0])
            finally:
                stop.set()
        assert scrapes == [200, 200]  # the second one remembered


def test_credentials_are_checked_and_remembered_by_digest() -> None:
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert auth.credentials("Basic " + base64.b64encode(b"prometheus:a:b").decode()) == (
        "prometheus",
        b"a:b",
    )
    for bad in (None, "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"nocolon").decode()):
        assert auth.credentials(bad) is None
    assert not auth.check("prometheus", b"x" * 100)  # beyond bcrypt's 72 bytes: refused
    assert not auth.check("nobody", PASSWORD.encode())
    assert auth.check("prometheus", PASSWORD.encode())
    assert not auth.remembered("prometheus", PASSWORD.encode())
    auth.remember("prometheus", PASSWORD.encode())
    assert auth.remembered("prometheus", PASSWORD.encode())
    assert not auth.remembered("prometheus", b"other")


def test_sighup_takes_a_new_web_configuration(tmp_path: Path, pki: Pki) -> None:
    path = web_config(tmp_path, USERS)
    with InProcessServer(ServerSettings(web_config_file=path), tmp_path) as s:
        assert get(s, "/metrics")[0] == 401
        Path(path).write_text("tls_server_config: {cert_file: nothere.pem, key_file: x}\n")
        s.node.reload()  # a file that does not load: the old one stays
        assert get(s, "/metrics")[0] == 401
        Path(path).write_text(TLS, encoding="utf-8")
        s.node.reload()
        assert get(s, "/metrics", pki.context())[0] == 200  # HTTPS now, and no users


def test_a_bad_web_configuration_stops_the_start(tmp_path: Path) -> None:
    server = serve(tmp_path, "basic_auth_users: {prometheus: plaintext}\n")
    with pytest.raises(ConfigurationError, match=r"basic_auth_users.prometheus: not a bcrypt"):
        server.start()


# Each file: whether promtool check web-config (Prometheus 2.42) accepts it, and whether
# this server does (the same, but for the two cases the module's docstring gives).
CASES = [
    ("", True, True),
    ("tls_server_config: {}", True, True),
    (TLS, True, True),
    (MTLS, True, True),
    (MTLS.replace("RequireAndVerifyClientCert", "VerifyClientCertIfGiven"), True, True),
    (TLS + "  min_version: TLS13\n  max_version: TLS13", True, True),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, min_version: TLS13, "
     "max_version: TLS12}", True, False),
    (MTLS.replace("RequireAndVerifyClientCert", "RequireAnyClientCert"), True, False),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, cipher_suites: "
     "[TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256], curve_preferences: "
     "[X25519], prefer_server_cipher_suites: false}", True, True),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, curve_preferences: "
     "[CurveP256, CurveP384]}", True, True),
    ("http_server_config: {http2: false, headers: {X-Content-Type-Options: nosniff}}",
     True, True),
    (USERS, True, True),
    (TLS + USERS, True, True),
    ("tls_server_config: {cert_file: admin.pem}", False, False),
    ("tls_server_config: {key_file: admin-key.pem}", False, False),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, bogus: 1}",
     False, False),
    ("bogus: 1", False, False),
    ("rate_limit: {}", False, False),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, client_auth_type: "
     "Foo}", False, False),
    ("tls_server_config: {cert_file: admin.pem, key_file: admin-key.pem, client_ca_file: "
     "client-ca.pem}", False, False),
    (TLS + "  min_version: TLS14", False, False),
    (TLS + "  min_version: 12", False, False),
    (TLS + "  cipher_suites: [TLS_FOO]", False, False),
    (TLS + "  curve_preferences: [Foo]", False, False),
    (TLS + "  client_allowed_sans: [a]", False, False),
    ("tls_server_config: {cert_file: nothere.pem, key_file: admin-key.pem}", False, False),
    ("tls_server_config: {cert_file: admin-key.pem, key_file: admin.pem}", False, False),
    ("basic_auth_users: {prometheus: notahash}", False, False),
    ("basic_auth_users: {prometheus: 1}", False, False),
    ("basic_auth_users: prometheus", False, False),
    ("http_server_config: {headers: {X-Frame-Options: bogus}}", False, False),
    ("http_server_config: {headers: {X-Foo: bar}}", False, False),
    ("http_server_config: {headers: {x-frame-options: deny}}", False, False),
    ("tls_server_config: [a]", False, False),
    ("tls_server_config: {cert_file: [a], key_file: b}", False, False),
    # Finding 4: wrong types and depths are configuration errors, never a crash.
    (TLS + "  min_version: [TLS12]", False, False),
    (TLS + "  max_version: {TLS13: 1}", False, False),
    (TLS + "  client_auth_type: [RequireAndVerifyClientCert]", False, False),
    (TLS + "  cipher_suites: {a: 1}", False, False),
    (TLS + "  prefer_server_cipher_suites: 1", False, False),
    ("http_server_config: {headers: {X-Frame-Options: [deny]}}", False, False),
    ("http_server_config: {http2: [true]}", False, False),
    ("tls_server_config: " + "[" * 20000 + "]" * 20000, False, False),
    ("tls_server_config:\n  cert_file: " + "{a: " * 3000 + "1" + "}" * 3000, False, False),
    # Finding 9(b): a client CA is needed to verify client certificates (Go would take
    # the system's roots).
    (TLS + "  client_auth_type: RequireAndVerifyClientCert", True, False),
    (TLS + "  client_auth_type: VerifyClientCertIfGiven", True, False),
    # Finding 5: a cost above 12 is refused (Go takes up to 31).
    (f"basic_auth_users: {{prometheus: '{HASH.replace('$04$', '$12$')}'}}", True, True),
    (f"basic_auth_users: {{prometheus: '{HASH13}'}}", True, False),
]  # fmt: skip


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool (Debian's prometheus) is unpacked into .tools/ by `make test`"
    return found


@pytest.mark.parametrize(("text", "promtool_accepts", "accepted"), CASES)
def test_the_file_is_checked_as_promtool_checks_it(
    tmp_path: Path, pki: Pki, text: str, promtool_accepts: bool, accepted: bool
) -> None:
    """Our loader on each case of the table (promtool's own verdict on it: the next test)."""
    path = web_config(tmp_path, text + "\n")
    if accepted:
        load_web_config(path)
    else:
        with pytest.raises(ConfigurationError, match=r"--web-config-file .*web\.yml: "):
            load_web_config(path)


@pytest.mark.slow  # a promtool process per case: half a second each
@pytest.mark.parametrize(("text", "promtool_accepts", "accepted"), CASES)
def test_promtool_judges_each_case_as_the_table_says(
    tmp_path: Path, pki: Pki, text: str, promtool_accepts: bool, accepted: bool
) -> None:
    path = web_config(tmp_path, text + "\n")
    checked = subprocess.run(
        [promtool(), "check", "web-config", path],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (checked.returncode == 0) == promtool_accepts, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (TLS + "  min_version: [TLS12]", r"min_version: unknown TLS version \['TLS12'\]"),
        (TLS + "  client_auth_type: RequireAndVerifyClientCert", r"needs client_ca_file"),
        (TLS + "  client_auth_type: VerifyClientCertIfGiven", r"needs client_ca_file"),
        (f"basic_auth_users: {{prometheus: '{HASH13}'}}", r"cost 13 is above 12: each check"),
        ("tls_server_config: " + "[" * 20000 + "]" * 20000, r"nested too deeply"),
    ],
)
def test_what_is_refused_is_said(tmp_path: Path, pki: Pki, text: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=r"--web-config-file .*web\.yml: .*" + says):
        load_web_config(web_config(tmp_path, text + "\n"))


# Values a file may hold where the loader expects others: every YAML type, nested.
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
    st.text(max_size=12), st.sampled_from(["TLS12", "TLS13", "admin.pem", "admin-key.pem",
    "client-ca.pem", "RequireAndVerifyClientCert", "VerifyClientCertIfGiven", "X25519",
    "TLS_AES_128_GCM_SHA256", "X-Frame-Options", "deny", HASH, HASH13, "\0"]),
)  # fmt: skip
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.one_of(st.text(max_size=8), _SCALARS), inner, max_size=3)
    ),
    max_leaves=12,
)
_KEYS = sorted(_TOP | _TLS | _HTTP | {"headers", "prometheus"})
# Mostly the files a mistake makes: a working TLS pair beside a value of the wrong kind
# (a working pair reaches every later check), else anything under any known key.
_SECTIONS = {
    "tls_server_config": st.fixed_dictionaries(
        {"cert_file": st.just("admin.pem"), "key_file": st.just("admin-key.pem")},
        optional=dict.fromkeys(sorted(_TLS - {"cert_file", "key_file"}), _VALUES),
    ),
    "http_server_config": st.fixed_dictionaries(
        {}, optional={"http2": _VALUES, "headers": st.dictionaries(_SCALARS, _VALUES)}
    ),
    "basic_auth_users": st.dictionaries(_SCALARS, _VALUES, max_size=3),
}
_DOCUMENTS = (
    st.fixed_dictionaries({}, optional={k: v | _VALUES for k, v in _SECTIONS.items()})
    | st.dictionaries(
        st.sampled_from(sorted(_TOP)),
        st.one_of(_VALUES, st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6)),
        max_size=3,
    )
    | _VALUES
)


@pytest.mark.slow  # 300 documents: about 1.7 s
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(document=_DOCUMENTS)
def test_any_yaml_document_is_loaded_or_a_configuration_error(document: object) -> None:
    """Finding 4: whatever the file holds, the loader answers a WebConfig or a
    ConfigurationError, never another exception (a traceback and exit 1 at start, the
    other reload steps skipped on SIGHUP)."""
    with tempfile.TemporaryDirectory() as directory:
        Pki.make(Path(directory))
        path = web_config(Path(directory), yaml.safe_dump(document))
        with contextlib.suppress(ConfigurationError):
            load_web_config(path)


def test_a_mistyped_web_configuration_stops_the_start(tmp_path: Path, pki: Pki) -> None:
    server = serve(tmp_path, TLS + "  min_version: [TLS12]\n")
    with pytest.raises(ConfigurationError, match=r"min_version: unknown TLS version"):
        server.start()


def test_sighup_with_a_mistyped_web_configuration_still_reopens_the_audit_log(
    tmp_path: Path,
) -> None:
    """Finding 4: a file that does not load keeps the old settings, and the other
    reload steps (here the audit log's reopen) still run."""
    path = web_config(tmp_path, USERS)
    audit = tmp_path / "audit.log"
    with InProcessServer(ServerSettings(web_config_file=path, audit_log=str(audit)), tmp_path) as s:
        assert get(s, "/metrics")[0] == 401
        audit.rename(tmp_path / "audit.log.1")  # log rotation
        Path(path).write_text(USERS + TLS + "  min_version: [TLS12]\n", encoding="utf-8")
        s.node.reload()
        assert audit.exists(), "the audit log was not reopened"
        assert get(s, "/metrics")[0] == 401  # the old settings: plain HTTP, users


def test_a_reload_step_that_fails_does_not_stop_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a step raises (here a fault injected into the web configuration's
    loader), it is logged and the next steps run."""
    path = web_config(tmp_path, USERS)
    audit = tmp_path / "audit.log"
    with InProcessServer(ServerSettings(web_config_file=path, audit_log=str(audit)), tmp_path) as s:

        def broken(path: str) -> WebConfig:
            raise ZeroDivisionError("an unforeseen fault")

        monkeypatch.setattr(node_module, "load_web_config", broken)
        audit.rename(tmp_path / "audit.log.1")
        s.node.reload()
        assert audit.exists(), "the audit log was not reopened"
        assert "reloading the admin endpoint's web configuration failed" in caplog.text
        assert get(s, "/metrics")[0] == 401


def test_the_supervisors_processes_get_sighup_when_its_web_configuration_fails(
    tmp_path: Path,
) -> None:
    """Finding 4 in the supervisor: its admin endpoint's file does not load, yet every
    process still gets its SIGHUP (before: the exception ended the handler first)."""
    path = web_config(tmp_path, USERS)
    settings_ = load_settings(["--worker-id", "3", "--web-config-file", path], {})
    admin = AdminServer(
        CollectorRegistry(),
        settings_.admin,
        ready=lambda: (None, {}),
        live=lambda: None,
        bound=listen_socket("127.0.0.1", 0, reuse_port=False),
        web=load_web_config(path),
    )
    supervisor = Supervisor(settings_, admin=admin)
    child = Child(0, settings_, configured_origin(settings_))
    supervisor.adopt(child)
    # A child that SIGHUP ends even under nohup (which leaves it ignored for whatever the
    # run starts): the default action restored, and said so, before the reload.
    process = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGHUP, "
         "signal.SIG_DFL); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child.process = process
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        Path(path).write_text(TLS + "  min_version: [TLS12]\n", encoding="utf-8")
        supervisor.reload()
        assert process.wait(5) == -signal.SIGHUP
        assert admin.web.users  # the old settings kept
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
        admin.stop()


def test_a_curve_this_python_cannot_set_leaves_openssl_s_order(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Debian 12's Python (3.11.2) sets only NIST curves: `curve_preferences: [X25519]`,
    which promtool accepts, stopped the start there (EC: UNKNOWN_GROUP)."""

    def nist_only(self: ssl.SSLContext, name: str) -> None:
        raise ssl.SSLError(1, "[EC: UNKNOWN_GROUP] unknown group")

    monkeypatch.setattr(ssl.SSLContext, "set_ecdh_curve", nist_only)
    path = web_config(tmp_path, TLS + "  curve_preferences: [X25519]\n")
    assert load_web_config(path).scheme == "https"
    assert "curve_preferences X25519 cannot be set" in caplog.text
