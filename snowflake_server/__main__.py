"""``python -m snowflake_server``: the same as ``snowflake-server``."""

import sys

from ._app.main import main

sys.exit(main())
