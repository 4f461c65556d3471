"""``snowflake``: get ids from a server, or decode ids.

    snowflake get [--server HOST:PORT ...] [--count N] [--agent A] [--json]
    snowflake decode [ID ... | -] [--json]
    snowflake zk-acl --zookeeper HOSTS --zk-auth {sasl,digest} --zk-credentials-file FILE
                     [--zk-path PATH] [--zk-read-acl {world,service}] [--dry-run]
                     [--zk-tls-ca FILE [--zk-tls-cert FILE --zk-tls-key FILE]]

``--json`` prints ids as strings: they exceed JavaScript's 2^53. ``decode`` with no ID,
or with ``-``, reads ids from standard input; it decodes every id it can and exits 2
if any could not be.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Iterator, Sequence

from snowflake_thrift_client import (
    DEFAULT_PORT,
    CallFailedError,
    ClockMovedBackwardsError,
    ConfigurationError,
    Discovery,
    Layout,
    NoServerAvailableError,
    RequestError,
    SnowflakePool,
    WrongProtocolError,
    ZooKeeperDiscovery,
    parse_server,
)
from thriftpy2.thrift import TApplicationException

from ._config.options import OPTIONS, in_flags
from ._config.settings import ServerSettings, ZooKeeperAccess
from ._ids.layouts import layout_from, parse_id
from ._version import __version__

__all__ = ["main"]

STDIN = "-"
"""The ``decode`` argument that stands for standard input."""

_LAYOUT_OPTIONS = (
    "epoch",
    "timestamp_bits",
    "datacenter_id_bits",
    "worker_id_bits",
    "sequence_bits",
    "clock_sequence_bits",
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snowflake", description="Get ids from a snowflake server, or decode ids."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    get = commands.add_parser("get", help="print new ids from a server, one per line")
    get.add_argument(
        "--server", action="append", type=_server, metavar="HOST:PORT",
        help="a server to ask; repeat it to fail over to the next ones (default 127.0.0.1:7609)",
    )  # fmt: skip
    get.add_argument(
        "--zookeeper", metavar="HOSTS",
        help="find the servers registered in this ZooKeeper ensemble (cluster mode), "
        "instead of --server",
    )  # fmt: skip
    get.add_argument("--zk-path", default="/snowflake-servers",
                     help="ZooKeeper path of the cluster (default /snowflake-servers)")  # fmt: skip
    get.add_argument("--zk-auth", choices=("none", "sasl", "digest"), default="none",
                     help="how to authenticate to ZooKeeper, as the nodes do "
                     "(default none)")  # fmt: skip
    get.add_argument("--zk-credentials-file", default="", metavar="FILE",
                     help="ZooKeeper credentials (chmod 600), as the nodes have them")  # fmt: skip
    _zk_tls_flags(get)
    get.add_argument("--host", help="server address (default 127.0.0.1), instead of --server")
    get.add_argument("--port", type=int, help=f"server port (default {DEFAULT_PORT})")
    get.add_argument("--transport", choices=("framed", "buffered"), default="framed",
                     help="Thrift transport (default framed)")  # fmt: skip
    get.add_argument(
        "--count",
        type=int,
        default=1,
        help="how many ids, 1..2^sequence_bits: 4096 by default (default 1)",
    )
    get.add_argument("--agent", default="snowflake-cli", help="user agent (default snowflake-cli)")
    get.add_argument("--timeout", type=_seconds, default=5.0,
                     help="seconds to wait for a connection or a reply (default 5)")  # fmt: skip
    get.add_argument("--json", action="store_true", help="print a JSON array of id strings")

    decode = commands.add_parser(
        "decode", help="print the time and parts of ids",
        description="Print the time and parts of ids. With no ID, or with -, read ids "
        "from standard input, separated by spaces or newlines. Every id that can be is "
        "decoded; the exit code is 2 if any could not be.",
    )  # fmt: skip
    decode.add_argument(
        "ids", nargs="*", metavar="ID", help="an id; - or none at all: read standard input"
    )
    decode.add_argument("--json", action="store_true", help="print a JSON array of objects")

    acl = commands.add_parser(
        "zk-acl", help="give the service's ZooKeeper znodes the service's ACL",
        description="Give the znode --zk-path and every znode under it the service's ACL: "
        "only the identity of --zk-credentials-file (and its also = identities) may write, "
        "read as --zk-read-acl says. Run it once every node has credentials; it prints "
        "what it changes, and changes nothing that is right already.",
    )  # fmt: skip
    acl.add_argument("--zookeeper", required=True, metavar="HOSTS", help="ZooKeeper ensemble")
    acl.add_argument("--zk-path", default="/snowflake-servers",
                     help="ZooKeeper path of the cluster (default /snowflake-servers)")  # fmt: skip
    acl.add_argument("--zk-auth", required=True, choices=("sasl", "digest"),
                     help="how to authenticate, as the nodes do")  # fmt: skip
    acl.add_argument("--zk-credentials-file", required=True, metavar="FILE",
                     help="the service's credentials (chmod 600), as the nodes have "
                     "them")  # fmt: skip
    acl.add_argument("--zk-read-acl", choices=("world", "service"), default="world",
                     help="who may read the znodes (default world)")  # fmt: skip
    _zk_tls_flags(acl)
    acl.add_argument("--dry-run", action="store_true", help="print the changes, make none")
    acl.add_argument("--timeout", type=_seconds, default=10.0,
                     help="seconds to connect, and to read and change the ACLs "
                     "(default 10)")  # fmt: skip
    defaults = ServerSettings()
    for option in OPTIONS:
        if option.name in _LAYOUT_OPTIONS:
            decode.add_argument(
                option.flag, dest=option.name, type=option.parse, metavar=option.metavar,
                default=getattr(defaults, option.name),
                help=f"{option.help} (default {getattr(defaults, option.name)})",
            )  # fmt: skip
    return parser


def _server(text: str) -> tuple[str, int]:
    try:
        return parse_server(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _servers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[str, int]]:
    if args.server and (args.host is not None or args.port is not None):
        parser.error("give either --server or --host/--port, not both")
    if args.zookeeper and (args.server or args.host is not None or args.port is not None):
        parser.error("give either --zookeeper or --server/--host/--port, not both")
    if args.server:
        return list(args.server)
    host = "127.0.0.1" if args.host is None else args.host
    try:
        return [parse_server((host, DEFAULT_PORT if args.port is None else args.port))]
    except ValueError as e:
        parser.error(str(e))


_TLS_HINT = (
    "snowflake get speaks plain Thrift: is this a TLS port (a server's --tls-cert, or the "
    "admin endpoint's --web-config-file)?"
)


def _explain(address: str, failure: Exception, transport: str) -> str:
    if isinstance(failure, WrongProtocolError):
        if failure.protocol == "HTTP":
            hint = "is this the HTTP API or the admin (metrics) port?"
        elif failure.protocol == "TLS":
            return f"{failure.address}: {failure.reason}: {_TLS_HINT}"
        else:
            hint = "is this the snowflake server's port?"
        return f"{failure.address}: {failure.reason}: {hint} Thrift is on {DEFAULT_PORT} by default"
    if isinstance(failure, CallFailedError):
        if not failure.connected:
            return f"cannot reach {failure.address}: {failure.reason}"
        if failure.timed_out:
            return f"no reply in time from {failure.address}"
        if isinstance(failure.__cause__, TApplicationException):
            return f"error from {failure.address}: {failure.reason}"
        if _speaks_tls(failure.address):
            return f"{failure.address}: a TLS server closed the connection: {_TLS_HINT}"
        hint = f"does it speak --transport {transport}?"
        return f"no valid reply from {failure.address} ({hint}): {failure.reason}"
    name = "InvalidSystemClock" if isinstance(failure, ClockMovedBackwardsError) else None
    return f"{address} refused: {name or type(failure).__name__}: {failure}"


@functools.cache
def _speaks_tls(address: str) -> bool:
    """Whether a TLS handshake with ``address`` gets a TLS server's answer, within a
    second: a TLS server sent plain Thrift bytes mostly closes without a word."""
    import socket
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking what answers, trusting nothing
    try:
        host, port = parse_server(address)
        with (
            socket.create_connection((host, port), timeout=1.0) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as e:  # an alert (a client certificate required, say) is TLS too
        return "ALERT" in (e.reason or "")
    except (OSError, ValueError):
        return False


def _get(args: argparse.Namespace, servers: list[tuple[str, int]]) -> int:
    # Failures are reported below, once; the pool's and kazoo's own logs would repeat them.
    quiet = [logging.getLogger(name) for name in ("snowflake_thrift_client", "kazoo")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        if not args.zookeeper:
            return _get_from(args, servers)
        _zk_access(args, args.zk_auth, args.zk_credentials_file)  # the TLS flags, as the server
        with ZooKeeperDiscovery(
            args.zookeeper, args.zk_path, timeout=args.timeout, auth=args.zk_auth,
            credentials_file=args.zk_credentials_file, tls_ca=args.zk_tls_ca,
            tls_cert=args.zk_tls_cert, tls_key=args.zk_tls_key,
        ) as found:  # fmt: skip
            return _get_from(args, found)
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


def _zk_tls_flags(command: argparse.ArgumentParser) -> None:
    """The ``--zk-tls-*`` flags, as the server's: every command that reaches ZooKeeper."""
    for flag, what in (
        ("--zk-tls-ca", "reach ZooKeeper over TLS, trusting this CA (PEM), as the server's flag"),
        ("--zk-tls-cert", "client certificate (PEM) to present to ZooKeeper"),
        ("--zk-tls-key", "the key of --zk-tls-cert (PEM)"),
    ):
        command.add_argument(flag, default="", metavar="FILE", help=what)


