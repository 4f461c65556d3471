"""``snowflake-server``: from command line to exit code.

Flags, environment and config file become settings (``_config``); a worker id
to be read from the machine (``--worker-id ordinal``, ``ip``, ``mac``) becomes a
number (``node_id``); one process is a :class:`~snowflake_server._app.node.Node`
served by ``serve``, several are run by the ``Supervisor``. SIGTERM or SIGINT:
report not ready, serve on for ``--drain-seconds``, then stop accepting, let
calls in flight finish, write the exact final marks, delete the registration,
exit 0. SIGHUP: reload the TLS files, reopen the audit trail and the log file.

Exit codes: see :class:`~snowflake_server._app.exits.ExitCode` (0 after a signal,
2 for bad settings, 3 when starting could repeat ids, 75 to try again).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from .._config.options import load_settings
from .._errors import ConfigurationError, StartupDeferred, StartupInterrupted, StartupRefused
from .._observability.logs import configure_logging
from .child import die_with_supervisor, origin_from_supervisor
from .exits import ExitCode
from .node import serve
from .node_id import resolve_worker_id
from .supervisor import Supervisor

__all__ = ["main"]


_ENDINGS: tuple[tuple[type[Exception], str, ExitCode], ...] = (
    (ConfigurationError, "error", ExitCode.CONFIGURATION),
    (StartupRefused, "refusing to start", ExitCode.UNSAFE),
    (StartupDeferred, "cannot start now, try again", ExitCode.TRY_AGAIN),
    (StartupInterrupted, "stopped while starting", ExitCode.STOPPED),
)
"""How a start that did not happen ends: what stderr says first, and the exit code."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake-server``."""
    # SIGHUP (a log rotation) must not end a server still starting: ignored until the
    # server's own handler takes over (children of the supervisor inherit this).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        settings = load_settings(argv, os.environ)
        log_file = configure_logging(settings.logging)
        # Read from the machine once, here: a child of the supervisor gets its id as a
        # number, and where the supervisor read it from.
        origin = origin_from_supervisor(os.environ)
        if origin is None:
            settings, origin = resolve_worker_id(settings)
        if settings.processes > 1:
            return Supervisor(settings, log_file, origin=origin).run()
        die_with_supervisor(os.environ)
        return serve(settings, log_file, origin=origin)
    except tuple(kind for kind, _, _ in _ENDINGS) as e:
        said, code = next((said, code) for kind, said, code in _ENDINGS if isinstance(e, kind))
        print(f"snowflake-server: {said}: {e}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
