"""The npm package ``snowflake-thrift-client`` (clients/node), as a user gets it.

``make node-pack`` packs it, with the stubs ``make stubs`` makes from the IDL, on a copy of
``clients/`` (the work tree is left alone). The tarball is installed into a fresh project
with ``npm install --offline`` from a copy of the npm cache that ``make node-deps`` fills
with the registry's copies of its dependencies (thrift and what it needs, as pinned in
package-lock.json): no network here. The installed package then calls real servers
through its pool, and its types are checked by the TypeScript compiler of package-lock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.commands import run, tool
from tests.support.processes import ServerProcess, start_server

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "clients" / "node"
NPM_CACHE = Path(os.environ.get("NPM_CACHE", ROOT / ".tools" / "npm-cache"))
TSC = NODE / "node_modules" / "typescript" / "bin" / "tsc"

# What the tarball holds: the code, its types, the generated stubs, and what npm always adds.
INTENDED = {
    "package.json",
    "README.md",
    "LICENSE",
    "index.js",
    "index.d.ts",
    "client.js",
    "client.d.ts",
    "errors.js",
    "errors.d.ts",
    "decode.js",
    "decode.d.ts",
    "gen-nodejs/Snowflake.js",
    "gen-nodejs/snowflake_types.js",
}


def test_the_package_version_is_the_one_version_file() -> None:
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    package = json.loads((NODE / "package.json").read_text(encoding="utf-8"))
    lock = json.loads((NODE / "package-lock.json").read_text(encoding="utf-8"))
    assert package["name"] == "snowflake-thrift-client"
    assert package["version"] == version, "run `make node-version` after changing VERSION"
    assert lock["version"] == lock["packages"][""]["version"] == version
    assert "typescript" in package["devDependencies"]


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of clients/, as a checkout has it (nothing generated, no node_modules)."""
    tool("thrift", "thrift-compiler")
    root = tmp_path_factory.mktemp("npm") / "clients"
    generated = ("gen-*", "node_modules", "thrift-debian", "bin", "build")
    shutil.copytree(
        ROOT / "clients", root, symlinks=True, ignore=shutil.ignore_patterns(*generated)
    )
    return root


@pytest.fixture(scope="module")
def tarball(copy: Path) -> Path:
    """``make node-pack`` on the copy: the tarball a release would publish."""
    tool("npm", "npm")
    out = copy.parent / "dist"
    run(
        ["make", "-s", "-C", str(ROOT), "node-pack", f"CLIENTS={copy}", f"NODE_PACK_DIR={out}"],
        ROOT,
    )
    [made] = out.glob("snowflake-thrift-client-*.tgz")
    return made


@pytest.mark.slow
@pytest.mark.interop
def test_the_tarball_holds_exactly_the_intended_files(tarball: Path, copy: Path) -> None:
    # The tarball itself, as made: a dry run on a copy can differ (npm leaves out links).
    with tarfile.open(tarball) as packed:
        files = {name.removeprefix("package/") for name in packed.getnames()}
        manifest = packed.extractfile("package/package.json")
        assert manifest is not None
        version_packed = json.loads(manifest.read())["version"]
    assert files == INTENDED, f"unexpected: {files - INTENDED}, missing: {INTENDED - files}"
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    assert tarball.name == f"snowflake-thrift-client-{version}.tgz"
    assert version_packed == version


