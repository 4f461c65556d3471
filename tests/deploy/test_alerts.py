"""The alert rules in deploy/prometheus: valid for promtool, unit-tested, documented.

promtool comes from Debian's prometheus package, unpacked into .tools/ by `make test`
and put first on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docs.test_docs import anchors

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "snowflake.rules.yml"
RULE_TESTS = PROMETHEUS / "snowflake.rules.test.yml"
EXAMPLE_CONFIG = PROMETHEUS / "prometheus.example.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
RUNBOOK_PREFIX = "docs/operations.md#"
SEVERITIES = {"critical", "warning"}


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of the rule file, in order."""
    groups = load_yaml(RULES)["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


ALERTS = [rule["alert"] for rule in alert_rules()]


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool (from Debian's prometheus package) is unpacked by `make test`"
    return found


def run_promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_checks_the_rules() -> None:
    checked = run_promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout, checked.stdout


def test_the_rule_unit_tests_pass() -> None:
    tested = run_promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout and "FAILED" not in tested.stdout, tested.stdout


def test_the_example_config_loads_the_rules() -> None:
    checked = run_promtool("check", "config", EXAMPLE_CONFIG.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert load_yaml(EXAMPLE_CONFIG)["rule_files"] == [RULES.name]


def test_one_group_of_alerts_each_labelled_and_annotated() -> None:
    groups = load_yaml(RULES)["groups"]
    assert [group["name"] for group in groups] == ["snowflake"]
    assert len(ALERTS) == len(set(ALERTS)) >= 10, ALERTS
    for rule in alert_rules():
        name = rule["alert"]
        assert name.startswith("Snowflake"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, name
        assert all(str(text).strip() for text in annotations.values()), name
        assert annotations["runbook"] == f"{RUNBOOK_PREFIX}alert-{name.lower()}", name


def unit_cases() -> list[tuple[str, bool]]:
    """(alert name, whether the case expects it to fire) for each case of the unit tests."""
    cases = []
    for test in load_yaml(RULE_TESTS)["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.append((case["alertname"], bool(case.get("exp_alerts"))))
    return cases


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_does_not() -> None:
    assert load_yaml(RULE_TESTS)["rule_files"] == [RULES.name]
    cases = unit_cases()
    # promtool expects nothing from a rule it does not know: a misspelt name tests nothing.
    assert {name for name, _ in cases} <= set(ALERTS), "unit tests of unknown alerts"
    firing = {name for name, fires in cases if fires}
    quiet = {name for name, fires in cases if not fires}
    assert [name for name in ALERTS if name not in firing] == [], "alerts never seen firing"
    assert [name for name in ALERTS if name not in quiet] == [], "alerts never seen quiet"


@pytest.mark.parametrize("alert", ALERTS)
def test_the_unit_tests_fail_when_the_alert_never_fires(alert: str, tmp_path: Path) -> None:
    """The unit tests constrain each rule: replace its expression by one that never
    fires, and promtool must report the firing case that no longer fires."""
    rules = load_yaml(RULES)
    for rule in rules["groups"][0]["rules"]:
        if rule.get("alert") == alert:
            rule["expr"] = "vector(1) == 0"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules), encoding="utf-8")
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    tested = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    report = tested.stdout + tested.stderr
    assert tested.returncode != 0, report
    assert f"alertname: {alert}," in report, report


def test_every_runbook_anchor_is_a_heading_of_operations_md() -> None:
    headings = anchors(OPERATIONS.read_text(encoding="utf-8"))
    missing = [
        rule["annotations"]["runbook"]
        for rule in alert_rules()
        if rule["annotations"]["runbook"].removeprefix(RUNBOOK_PREFIX) not in headings
    ]
    assert missing == [], f"runbook sections missing from docs/operations.md: {missing}"
