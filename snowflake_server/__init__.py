"""snowflake: unique, time-ordered 64-bit ids over Thrift, Twitter Snowflake compatible.

The server's public surface: what ``__all__`` lists. Run a server with
``snowflake-server`` (or :func:`main`); embed the pure generator with
:class:`IdGenerator`; run a whole server in-process with :class:`Node`.
Ids are packed and decoded by :class:`Layout`, and every error is a
:class:`SnowflakeError`: both come from the client package,
``snowflake_thrift_client``, which also has the Python client.

Every module whose name starts with an underscore, and every name not in
``__all__``, is private and may change without notice.
"""

from __future__ import annotations

from snowflake_thrift_client import (
    DEFAULT_LAYOUT,
    TWITTER_EPOCH_MS,
    DecodedId,
    Layout,
    compose,
    decompose,
)

from ._app.main import main
from ._app.node import Node, serve
from ._config.options import load_settings
from ._config.settings import ServerSettings
from ._errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    ReservationError,
    SnowflakeError,
    StartupRefused,
    TimestampOverflowError,
    UnavailableError,
)
from ._ids.generator import GeneratorCounters, GeneratorSettings, IdGenerator
from ._version import __version__

__all__ = [
    "DEFAULT_LAYOUT",
    "TWITTER_EPOCH_MS",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "DecodedId",
    "GeneratorCounters",
    "GeneratorSettings",
    "IdGenerator",
    "InvalidCountError",
    "InvalidUserAgentError",
    "Layout",
    "Node",
    "RequestError",
    "ReservationError",
    "ServerSettings",
    "SnowflakeError",
    "StartupRefused",
    "TimestampOverflowError",
    "UnavailableError",
    "__version__",
    "compose",
    "decompose",
    "load_settings",
    "main",
    "serve",
]
