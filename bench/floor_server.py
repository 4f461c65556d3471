"""The framework's floor: a bare thriftpy2 server speaking the snowflake IDL.

    python bench/floor_server.py --port 0 [--transport framed|buffered]

thriftpy2's own ``TThreadedServer`` (one thread per connection, as ours), over the same
transport and protocol as ``snowflake-server`` (Cython framed or buffered, binary), with
a handler whose ``get_id`` returns a constant and whose ``get_ids`` returns a slice of a
prebuilt list: no generator, no lock, no validation, no metrics. What a server built on
thriftpy2 cannot beat. Prints ``floor-server ready thrift=HOST:PORT`` once it listens;
SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from thriftpy2.protocol import TCyBinaryProtocolFactory
from thriftpy2.server import TThreadedServer
from thriftpy2.thrift import TProcessor
from thriftpy2.transport import TServerSocket, TSocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snowflake_thrift_client._idl import snowflake_thrift
from snowflake_thrift_client._transports import TRANSPORTS

READY_PREFIX = "floor-server ready"
_ID = 1_234_567_890_123_456_789
_IDS = list(range(_ID, _ID + 4096))


class ConstantHandler:
    """The service's methods, answering constants."""

    def get_id(self, useragent: str) -> int:
        return _ID

    def get_ids(self, useragent: str, count: int) -> list[int]:
        return _IDS[:count]

    def get_worker_id(self) -> int:
        return 0

    def get_datacenter_id(self) -> int:
        return 0

    def get_timestamp(self) -> int:
        return 0

    def get_layout(self) -> Any:
        return snowflake_thrift().Layout(
            epoch_ms=1288834974657,
            timestamp_bits=41,
            datacenter_id_bits=5,
            worker_id_bits=5,
            sequence_bits=12,
            datacenter_id=0,
            worker_id=0,
        )


class _NoDelayServerSocket(TServerSocket):
    """thriftpy2's server socket, with TCP_NODELAY on each connection as ours sets,
    that listens only once (we listen before ``serve`` to print the bound port)."""

    def listen(self) -> None:
        if self.sock is None:
            super().listen()  # type: ignore[no-untyped-call]

    def accept(self) -> TSocket:
        client: TSocket = super().accept()  # type: ignore[no-untyped-call]
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client


class _Factory:
    """A transport factory for ``transports.TRANSPORTS[name]``."""

    def __init__(self, name: str) -> None:
        self._cls = TRANSPORTS[name]

    def get_transport(self, trans: Any) -> Any:
        return self._cls(trans)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="framed")
    args = parser.parse_args(argv)

    # client_timeout=0: no idle timeout (thriftpy2's default drops a client idle for 3 s)
    listener = _NoDelayServerSocket(  # type: ignore[no-untyped-call]
        host=args.host, port=args.port, client_timeout=0, backlog=1024
    )
    server = TThreadedServer(
        TProcessor(snowflake_thrift().Snowflake, ConstantHandler()),
        listener,
        itrans_factory=_Factory(args.transport),
        iprot_factory=TCyBinaryProtocolFactory(),  # type: ignore[no-untyped-call]
        daemon=True,
    )
    listener.listen()
    assert listener.sock is not None
    host, port = listener.sock.getsockname()[:2]

    def stop(_signum: int, _frame: object) -> None:
        # Nothing to flush or finish: no state, and serve() is blocked in accept().
        sys.stdout.flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"{READY_PREFIX} thrift={host}:{port}", flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