@pytest.mark.interop
def test_make_node_pack_refuses_a_version_that_is_not_version_file(tmp_path: Path) -> None:
    tool("thrift", "thrift-compiler")
    clients = tmp_path / "clients"
    shutil.copytree(NODE, clients / "node", ignore=shutil.ignore_patterns("node_modules", "gen-*"))
    package = json.loads((clients / "node" / "package.json").read_text(encoding="utf-8"))
    package["version"] = "0.0.1"
    (clients / "node" / "package.json").write_text(json.dumps(package), encoding="utf-8")
    make = ["make", "-s", "-C", str(ROOT), "node-pack", f"CLIENTS={clients}"]
    done = subprocess.run(
        [*make, f"NODE_PACK_DIR={tmp_path / 'dist'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "has version 0.0.1" in done.stderr and "make node-version" in done.stderr
    assert not (tmp_path / "dist").exists()


CONSUMER = """
import { SnowflakePool, decode, compose, version } from "snowflake-thrift-client";
import { decode as decodeAlone } from "snowflake-thrift-client/decode";

const servers = process.argv.slice(2);
const pool = new SnowflakePool(servers, { agent: "npm-test", retryFailedAfterMs: 60000 });
let out;
try {
  const id = await pool.getId();
  const again = await pool.getId();
  const ids = await pool.getIds(3);
  let tooMany;  // past the IDL's i32: Thrift's encoder would wrap it (3 ids asked)
  try { tooMany = (await pool.getIds(2 ** 32 + 3)).length; } catch (e) { tooMany = e.name; }
  const { layout, workerId } = await pool.getLayout();
  const parts = decode(id, layout);
  out = {
    version, id: String(id), again: String(again), ids: ids.map(String),
    worker: parts.workerId, workers: [again, ...ids].map((each) => decode(each).workerId),
    serverWorker: workerId, roundTrip: compose(parts, layout) === id,
    sameDecode: decodeAlone === decode, types: [typeof id, typeof ids[0]], tooMany,
  };
} catch (e) {
  const failures = (e.failures || []).map((f) => f.error.name);
  out = { error: e.name, message: e.message, failures };
} finally {
  await pool.close();
}
console.log(JSON.stringify(out));
"""

TYPED_CONSUMER = """
import { SnowflakePool, decode, compose, NoServerAvailableError, CallFailedError,
  type DecodedId } from "snowflake-thrift-client";

export async function main(): Promise<bigint> {
  const pool = new SnowflakePool(["127.0.0.1:7609"], { timeoutMs: 1000, transport: "framed" });
  try {
    const id: bigint = await pool.getId();
    const ids: bigint[] = await pool.getIds(2);
    const parts: DecodedId = decode(id, (await pool.getLayout()).layout);
    return compose(parts) + BigInt(ids.length);
  } catch (e) {
    if (e instanceof NoServerAvailableError) return BigInt(e.failures.length);
    if (e instanceof CallFailedError && e.timedOut) return 0n;
    throw e;
  } finally {
    await pool.close();
  }
}
"""


@pytest.fixture(scope="module")
def project(tarball: Path) -> Path:
    """A fresh project with the tarball installed offline, as a user without network."""
    npm = tool("npm", "npm")
    assert (NPM_CACHE / "_cacache").is_dir(), f"no npm cache in {NPM_CACHE}: run `make node-deps`"
    app = tarball.parent.parent / "app"
    app.mkdir()
    cache = app.parent / "npm-cache"
    shutil.copytree(NPM_CACHE, cache)  # npm writes to its cache: the shared one stays as made
    (app / "package.json").write_text(
        json.dumps({"name": "app", "version": "1.0.0", "private": True, "type": "module"}),
        encoding="utf-8",
    )
    # --offline: npm's cache mode only-if-cached, so that any fetch fails instead of going out
    run([npm, "install", "--offline", "--cache", str(cache), "--no-audit", "--no-fund",
         str(tarball)], app)  # fmt: skip
    assert (app / "node_modules" / "snowflake-thrift-client" / "gen-nodejs").is_dir()
    assert not (app / "node_modules" / "snowflake-thrift-client" / "node_modules").exists()
    # The generated stubs require node-int64 themselves: a dependency of the package, not
    # only of thrift (pnpm and Yarn PnP give a package only what it declares).
    installed = json.loads(
        (app / "node_modules" / "snowflake-thrift-client" / "package.json").read_text()
    )
    assert {"thrift", "node-int64"} <= installed["dependencies"].keys()
    (app / "consumer.mjs").write_text(CONSUMER, encoding="utf-8")
    return app


@pytest.fixture
def two_servers() -> Iterator[list[ServerProcess]]:
    made = [start_server("--worker-id", "1"), start_server("--worker-id", "2")]
    try:
        yield made
    finally:
        for server in made:
            server.stop()


def consume(app: Path, servers: list[ServerProcess]) -> dict[str, Any]:
    node = tool("node", "nodejs")
    out = run([node, "consumer.mjs", *(f"127.0.0.1:{s.port}" for s in servers)], app)
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.slow
@pytest.mark.interop
def test_the_installed_package_gets_ids_and_fails_over(
    project: Path, two_servers: list[ServerProcess]
) -> None:
    first, second = two_servers
    got = consume(project, [first, second])
    version = (ROOT / "VERSION").read_text(encoding="utf-8").strip()
    assert "error" not in got, got
    assert got["version"] == version
    assert got["types"] == ["bigint", "bigint"]
    assert got["roundTrip"] and got["sameDecode"]
    assert got["worker"] in (1, 2) and got["serverWorker"] in (1, 2)
    assert got["tooMany"] == "ConfigurationError", got
    ids = [int(got["id"]), int(got["again"]), *map(int, got["ids"])]
    assert len(set(ids)) == 5 and all(i > 0 for i in ids)

    first.stop()  # the first server listed is gone: every call goes to the second
    got = consume(project, [first, second])
    assert "error" not in got, got
    assert got["worker"] == 2 and got["workers"] == [2, 2, 2, 2] and got["serverWorker"] == 2

    second.stop()
    got = consume(project, [first, second])
    assert got["error"] == "NoServerAvailableError", got
    assert got["failures"] == ["ConnectionFailedError"] * 3, got


@pytest.mark.slow
@pytest.mark.interop
def test_the_installed_types_check_with_tsc_strict(project: Path) -> None:
    node = tool("node", "nodejs")
    assert TSC.is_file(), "typescript is a devDependency: run `make node-deps`"
    check = [node, str(TSC), "--noEmit", "--strict", "--target", "es2022", "--module", "nodenext",
             "--moduleResolution", "nodenext", "consumer.ts"]  # fmt: skip
    (project / "consumer.ts").write_text(TYPED_CONSUMER, encoding="utf-8")
    run(check, project)
    # The types say what is wrong: an id is a bigint, not a number.
    (project / "consumer.ts").write_text(
        TYPED_CONSUMER.replace("const id: bigint", "const id: number"), encoding="utf-8"
    )
    done = subprocess.run(check, cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "bigint" in done.stdout, done.stdout
