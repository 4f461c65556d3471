"""The Go client as a module another module imports (github.com/snowflake-id/snowflake/clients/go).

A fresh module in a temp directory requires it as a user would, and replaces it (and
apache/thrift, with Debian's golang-thrift-dev) by local paths in its OWN go.mod, as a user
without network does: replace lines in our go.mod are ignored by Go in a dependency. It
builds offline (no module proxy, no toolchain download), calls a real server through the
generated package, and decodes the id with ``snowflakeid``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import start_server

pytestmark = [pytest.mark.interop, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODULE = "github.com/snowflake-id/snowflake/clients/go"

CONSUMER = """package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"github.com/snowflake-id/snowflake/clients/go/gen-go/snowflake"
	"github.com/snowflake-id/snowflake/clients/go/snowflakeid"
)

func main() {
	conf := &thrift.TConfiguration{ConnectTimeout: 5 * time.Second, SocketTimeout: 5 * time.Second}
	socket := thrift.NewTSocketConf(net.JoinHostPort("127.0.0.1", os.Args[1]), conf)
	transport := thrift.NewTFramedTransportConf(socket, conf)
	if err := transport.Open(); err != nil {
		panic(err)
	}
	defer transport.Close()
	protocol := thrift.NewTBinaryProtocolConf(transport, conf)
	client := snowflake.NewSnowflakeClient(thrift.NewTStandardClient(protocol, protocol))
	id, err := client.GetID(context.Background(), "go-consumer")
	if err != nil {
		panic(err)
	}
	parts, err := snowflakeid.Decode(id, snowflakeid.DefaultLayout)
	if err != nil {
		panic(err)
	}
	line, _ := json.Marshal(map[string]any{"id": fmt.Sprint(id), "worker": parts.WorkerID})
	fmt.Println(string(line))
}
"""


def go_env(tmp_path: Path) -> dict[str, str]:
    """Offline, as the Makefile builds: no module proxy, no toolchain download."""
    env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    env.pop("GOWORK", None)
    if not any(env.get(name) for name in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(tmp_path / "go-cache")
    return env


def module_proxy(clients: Path, version: str, root: Path) -> Path:
    """A file GOPROXY serving our module at ``version``, as a release would publish it:
    the tree of clients/go with the stubs ``make stubs`` made (Go fetches zips by the
    module path, and refuses one whose go.mod declares another path)."""
    where = root / MODULE / "@v"
    where.mkdir(parents=True)
    source = clients / "go"
    (where / "list").write_text(f"v{version}\n", encoding="utf-8")
    info = {"Version": f"v{version}", "Time": "2026-11-26T00:00:00Z"}
    (where / f"v{version}.info").write_text(json.dumps(info), encoding="utf-8")
    shutil.copyfile(source / "go.mod", where / f"v{version}.mod")
    with zipfile.ZipFile(where / f"v{version}.zip", "w") as archive:
        for path in sorted(source.rglob("*")):
            inside = path.relative_to(source)
            if path.is_file() and inside.parts[0] not in ("thrift-debian", "bin"):
                archive.write(path, f"{MODULE}@v{version}/{inside.as_posix()}")
    return root


def test_another_module_requires_the_go_client_and_calls_a_server(tmp_path: Path) -> None:
    go = shutil.which("go")
    assert go, "`go` is missing: `make test` installs it (Debian package golang-go)"
    assert shutil.which("thrift"), "`thrift` is missing: `make test` installs thrift-compiler"
    clients = tmp_path / "clients"
    generated = ("gen-*", "node_modules", "thrift-debian", "bin", "build")
    shutil.copytree(ROOT / "clients", clients, ignore=shutil.ignore_patterns(*generated))
    subprocess.run(
        ["make", "-s", "-C", str(ROOT), "stubs", f"CLIENTS={clients}"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # Go 1.19 does not hold a replaced or proxied module to the path its go.mod declares:
    # the path a user requires is checked here (a proxy reached over the network does).
    declared = subprocess.run(
        [go, "mod", "edit", "-json"], cwd=clients / "go", capture_output=True, check=True
    )
    assert json.loads(declared.stdout)["Module"]["Path"] == MODULE
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    consumer = tmp_path / "consumer"
    consumer.mkdir()
    (consumer / "main.go").write_text(CONSUMER, encoding="utf-8")
    thrift_debian = clients / "go" / "thrift-debian"
    head = "module example.com/consumer\n\ngo 1.19\n\n"
    head += f"require (\n\t{MODULE} v{version}\n\tgithub.com/apache/thrift v0.17.0\n)\n\n"
    # Two ways a user without the network gets it: our module replaced by a local path
    # (a checkout), or fetched by its path from a module proxy (here a file one).
    # apache/thrift is Debian's in both: our go.mod's replace line does not reach them.
    ways = {
        "replace": (f"replace (\n\t{MODULE} => {clients / 'go'}\n"
                    f"\tgithub.com/apache/thrift => {thrift_debian}\n)\n", {}),
        "proxy": (f"replace github.com/apache/thrift => {thrift_debian}\n",
                  {"GOPROXY": module_proxy(clients, version, tmp_path / "proxy").as_uri(),
                   "GOSUMDB": "off"}),
    }  # fmt: skip
    for way, (replace, env) in ways.items():
        (consumer / "go.mod").write_text(head + replace, encoding="utf-8")
        (consumer / "go.sum").unlink(missing_ok=True)
        built = subprocess.run(
            [go, "build", "-o", "consumer", "."],
            cwd=consumer,
            env={**go_env(tmp_path), **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert built.returncode == 0, f"{way}: {built.stderr}"

    server = start_server("--worker-id", "7")
    try:
        ran = subprocess.run(
            [str(consumer / "consumer"), str(server.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop()
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert got["worker"] == 7 and int(got["id"]) > 0
