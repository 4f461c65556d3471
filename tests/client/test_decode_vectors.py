"""Every decoder against the shared vectors, ``clients/testdata/decode-vectors.json``.

The vectors are ids the server's own generator made under several layouts, with the
parts it was given; ``clients/testdata/make_vectors.py`` writes them. Here: the Python
decoder and ``snowflake decode`` give every one, the file is exactly what the script
writes (so it cannot drift from the generator), and the JavaScript and Go helpers pass
their own tests, which read the same file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from snowflake_thrift_client import ConfigurationError, Layout, compose, decompose

from snowflake_server._cli import main as snowflake
from tests.support.commands import run, tool
from tests.support.examples import SEED_003_JSON

ROOT = Path(__file__).resolve().parents[2]
TESTDATA = ROOT / "clients" / "testdata"
VECTORS_FILE = TESTDATA / "decode-vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
PARTS = ("id", "time", "timestamp_ms", "datacenter_id", "worker_id", "sequence", "clock_sequence")


def layout(name: str) -> Layout:
    return Layout(**VECTORS["layouts"][name])


def vector_id(vector: dict[str, Any]) -> str:
    return f"{vector['layout']}:{vector.get('id', vector.get('input'))!r}"


def make_vectors() -> ModuleType:
    """``clients/testdata/make_vectors.py``, imported: it is a script, not a package."""
    name = "snowflake_make_vectors"
    spec = importlib.util.spec_from_file_location(name, TESTDATA / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


# -- the Python decoder ---------------------------------------------------------------


def test_the_worked_example_of_seed_003_is_a_vector() -> None:
    # Written out, not generated: a generator bug cannot rewrite this one.
    assert {"layout": "default", **SEED_003_JSON}.items() <= VECTORS["valid"][0].items()
    assert VECTORS["layouts"]["default"] == {
        "epoch_ms": 1288834974657,
        "timestamp_bits": 41,
        "datacenter_id_bits": 5,
        "worker_id_bits": 5,
        "sequence_bits": 12,
        "clock_sequence_bits": 0,
    }
    assert len(VECTORS["layouts"]) >= 3 and {v["error"] for v in VECTORS["invalid"]} == {
        "format",
        "range",
    }


@pytest.mark.parametrize("vector", VECTORS["valid"], ids=vector_id)
def test_the_python_decoder_gives_every_valid_vector(vector: dict[str, Any]) -> None:
    this = layout(vector["layout"])
    decoded = decompose(int(vector["id"]), this)
    assert decoded.to_json() == {part: vector[part] for part in PARTS}
    assert compose(
        decoded.timestamp_ms,
        decoded.datacenter_id,
        decoded.worker_id,
        decoded.sequence,
        this,
        decoded.clock_sequence,
    ) == int(vector["id"])


@pytest.mark.parametrize("vector", VECTORS["invalid"], ids=vector_id)
def test_the_python_decoder_refuses_every_invalid_vector(vector: dict[str, Any]) -> None:
    this = layout(vector["layout"])
    if vector["error"] == "range":
        with pytest.raises(ConfigurationError, match=r"must be in 0\.\."):
            decompose(int(vector["input"]), this)
    else:
        assert vector["error"] == "format"
        with pytest.raises(ValueError, match="invalid literal for int") as info:
            decompose(int(vector["input"]), this)
        assert not isinstance(info.value, ConfigurationError)


@pytest.mark.parametrize("name", sorted(VECTORS["layouts"]))
def test_snowflake_decode_gives_every_valid_vector(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [
        f"--{key.replace('_ms', '').replace('_', '-')}={value}"
        for key, value in VECTORS["layouts"][name].items()
    ]
    vectors = [v for v in VECTORS["valid"] if v["layout"] == name]
    assert snowflake(["decode", "--json", *flags, *(v["id"] for v in vectors)]) == 0
    assert json.loads(capsys.readouterr().out) == [{p: v[p] for p in PARTS} for v in vectors]


# -- the file against the script that writes it ----------------------------------------


def test_the_vectors_file_is_what_make_vectors_writes() -> None:
    rendered = make_vectors().render()
    assert VECTORS_FILE.read_text(encoding="utf-8") == rendered, (
        "clients/testdata/decode-vectors.json is stale: run "
        "`.venv/bin/python clients/testdata/make_vectors.py` and review the diff"
    )


def test_make_vectors_check_finds_a_stale_file_and_rewrites_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = make_vectors()
    assert script.main(["--check"]) == 0
    stale = tmp_path / "decode-vectors.json"
    stale.write_text(
        VECTORS_FILE.read_text(encoding="utf-8").replace(
            '"datacenter_id": 17', '"datacenter_id": 18'
        )
    )
    monkeypatch.setattr(script, "VECTORS_FILE", stale)
    assert script.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert script.main([]) == 0
    assert stale.read_text(encoding="utf-8") == VECTORS_FILE.read_text(encoding="utf-8")


# -- the JavaScript and Go helpers -------------------------------------------------------


def counted(valid: int, invalid: int) -> list[str]:
    """What each helper's tests print once they checked every vector."""
    return [f"decode vectors: {valid} valid checked", f"decode vectors: {invalid} invalid checked"]


@pytest.mark.interop
def test_the_node_helper_gives_every_vector() -> None:
    node = tool("node", "nodejs")
    out = run([node, "decode.test.js"], cwd=ROOT / "clients" / "node", stderr=True)
    for line in counted(len(VECTORS["valid"]), len(VECTORS["invalid"])):
        assert f"# {line}" in out, out
    assert "# fail 0" in out, out


@pytest.mark.interop
def test_the_go_helper_gives_every_vector(tmp_path: Path) -> None:
    go = tool("go", "golang-go")
    # Offline, with the toolchain installed: no module proxy, no toolchain download.
    env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    if not any(env.get(name) for name in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(tmp_path / "go-cache")
    out = run(
        [go, "test", "-count=1", "-v", "./snowflakeid/"],
        cwd=ROOT / "clients" / "go",
        env=env,
        stderr=True,
    )
    for line in counted(len(VECTORS["valid"]), len(VECTORS["invalid"])):
        assert line in out, out
    assert "--- FAIL" not in out, out
