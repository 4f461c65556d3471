"""The docs against the code: options, metrics, the README's length, every relative link.

The options and metrics tables are generated (``python -m tests.docs.render``);
these tests render them again from the code and fail on any difference, so a
new, renamed or removed option or metric cannot go undocumented.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from snowflake_server._app.exits import ExitCode
from snowflake_server._config.options import GROUPS, OPTIONS
from tests.docs.render import (
    CONFIGURATION,
    METRICS,
    ROOT,
    Family,
    default_text,
    metric_families,
    metrics_section,
    options_section,
    section,
)

REGENERATE = "run `.venv/bin/python -m tests.docs.render` and review the diff"
README_MAX_LINES = 200
LINKED_DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        ROOT / "clients" / "README.md",
        ROOT / "clients" / "http.md",
        *(ROOT / "clients").glob("*/README.md"),
        *(ROOT / "deploy").glob("README.md"),
        *(ROOT / "docs").glob("*.md"),
    ]
)


def _diff(documented: str, expected: str, where: Path) -> str:
    lines = difflib.unified_diff(
        documented.splitlines(), expected.splitlines(), f"{where.name} (now)", "from the code",
        lineterm="",
    )  # fmt: skip
    return "\n".join(lines)


# -- options ----------------------------------------------------------------------------


def test_the_options_tables_are_generated_from_the_options() -> None:
    documented = section(CONFIGURATION.read_text(encoding="utf-8"), "options")
    expected = options_section()
    assert documented == expected, f"{REGENERATE}\n{_diff(documented, expected, CONFIGURATION)}"


def test_every_option_has_its_flag_variable_and_default_in_its_group() -> None:
    tables = section(CONFIGURATION.read_text(encoding="utf-8"), "options")
    group_of = {name: title for title, names in GROUPS for name in names}
    current_group = ""
    rows: dict[str, tuple[str, str]] = {}  # flag -> (group, its table row)
    for line in tables.splitlines():
        if line.startswith("### "):
            current_group = line[4:]
        elif line.startswith("| `--"):
            rows[line.split("`")[1].split()[0]] = (current_group, line)
    for option in OPTIONS:
        assert option.flag in rows, f"{option.flag} is not in {CONFIGURATION.name}: {REGENERATE}"
        group, row = rows[option.flag]
        assert group == group_of[option.name], f"{option.flag} is under {group!r}"
        assert f"`{option.env}`" in row, f"{option.flag}: {option.env} missing"
        assert f"| {default_text(option)} |" in row, f"{option.flag}: default not documented"
    stale = set(rows) - {option.flag for option in OPTIONS}
    assert not stale, f"documented options that do not exist: {sorted(stale)}"


# -- metrics ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> list[Family]:
    return metric_families(tmp_path_factory.mktemp("metrics"))


def test_every_exposed_metric_is_documented_and_every_documented_one_exists(
    families: list[Family],
) -> None:
    table = section(METRICS.read_text(encoding="utf-8"), "metrics")
    documented = set(re.findall(r"^\| `(\w+)` \| (\w+) \|", table, re.MULTILINE))
    exposed = {(f.name, f.type) for f in families}
    assert len(exposed) > 20, "the server exposed too little to compare with"
    assert exposed - documented == set(), f"exposed but not documented: {REGENERATE}"
    assert documented - exposed == set(), f"documented but not exposed: {REGENERATE}"


def test_the_metrics_table_is_generated_from_a_running_server(families: list[Family]) -> None:
    documented = section(METRICS.read_text(encoding="utf-8"), "metrics")
    expected = metrics_section(families)
    assert documented == expected, f"{REGENERATE}\n{_diff(documented, expected, METRICS)}"


# -- the README and links ---------------------------------------------------------------


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move details to docs/"


_FENCED = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$", re.MULTILINE)


def anchors(markdown: str) -> set[str]:
    """The ids GitHub gives the headings of ``markdown``."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCED.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_anchors_follow_github() -> None:
    text = "# snowflake\n## What happens when `the clock` goes back\n### ids & layout\n## a\n## a\n"
    assert anchors(text) == {
        "snowflake",
        "what-happens-when-the-clock-goes-back",
        "ids--layout",
        "a",
        "a-1",
    }


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings_that_exist(doc: Path) -> None:
    assert doc.is_file(), f"{doc.relative_to(ROOT)} is missing"
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in _LINK.findall(_INLINE_CODE.sub("", _FENCED.sub("", text))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto: are not checked here
        path_part, _, anchor = target.partition("#")
        linked = (doc.parent / path_part).resolve() if path_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif (
            anchor
            and linked.suffix == ".md"
            and anchor not in anchors(linked.read_text(encoding="utf-8"))
        ):
            broken.append(f"{target}: no such heading")
    assert broken == [], f"broken links in {doc.relative_to(ROOT)}: {broken}"


def test_the_exit_code_table_is_the_code_s_and_the_systemd_unit_s() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    table = section_after(text, "## Exit codes and refusals")
    rows = re.findall(r"^\| (\d+) \| ([a-z ]+) \| .* \| (yes|no)[^|]* \|.*\|$", table, re.M)
    documented = {int(code): name.replace(" ", "_").upper() for code, name, _ in rows}
    assert documented == {code.value: code.name for code in ExitCode}
    unit = (ROOT / "deploy" / "systemd" / "snowflake-server.service").read_text()
    prevented = re.search(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
    assert prevented is not None
    not_restarted = {int(code) for code, _, restarted in rows if restarted == "no"}
    # 0 is a clean stop: Restart=on-failure does not restart it, whatever the list says.
    assert {int(code) for code in prevented.group(1).split()} == not_restarted - {0}
    assert re.search(r"^Restart=on-failure$", unit, re.M)


def section_after(text: str, heading: str) -> str:
    """The lines under ``heading``, to the next heading of any level."""
    after = text.split(heading + "\n", 1)[1]
    return after.split("\n#", 1)[0]
