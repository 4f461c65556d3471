"""The server's version: its distribution's metadata, made from the repository's one
``VERSION`` file (the client ships it as ``snowflake_thrift_client/VERSION``, a link)."""

from __future__ import annotations

from importlib import metadata

from snowflake_thrift_client import __version__ as _client_version

__all__ = ["__version__"]

try:
    __version__ = metadata.version("snowflake-server")
except metadata.PackageNotFoundError:  # a source tree put on sys.path, never installed
    __version__ = _client_version
