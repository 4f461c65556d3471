"""snowflake: unique, time-ordered 64-bit ids over Thrift, Twitter Snowflake compatible.

The public surface is re-exported here; modules whose names start with an
underscore, and names not listed in ``__all__``, may change without notice.
"""

from __future__ import annotations

from .client import (
    CallFailedError,
    Discovery,
    NoServerAvailableError,
    ServerAddress,
    SnowflakeClient,
    SnowflakePool,
)
from .errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    InvalidCountError,
    InvalidUserAgentError,
    RequestError,
    SnowflakeError,
    TimestampOverflowError,
)
from .generator import (
    DEFAULT_LAYOUT,
    TWITTER_EPOCH_MS,
    DecodedId,
    GeneratorSettings,
    IdGenerator,
    Layout,
    compose,
    decompose,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LAYOUT",
    "TWITTER_EPOCH_MS",
    "CallFailedError",
    "ClockMovedBackwardsError",
    "ConfigurationError",
    "DecodedId",
    "Discovery",
    "GeneratorSettings",
    "IdGenerator",
    "InvalidCountError",
    "InvalidUserAgentError",
    "Layout",
    "NoServerAvailableError",
    "RequestError",
    "ServerAddress",
    "SnowflakeClient",
    "SnowflakeError",
    "SnowflakePool",
    "TimestampOverflowError",
    "__version__",
    "compose",
    "decompose",
]