def _zk_access(
    args: argparse.Namespace, auth: str, credentials_file: str, read_acl: str = "world"
) -> ZooKeeperAccess:
    """The ZooKeeper access of a command's flags, checked as the server checks its own
    (the same words): a half-given TLS setting or a TLS file that cannot be loaded is a
    ``ConfigurationError`` (exit 2), not a connection in the clear or a time-out."""
    from ._cluster.zk import check_tls_files

    try:
        access = ZooKeeperAccess(
            auth, credentials_file, read_acl,
            tls_ca=args.zk_tls_ca, tls_cert=args.zk_tls_cert, tls_key=args.zk_tls_key,
        )  # fmt: skip
    except ConfigurationError as e:
        raise ConfigurationError(in_flags(str(e))) from None
    check_tls_files(access)
    return access


def _get_from(args: argparse.Namespace, servers: list[tuple[str, int]] | Discovery) -> int:
    with SnowflakePool(
        servers, agent=args.agent, transport=args.transport, timeout=args.timeout, pool_size=1
    ) as pool:
        try:
            ids = pool.next_ids(args.count) if args.count != 1 else [pool.next_id()]
        except RequestError as e:
            print(f"snowflake get: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        except NoServerAvailableError as e:
            if not e.failures:  # discovery failed: no server was even tried
                print(f"snowflake get: {e}", file=sys.stderr)
                return 1
            seen = set()
            for address, failure in e.failures:
                line = _explain(address, failure, args.transport)
                if line not in seen:
                    seen.add(line)
                    print(f"snowflake get: {line}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps([str(i) for i in ids]))
    else:
        print("\n".join(map(str, ids)))
    return 0


def _zk_acl(args: argparse.Namespace) -> int:
    # Imported here: get and decode need no kazoo.
    from kazoo.client import KazooClient
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError
    from snowflake_thrift_client._zkauth import load_credentials

    from ._cluster.access import check_credentials, lock_tree
    from ._cluster.zk import client_options, describe_zk_error, service_acl
    from ._errors import StartupDeferred

    access = _zk_access(args, args.zk_auth, args.zk_credentials_file, args.zk_read_acl)
    acl = service_acl(access, load_credentials(access.credentials_file))
    client = KazooClient(hosts=args.zookeeper, timeout=args.timeout, **client_options(access))
    try:
        client.start(timeout=args.timeout)
        check_credentials(client, access, args.zk_path, args.timeout)
        changes = lock_tree(client, args.zk_path, acl, args.timeout, dry_run=args.dry_run)
    except (KazooException, KazooTimeoutError, StartupDeferred) as e:
        why = str(e) if isinstance(e, StartupDeferred) else describe_zk_error(e)
        print(f"snowflake zk-acl: error: {why}", file=sys.stderr)
        return 1
    finally:
        client.stop()
        client.close()
    verb = "would set" if args.dry_run else "set"
    for path, old, new in changes:
        print(f"{verb} {path}: {old} -> {new}")
    done = "would change" if args.dry_run else "changed"
    print(f"{done} {len(changes)} znodes under {args.zk_path}; the others had the service's ACL")
    return 0


def _decode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.ids.count(STDIN) > 1:
        parser.error("give - once: standard input can be read only once")
    layout = layout_from(args)
    described = []
    failed = False
    for where, text in _ids_to_decode(args.ids):
        try:
            decoded = _describe(text, layout)
        except _NotAnId as e:
            failed = True
            print(f"snowflake decode: error: {where}{text!r} {e}", file=sys.stderr)
            continue
        if args.json:
            described.append(decoded)
        else:
            # Printed as each comes: a long input needs no memory for its output.
            clock = (
                f"\n  clock seq   {decoded['clock_sequence']}" if layout.clock_sequence_bits else ""
            )
            print(
                f"{decoded['id']}\n  time        {decoded['time']} ({decoded['timestamp_ms']} ms)"
                f"{clock}\n  datacenter  {decoded['datacenter_id']}\n  worker      "
                f"{decoded['worker_id']}\n  sequence    {decoded['sequence']}"
            )
    if args.json:
        print(json.dumps(described))
    return 2 if failed else 0


def _ids_to_decode(ids: list[str]) -> Iterator[tuple[str, str]]:
    """Each id to decode, after where it comes from for an error message: the
    arguments in order, standard input's in place of ``-`` (or alone, with none)."""
    for text in ids or [STDIN]:
        if text != STDIN:
            yield "", text
            continue
        for number, line in enumerate(_stdin_lines(), 1):
            for each in line.split():
                yield f"line {number} of standard input: ", each


def _stdin_lines() -> Iterator[str]:
    stdin = sys.stdin
    if stdin is None:  # started with standard input closed
        raise ConfigurationError("there is no standard input to read ids from")
    if stdin.isatty():
        print("snowflake decode: reading ids from standard input (end with Ctrl-D)",
              file=sys.stderr)  # fmt: skip
    raw = getattr(stdin, "buffer", None)
    if raw is None:  # a text stream with no bytes under it
        yield from stdin
        return
    # Bytes, decoded line by line: a line that is not UTF-8 is refused on its own (its
    # ids show replacement characters), and the lines after it are still read.
    for line in raw:
        yield line.decode("utf-8", errors="replace")


class _NotAnId(Exception):
    """Why a text is not an id, as the end of a sentence that starts with the text."""


def _describe(text: str, layout: Layout) -> dict[str, object]:
    """The parts of the id ``text``, ready for JSON; else ``_NotAnId``."""
    try:
        value = parse_id(text)
    except ConfigurationError as e:
        raise _NotAnId(f"is not an id: {e}") from None
    try:
        return layout.decompose(value).to_json()
    except ConfigurationError as e:
        raise _NotAnId(f"is not an id of this layout: {e}") from None
    except (OverflowError, ValueError) as e:  # a layout whose times pass year 9999
        raise _NotAnId(f"has a time that cannot be shown: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake``."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "get":
            return _get(args, _servers(args, parser))
        if args.command == "zk-acl":
            return _zk_acl(args)
        return _decode(args, parser)
    except ConfigurationError as e:
        print(f"snowflake {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
