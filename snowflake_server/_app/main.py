"""``snowflake-server``: from command line to exit code.

Flags, environment and config file become settings (``_config``); one process
is a :class:`~snowflake_server._app.node.Node` served by ``serve``, several
are run by the ``Supervisor``. SIGTERM or SIGINT: stop accepting, let calls
in flight finish, write the exact final marks, delete the registration, exit 0.

Exit codes: 0 after a signal, 2 for bad settings or a port in use, 3 when
starting could repeat ids (clock far behind the mark, unusable state file,
worker held by another process).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from .._config.options import load_settings
from .._errors import ConfigurationError, StartupRefused
from .node import serve
from .supervisor import Supervisor, die_with_supervisor

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``snowflake-server``."""
    try:
        settings = load_settings(argv, os.environ)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if settings.processes > 1:
            return Supervisor(settings).run()
        die_with_supervisor(os.environ)
        return serve(settings)
    except ConfigurationError as e:
        print(f"snowflake-server: error: {e}", file=sys.stderr)
        return 2
    except StartupRefused as e:
        print(f"snowflake-server: refusing to start: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
