"""The server's dependencies, computed where it is built (pyproject.toml has the rest).

Built from this repository (``pip install .``, ``pip install -e .``, ``pip wheel .``), the
server requires the client by the path of ``clients/python`` beside it: pip builds the
client from this tree and never asks an index for the name ``snowflake-thrift-client``,
which anyone could register there (dependency confusion). An sdist, and a wheel built
from an sdist (which holds no ``clients/python`` project), require the client by name and
exactly this version, as distributions published to an index must: an index refuses a
direct reference, and ``python -m build`` makes its wheel from its sdist.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

CLIENT_NAME = "snowflake-thrift-client"
HERE = Path(__file__).resolve().parent
CLIENT = HERE / "clients" / "python"

THIRD_PARTY = [
    "thriftpy2>=0.7.1,<0.8",
    "prometheus-client>=0.26,<1",
    "kazoo[sasl]>=2.11,<3",  # [sasl]: pure-sasl, for --zk-auth sasl
    # The HTTP/1.1 request parser (llhttp) of the API and the admin endpoint: strict where a
    # hand-made parser was lenient, and about 1 µs a request (snowflake_server/_http/parser.py).
    "httptools>=0.6,<1",
    # The admin endpoint's web configuration (--web-config-file, the Prometheus exporters'
    # YAML format) and its basic-auth users' bcrypt hashes.
    "pyyaml>=6,<7",
    "bcrypt>=4.1,<6",
    # The event loop the Thrift server runs on (about twice asyncio's own); the server
    # falls back to asyncio's loop, with a log line, where uvloop is not available.
    "uvloop>=0.19; sys_platform != 'win32' and platform_python_implementation == 'CPython'",
]


def client_requirement(argv: list[str]) -> str:
    """The server's requirement on the client: the one of this tree by its path where
    there is a tree and the command builds no sdist, else the name pinned to the one
    VERSION the two share (the server uses the client's private modules)."""
    if (CLIENT / "pyproject.toml").is_file() and "sdist" not in argv[1:]:
        # A file: URL that pip builds from; absolute, as direct references must be.
        return f"{CLIENT_NAME} @ {CLIENT.as_uri()}"
    version = (HERE / "VERSION").read_text(encoding="utf-8")
    return f"{CLIENT_NAME}=={version.strip()}"


def native_extensions(environ: dict[str, str]) -> list[Extension]:
    """The optional native generator state (snowflake_server/_native/_core.c): built where a
    C compiler and Python's headers are, else left out with one warning from setuptools
    (``optional=True``) and the server runs on the pure-Python path. ``SNOWFLAKE_NO_NATIVE=1``
    leaves it out of the build too."""
    if environ.get("SNOWFLAKE_NO_NATIVE", "") not in ("", "0"):
        return []
    return [
        Extension(
            "snowflake_server._native._core",
            ["snowflake_server/_native/_core.c", "snowflake_server/_native/_listener.c"],
            depends=[
                "snowflake_server/_native/_listener.h",
                "snowflake_server/_native/_conn.h",
                "snowflake_server/_native/_state.h",
            ],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


if __name__ == "__main__":
    setup(
        install_requires=[client_requirement(sys.argv), *THIRD_PARTY],
        ext_modules=native_extensions(dict(os.environ)),
    )
