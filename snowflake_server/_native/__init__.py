"""The optional native core: :func:`native_core` is the compiled module, or None.

None where it was not built (no C compiler or Python headers at install time: setuptools
builds it with ``optional=True``) or where ``SNOWFLAKE_NO_NATIVE=1`` turns it off at run
time; the server then runs on the pure-Python path, saying so in one log line.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

__all__ = ["native_core", "native_disabled"]

log = logging.getLogger(__name__)


def native_disabled(environ: dict[str, str] | None = None) -> bool:
    """Whether ``SNOWFLAKE_NO_NATIVE`` turns the native core off (any value but empty or 0)."""
    value = (os.environ if environ is None else environ).get("SNOWFLAKE_NO_NATIVE", "")
    return value not in ("", "0")


@functools.cache
def native_core() -> ModuleType | None:
    """The native core module, or None (logged once) if it is off or not built."""
    if native_disabled():
        log.info("native fast path off (SNOWFLAKE_NO_NATIVE): serving on the pure-Python path")
        return None
    try:
        return importlib.import_module("snowflake_server._native._core")
    except ImportError as e:
        log.info("native fast path not built (%s): serving on the pure-Python path", e)
        return None
