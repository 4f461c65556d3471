"""The Kubernetes manifests in deploy/kubernetes/: valid for a current Kubernetes, and true
to the server they run (its options, ports, probes, drain) and to the image (its user).

Each variant (standalone/, cluster/) is a Service, a PodDisruptionBudget, a
StatefulSet and a NetworkPolicy, applied on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
from kubernetes_validate import utils as validate_utils

from snowflake_server import ServerSettings
from snowflake_server._app.node_id import Machine, resolve_worker_id
from snowflake_server._config.options import OPTIONS, load_settings

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
VARIANTS = ("standalone", "cluster")
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# The newest schemas the installed kubernetes-validate has; older than this is not current.
KUBERNETES = str(kubernetes_validate.latest_version())
OLDEST_CURRENT = (1, 31)
# After the drain the server still stops: the calls in flight get 1.5 s, then the final
# marks go to disk and ZooKeeper and the node deregisters. All of it well within this.
STOP_MARGIN_S = 10
# What the downward API would give a pod, for the settings check.
FIELD_VALUES = {"status.podIP": "10.1.2.3"}


def _files() -> list[Path]:
    return sorted(MANIFESTS.rglob("*.yaml"))


def _read(path: Path) -> list[dict[str, Any]]:
    """The documents of ``path``, read as the kubernetes-validate command reads them."""
    resources: list[dict[str, Any]] = validate_utils.resources_from_file(str(path))
    return resources


def test_every_variant_is_there() -> None:
    assert sorted(p.name for p in MANIFESTS.iterdir() if p.is_dir()) == sorted(VARIANTS)
    assert tuple(int(n) for n in KUBERNETES.split(".")[:2]) >= OLDEST_CURRENT, KUBERNETES


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_manifest_is_valid(path: Path) -> None:
    """Against the API's schemas of the newest Kubernetes the validator knows, strictly:
    a misspelt or misplaced field fails, as `kubectl apply` with field validation would."""
    resources = _read(path)
    assert resources, "no documents"
    for resource in resources:
        name = f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(resource, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(part) for part in e.path)
            pytest.fail(f"{name}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{name}: {e.message}")


@dataclass(frozen=True)
class Variant:
    """One variant's resources, one of each kind."""

    name: str
    statefulset: dict[str, Any]
    service: dict[str, Any]
    budget: dict[str, Any]
    policy: dict[str, Any]

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
        """The container's variables by name (a name set twice would fail here)."""
        entries = self.container.get("env", [])
        names = [entry["name"] for entry in entries]
        assert len(names) == len(set(names)), f"a variable set twice: {names}"
        return {entry["name"]: entry for entry in entries}

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


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> Variant:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((MANIFESTS / request.param).glob("*.yaml")):
        for resource in _read(path):
            by_kind.setdefault(resource["kind"], []).append(resource)
    kinds = ["NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"]
    assert sorted(by_kind) == kinds, by_kind.keys()
    assert all(len(resources) == 1 for resources in by_kind.values())
    return Variant(request.param, by_kind["StatefulSet"][0], by_kind["Service"][0],
                   by_kind["PodDisruptionBudget"][0], by_kind["NetworkPolicy"][0])  # fmt: skip


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


def pod_named(name: str) -> Machine:
    return Machine(hostname=lambda: name)


def test_worker_id_source(variant: Variant) -> None:
    env = variant.env
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


def test_grace_period_covers_the_drain(variant: Variant) -> None:
    """Kubernetes kills the pod at terminationGracePeriodSeconds: the preStop hook (if any),
    the drain and the stop itself must fit, or the final marks may not be written."""
    drain = float(variant.literal("SNOWFLAKE_DRAIN_SECONDS"))
    pre_stop = variant.container.get("lifecycle", {}).get("preStop", {})
    assert "exec" not in pre_stop, "the image has no shell to sleep in; the server drains"
    pre_stop_s = pre_stop.get("sleep", {}).get("seconds", 0)
    grace = variant.pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_s + drain + STOP_MARGIN_S, (grace, pre_stop_s, drain)
    # The drain is for the Service to drop the pod: at least one readiness period.
    assert drain >= variant.container["readinessProbe"]["periodSeconds"]


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
