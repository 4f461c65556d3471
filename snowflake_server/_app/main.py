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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake-server``."""
    # SIGHUP (a log rotation) must not end a server still starting: ignored until the
    # server's own handler takes over (children of the supervisor inherit this).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        settings = load_settings(argv, os.environ)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return ExitCode.CONFIGURATION
    try:
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
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return ExitCode.CONFIGURATION
    except StartupRefused as e:
        print(f"snowflake-server: refusing to start: {e}", file=sys.stderr)
        return ExitCode.UNSAFE
    except StartupDeferred as e:
        print(f"snowflake-server: cannot start now, try again: {e}", file=sys.stderr)
        return ExitCode.TRY_AGAIN
    except StartupInterrupted as e:
        print(f"snowflake-server: stopped while starting: {e}", file=sys.stderr)
        return ExitCode.STOPPED


if __name__ == "__main__":
    sys.exit(main())
