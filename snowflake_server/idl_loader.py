"""The service's Thrift definitions, loaded from the IDL shipped in this package.

``idl/snowflake.thrift`` is the single source of truth: the server, the Python
client and the stubs for other languages are all made from that one file.
"""

from __future__ import annotations

import functools
import io
from importlib import resources
from types import ModuleType

import thriftpy2

__all__ = ["idl_text", "snowflake_thrift"]


def idl_text() -> str:
    """The text of ``snowflake.thrift`` as installed with the package."""
    idl = resources.files("snowflake_server").joinpath("idl").joinpath("snowflake.thrift")
    return idl.read_text(encoding="utf-8")


@functools.cache
def snowflake_thrift() -> ModuleType:
    """The IDL as a thriftpy2 module (``Snowflake`` service, exceptions, ``Layout``)."""
    return thriftpy2.load_fp(io.StringIO(idl_text()), module_name="snowflake_thrift")
