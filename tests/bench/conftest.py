"""The benchmark's compiled programs, built once per test session by the Makefile."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bench.native import REPO, make, require


@pytest.fixture(scope="session")
def bench_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the C programs are built into, one for the session (as bench/build/)."""
    return tmp_path_factory.mktemp("bench-build")


@pytest.fixture(scope="session")
def loadgen_binary(bench_build: Path) -> Path:
    """bench/native/loadgen.c built by ``make bench-loadgen``, which must warn of nothing."""
    require("cc", "gcc")
    output = make("bench-loadgen", f"BENCH_BUILD={bench_build}")
    assert output == "", f"the C compiler warned:\n{output}"
    return bench_build / "loadgen"


@pytest.fixture(scope="session")
def floor_binary(bench_build: Path) -> Path:
    """bench/native/floor.c built by ``make bench-floor``, which must warn of nothing."""
    require("cc", "gcc")
    output = make("bench-floor", f"BENCH_BUILD={bench_build}")
    assert output == "", f"the C compiler warned:\n{output}"
    return bench_build / "floor"


@pytest.fixture(scope="session")
def anchors_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Java and Go anchors built by ``make bench-anchors`` on stubs that ``make stubs``
    generated into a copy of clients/; the folder they were built into."""
    for tool, package in [("thrift", "thrift-compiler"), ("javac", "default-jdk-headless"),
                          ("java", "default-jdk-headless"), ("go", "golang-go")]:  # fmt: skip
        require(tool, package)
    root = tmp_path_factory.mktemp("anchors")
    generated = ("gen-*", "node_modules", "thrift-debian", "bin", "build")
    shutil.copytree(REPO / "clients", root / "clients", ignore=shutil.ignore_patterns(*generated))
    build = root / "build"
    make("bench-anchors", f"BENCH_BUILD={build}", f"CLIENTS={root / 'clients'}")
    return build
