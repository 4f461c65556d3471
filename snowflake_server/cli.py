"""``snowflake``: get ids from a server, or decode ids.

    snowflake get [--host H] [--port P] [--count N] [--agent A] [--json]
    snowflake decode ID [ID ...] [--json]

``--json`` prints ids as strings: they exceed JavaScript's 2^53.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from thriftpy2.thrift import TException
from thriftpy2.transport import TTransportException

from .client import SnowflakeClient
from .config import OPTIONS, ServerSettings
from .errors import ConfigurationError
from .generator import DecodedId, Layout

__all__ = ["main"]

_LAYOUT_OPTIONS = (
    "epoch",
    "timestamp_bits",
    "datacenter_id_bits",
    "worker_id_bits",
    "sequence_bits",
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="snowflake", description="Get ids from a snowflake server, or decode ids."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    get = commands.add_parser("get", help="print new ids from a server, one per line")
    get.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    get.add_argument("--port", type=int, default=7609, help="server port (default 7609)")
    get.add_argument("--transport", choices=("framed", "buffered"), default="framed",
                     help="Thrift transport (default framed)")  # fmt: skip
    get.add_argument(
        "--count",
        type=int,
        default=1,
        help="how many ids, 1..2^sequence_bits: 4096 by default (default 1)",
    )
    get.add_argument("--agent", default="snowflake-cli", help="user agent (default snowflake-cli)")
    get.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    get.add_argument("--json", action="store_true", help="print a JSON array of id strings")

    decode = commands.add_parser("decode", help="print the time and parts of ids")
    decode.add_argument("ids", nargs="+", metavar="ID")
    decode.add_argument("--json", action="store_true", help="print a JSON array of objects")
    defaults = ServerSettings()
    for option in OPTIONS:
        if option.name in _LAYOUT_OPTIONS:
            decode.add_argument(
                option.flag, dest=option.name, type=option.parse, metavar=option.metavar,
                default=getattr(defaults, option.name),
                help=f"{option.help} (default {getattr(defaults, option.name)})",
            )  # fmt: skip
    return parser


def _get(args: argparse.Namespace) -> int:
    with SnowflakeClient(
        args.host, args.port, agent=args.agent, transport=args.transport, timeout=args.timeout
    ) as client:
        try:
            ids = client.next_ids(args.count) if args.count != 1 else [client.next_id()]
        except TTransportException as e:
            if e.type == TTransportException.NOT_OPEN:
                print(f"snowflake get: cannot reach {args.host}:{args.port}: {e}", file=sys.stderr)
            else:
                hint = f"does it speak --transport {args.transport}?"
                print(f"snowflake get: no valid reply from {args.host}:{args.port} ({hint}): {e}",
                      file=sys.stderr)  # fmt: skip
            return 1
        except OSError as e:
            print(f"snowflake get: cannot reach {args.host}:{args.port}: {e}", file=sys.stderr)
            return 1
        except TException as e:
            message = getattr(e, "message", None) or str(e)
            print(f"snowflake get: {type(e).__name__} from {args.host}:{args.port}: {message}",
                  file=sys.stderr)  # fmt: skip
            return 1
    if args.json:
        print(json.dumps([str(i) for i in ids]))
    else:
        print("\n".join(map(str, ids)))
    return 0


def _describe(decoded: DecodedId) -> dict[str, object]:
    moment = decoded.datetime.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {
        "id": str(decoded.id),
        "time": moment,
        "timestamp_ms": decoded.timestamp_ms,
        "datacenter_id": decoded.datacenter_id,
        "worker_id": decoded.worker_id,
        "sequence": decoded.sequence,
    }


def _decode(args: argparse.Namespace) -> int:
    layout = Layout(
        epoch_ms=args.epoch,
        timestamp_bits=args.timestamp_bits,
        datacenter_id_bits=args.datacenter_id_bits,
        worker_id_bits=args.worker_id_bits,
        sequence_bits=args.sequence_bits,
    )
    described = []
    for text in args.ids:
        try:
            described.append(_describe(layout.decompose(int(text))))
        except (ValueError, ConfigurationError) as e:
            print(f"snowflake decode: error: {text!r} is not an id of this layout: {e}",
                  file=sys.stderr)  # fmt: skip
            return 2
    if args.json:
        print(json.dumps(described))
        return 0
    for d in described:
        print(
            f"{d['id']}\n  time        {d['time']} ({d['timestamp_ms']} ms)\n"
            f"  datacenter  {d['datacenter_id']}\n  worker      {d['worker_id']}\n"
            f"  sequence    {d['sequence']}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake``."""
    args = _build_parser().parse_args(argv)
    try:
        return _get(args) if args.command == "get" else _decode(args)
    except ConfigurationError as e:
        print(f"snowflake {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
