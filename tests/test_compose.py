"""docker-compose.yml, parsed (no Docker engine here): every path and command it names
exists in the repository, and the triton service is what a GPU host needs."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tls import make_ca, make_server_certificate, require_openssl

from specdec.paths import PROJECT_ROOT
from specdec.server_config import ServerConfig, render_repository
from specdec.serving.settings import BY_VARIABLE, TARGET_CHECKPOINT

COMPOSE = PROJECT_ROOT / "docker-compose.yml"
IMAGE_ROOT = "/opt/specdec"  # where docker/Dockerfile puts the repository
GENERATED = {"models", "results", ".run/engines", ".run/certs"}  # made by build / make / docker


def expand(value: str) -> str:
    """${VAR:-default}, ${VAR-default} -> default: the file as `docker compose up` reads it
    with no .env."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", re.sub(r"\$\{\w+\}", "", str(value)))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def host_path(service: dict, container_path: str) -> Path | None:
    """The repository path behind a container path (a volume, or the image's copy)."""
    path = container_path
    if not path.startswith("/"):
        path = f"{service.get('working_dir', IMAGE_ROOT)}/{path}"
    for volume in service.get("volumes", []):
        source, target = expand(volume).split(":")[:2]
        if path == target or path.startswith(target + "/"):
            return (PROJECT_ROOT / source / path[len(target) :].lstrip("/")).resolve()
    if path.startswith(IMAGE_ROOT + "/"):
        return PROJECT_ROOT / path[len(IMAGE_ROOT) + 1 :]
    return None


def named_paths(words: list[str]) -> list[str]:
    """Files and modules a command names: scripts, `-m module`, `-f file`, data files."""
    found = []
    for i, word in enumerate(words):
        if i and words[i - 1] == "-m" and "." in word:
            module = word.replace(".", "/")  # a package runs its __main__.py
            package = (PROJECT_ROOT / module).is_dir()
            found.append(f"{module}/__main__.py" if package else f"{module}.py")
        elif re.search(r"\.(py|sh|json|jsonl)$", word):
            found.append(word)
    return found


def test_services_and_profiles(compose):
    services = compose["services"]
    assert set(services) == {"build", "triton", "openai", "locust", "sdk", "gateway"} | {
        f"triton-gpu{i}" for i in (1, 2, 3)
    } | {"prometheus", "grafana"}
    for name in ("build", "triton", "openai"):  # `docker compose up` starts them
        assert "profiles" not in services[name], name
    assert services["locust"]["profiles"] == ["loadtest"]
    assert services["sdk"]["profiles"] == ["sdk"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    assert services["triton"]["depends_on"]["build"]["condition"] == (
        "service_completed_successfully"
    )


def test_every_named_path_exists(compose):
    checked = 0
    for name, service in compose["services"].items():
        words = [expand(w) for w in service.get("command", [])]
        for path in named_paths(words):
            resolved = host_path(service, path)
            assert resolved is not None and resolved.exists(), f"{name}: {path}"
            checked += 1
        for volume in service.get("volumes", []):
            source = expand(volume).split(":")[0].removeprefix("./")
            assert (PROJECT_ROOT / source).exists() or source in GENERATED, f"{name}: {volume}"
    assert checked >= 4  # build, triton, locust and sdk each name one


def test_build_context_dockerfile_and_scripts_exist(compose):
    build = compose["services"]["build"]["build"]
    dockerfile = PROJECT_ROOT / build["context"] / build["dockerfile"]
    copied = re.findall(r"^COPY (.+) \S+$", dockerfile.read_text(), re.MULTILINE)
    sources = [s for line in copied for s in line.split()]
    assert sources and all((PROJECT_ROOT / s).exists() for s in sources), sources
    script = PROJECT_ROOT / "docker" / "build_engines.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    for path in named_paths(shlex.split(script.read_text(), comments=True)):
        assert (PROJECT_ROOT / path).exists(), f"build_engines.sh: {path}"
    assert all(
        line.strip() in (PROJECT_ROOT / ".gitignore").read_text() for line in ("models/", ".run/")
    )


def test_triton_service_is_gpu_ready_healthy_and_local(compose):
    triton = compose["services"]["triton"]
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert "localhost:8000" in " ".join(triton["healthcheck"]["test"])
    assert triton["restart"] in ("on-failure", "unless-stopped")
    for port in triton["ports"]:
        assert expand(port).startswith("127.0.0.1:"), port
    image = expand(compose["services"]["build"]["build"]["args"]["TRITON_IMAGE"])
    sdk_image = expand(compose["services"]["sdk"]["image"])
    for name, suffix in ((image, "-py3"), (sdk_image, "-py3-sdk")):
        match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d+)\.(\d+)" + suffix, name)
        assert match and (int(match[1]), int(match[2])) >= (26, 3), name


def test_openai_service_reaches_triton_and_the_tokenizer(compose):
    """The API starts once Triton is healthy, talks to it by service name, and mounts the
    models where the BLS's rendered config says the target (its tokenizer) is."""
    services = compose["services"]
    openai, triton = services["openai"], services["triton"]
    assert openai["command"] == ["python3", "-m", "specdec.openai_api"]
    assert openai["depends_on"]["triton"]["condition"] == "service_healthy"
    env = {k: str(v) for k, v in openai["environment"].items()}
    assert expand(env["TRITON_HOST"]) == "triton" and env["GRPC_PORT"] == "8001"
    assert any(expand(port).endswith(":8001") for port in triton["ports"])
    assert env["OPENAI_HOST"] == "0.0.0.0"  # inside its container; published on 127.0.0.1
    (port,) = openai["ports"]
    assert expand(port) == f"127.0.0.1:9000:{env['OPENAI_PORT']}"
    assert f"localhost:{env['OPENAI_PORT']}/health" in " ".join(openai["healthcheck"]["test"])
    checkpoint = f"{IMAGE_ROOT}/{TARGET_CHECKPOINT.default}"  # the BLS's, rendered in the image
    assert (
        host_path(openai, checkpoint)
        == host_path(triton, checkpoint)
        == (PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    )


def load_entrypoint():
    spec = importlib.util.spec_from_file_location(
        "triton_entrypoint", PROJECT_ROOT / "docker" / "triton_entrypoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def restrictions(command: list[str], flag: str) -> dict[str, tuple[set[str], str]]:
    """header name -> (the APIs it locks, the key) for one of the restriction flags."""
    groups = {}
    for value in [c.split("=", 1)[1] for c in command if c.startswith(flag + "=")]:
        apis, restriction = value.split(":", 1)
        header, key = restriction.split("=", 1)
        assert header not in groups
        groups[header] = (set(apis.split(",")), key)
    return groups


def test_entrypoint_restricts_apis_and_disables_model_control(tmp_path):
    command = load_entrypoint().server_command(tmp_path, {"TRITON_ADMIN_KEY": "secret"})
    assert command[0] == "/opt/tritonserver/bin/tritonserver"
    assert "--model-control-mode=none" in command
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        (apis, key) = restrictions(command, flag)["admin-key"]
        assert {"model-repository", "shared-memory"} <= apis and "inference" not in apis
        assert key == "secret"
        assert set(restrictions(command, flag)) == {"admin-key"}  # inference open: no key set
    unset = load_entrypoint().server_command(tmp_path, {})
    random_key = restrictions(unset, "--http-restricted-api")["admin-key"][1]
    assert len(random_key) == 32 and random_key != "secret"
    assert not any(c.startswith("--grpc-use-ssl") for c in command + unset)


def test_entrypoint_locks_inference_beside_the_admin_apis_and_turns_on_tls(tmp_path):
    """Both groups at once (Triton takes an API in one group only), health in neither."""
    require_openssl()
    make_ca(tmp_path, "ca")
    cert, key = make_server_certificate(tmp_path, "ca")  # real: dates and key pair are checked
    env = {
        "TRITON_INFERENCE_KEY": "infer-secret",
        "GRPC_SSL_CERT": str(cert),
        "GRPC_SSL_KEY": str(key),
    }
    command = load_entrypoint().server_command(tmp_path, env)
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        groups = restrictions(command, flag)
        assert set(groups) == {"inference-key", "admin-key"}
        inference, admin = groups["inference-key"][0], groups["admin-key"][0]
        assert {"inference", "metadata", "model-config"} <= inference
        assert not inference & admin and "health" not in inference | admin
        assert groups["inference-key"][1] == "infer-secret"
    assert "--grpc-use-ssl=true" in command
    assert f"--grpc-server-cert={cert}" in command and f"--grpc-server-key={key}" in command


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("TRITON_INFERENCE_KEY", "two words", "expected printable ASCII without spaces"),
        ("GRPC_SSL_CERT", "/opt/specdec/certs/missing.crt", "cannot read"),
    ],
)
def test_entrypoint_refuses_a_bad_setting_before_tritonserver_runs(
    tmp_path, variable, value, message
):
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(tmp_path), variable: value}
    if variable == "GRPC_SSL_CERT":
        env["GRPC_SSL_KEY"] = value
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "docker" / "triton_entrypoint.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"triton_entrypoint: {variable}: " in done.stderr and message in done.stderr
    if variable == "TRITON_INFERENCE_KEY":
        assert value not in done.stderr + done.stdout  # the key is never printed
    assert not (tmp_path / "model_repository").exists()  # nothing rendered, nothing started


def test_the_inference_key_and_tls_reach_triton_and_the_openai_api(compose):
    """One TRITON_INFERENCE_KEY for every Triton service and the API that calls them; the
    certificates' folder mounted where both read it."""
    services = compose["services"]
    triton, openai = services["triton"]["environment"], services["openai"]["environment"]
    assert triton["TRITON_INFERENCE_KEY"] == openai["TRITON_INFERENCE_KEY"]
    assert triton["TRITON_INFERENCE_KEY"] == "${TRITON_INFERENCE_KEY:-}"  # unset: not locked
    assert triton["GRPC_SSL_CERT"] == "${GRPC_SSL_CERT:-}"
    assert triton["GRPC_SSL_KEY"] == "${GRPC_SSL_KEY:-}"
    assert openai["GRPC_SSL_ROOT_CERT"] == "${GRPC_SSL_ROOT_CERT:-}"
    for name in ("triton", "openai"):
        mounts = {expand(v).split(":")[1]: expand(v) for v in services[name]["volumes"]}
        assert mounts["/opt/specdec/certs"].endswith(":ro"), name  # read-only: keys inside


@pytest.mark.parametrize("engine", ["tensorrt", "torch"])
def test_rendered_repository_for_the_gpu(compose, tmp_path, engine):
    environment = {k: expand(v) for k, v in compose["services"]["triton"]["environment"].items()}
    config = ServerConfig.from_env({**environment, "ENGINE": engine})
    config.run_dir = tmp_path
    repository = render_repository(config)
    text = (repository / "speculative_decoding" / "config.pbtxt").read_text()  # the engines'
    assert f'key: "engine" value: {{ string_value: "{engine}" }}' in text
    assert 'key: "device" value: { string_value: "cuda" }' in text
    assert 'key: "num_slots" value: { string_value: "64" }' in text
    for key in ("checkpoint", "draft_checkpoint"):
        checkpoint = re.search(rf'key: "{key}" value: \{{ string_value: "([^"]+)"', text)[1]
        assert Path(checkpoint).is_absolute() and checkpoint.startswith(str(PROJECT_ROOT))


# What the triton service sets that is no declared setting: the entrypoint's own.
ENTRYPOINT_VARIABLES = {"TRITON_ARGS"}
# ${NAME:-default}: the default when unset or empty; ${NAME-default}: only when unset.
WITH_DEFAULT = re.compile(r"\$\{(\w+)(:?-)([^}]*)\}")


def default_problem(name: str, operator: str, default: str) -> str | None:
    """Why a `${name<operator>default}` disagrees with the declaration (None: it agrees). An
    empty default leaves the variable unset (the declared default) where that is the GPU
    hosts' value too; ":-" would turn a set but empty PROPOSERS ("" = no speculation) into
    the default."""
    setting = BY_VARIABLE.get(name)
    if setting is None:
        return f"{name} is no declared setting (specdec/serving/settings.py)"
    if (operator == "-") != setting.empty_is_value:
        return f"{name}: use ${{{name}-...}} where empty is a value, else ${{{name}:-...}}"
    if default == "" and setting.gpu_default is None and not setting.empty_is_value:
        return None
    if default != setting.deployed_default:
        return f"{name}: default {default!r}, declared {setting.deployed_default!r}"
    setting.parse(name, default)
    return None


def environment_problems(environment: dict[str, str]) -> list[str]:
    problems = []
    for name, value in environment.items():
        match = WITH_DEFAULT.fullmatch(str(value))
        if name in ENTRYPOINT_VARIABLES:
            continue
        if match is None or match[1] != name:
            problems.append(f"{name}: {value!r} is not ${{{name}:-default}}")
        elif (problem := default_problem(*match.groups())) is not None:
            problems.append(problem)
    return problems


def test_the_services_set_declared_settings_with_their_declared_defaults(compose):
    """Every variable the build and triton services set is a declared setting, defaulting
    to its declared value (the GPU column's where it has one: DEVICE=cuda, DTYPE=auto)."""
    services = compose["services"]
    for name in ("build", "triton"):
        assert environment_problems(services[name]["environment"]) == [], name
    assert set(services["triton"]["environment"]) >= set(BY_VARIABLE)  # every one passed on
    # Negative controls: each kind of disagreement is seen.
    environment = dict(services["triton"]["environment"])
    environment |= {"MAX_QUEUE": "${MAX_QUEUE:-512}", "DEVICE": "${DEVICE:-}"}
    environment |= {"PROPOSERS": "${PROPOSERS:-draft_model,ngram}", "MAX_QUEU": "${MAX_QUEU:-1}"}
    assert len(environment_problems(environment)) == 4


def test_the_engine_build_scripts_defaults_are_the_declared_ones():
    """docker/build_engines.sh (the build service and Kubernetes' init container) defaults
    what it reads as the triton service does."""
    text = (PROJECT_ROOT / "docker" / "build_engines.sh").read_text()
    found = [m for m in WITH_DEFAULT.findall(text) if m[0] in BY_VARIABLE]
    assert {name for name, _, _ in found} >= {"TARGET_CHECKPOINT", "NUM_SLOTS", "DTYPE", "ENGINE"}
    assert [p for m in found if (p := default_problem(*m)) is not None] == []


def gpu_ids(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "count" not in device  # device_ids, not "any one GPU"
    return device["device_ids"]


def test_one_triton_service_per_gpu_and_one_gpu_by_default(compose):
    services = compose["services"]
    tritons = {n: s for n, s in services.items() if re.fullmatch(r"triton(-gpu\d+)?", n)}
    assert gpu_ids(tritons.pop("triton")) == ["0"]
    assert "profiles" not in services["triton"]  # `docker compose up`: one GPU
    for name, service in tritons.items():
        assert gpu_ids(service) == [name.removeprefix("triton-gpu")], name
        assert service["profiles"] and set(service["profiles"]) <= {"gpus-2", "gpus-4"}
        assert service["command"] == services["triton"]["command"]  # the same server
        assert service["environment"] == services["triton"]["environment"]
        assert service["depends_on"] == services["triton"]["depends_on"]  # built engines
    assert [n for n, s in tritons.items() if "gpus-2" in s["profiles"]] == ["triton-gpu1"]
    assert len([n for n, s in tritons.items() if "gpus-4" in s["profiles"]]) == 3
    host_ports = [expand(p) for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports))  # every profile at once: no clash


GATEWAY_VARIABLES = {
    "GATEWAY_KEYS_FILE",
    "MAX_CONCURRENT_PER_KEY",
    "TRITON_INFERENCE_KEY",
    "GATEWAY_SSL_CERT",
    "GRPC_SSL_CERT",
    "GRPC_SSL_ROOT_CERT",
}


def test_gateway_runs_the_project_image_with_the_security_settings(compose):
    """The gateway is `python -m specdec.gateway compose` in the project's image, with the
    settings `serve` reads (unset by default) and the certificates' folder read-only."""
    from specdec.gateway.config import COMPOSE_SERVICES

    services = compose["services"]
    gateway = services["gateway"]
    assert set(gateway["profiles"]) == {"gpus-2", "gpus-4"}
    assert gateway["restart"] == "unless-stopped"
    assert gateway["image"] == services["triton"]["image"] == "specdec-triton"
    assert gateway["command"] == ["python3", "-m", "specdec.gateway", "compose"]
    assert gateway["environment"] == {name: f"${{{name}:-}}" for name in GATEWAY_VARIABLES}
    certs = "${CERTS_DIR:-./.run/certs}:/opt/specdec/certs:ro"
    assert gateway["volumes"] == [certs] and certs in services["triton"]["volumes"]
    published = {expand(p).rsplit(":", 1)[1] for p in gateway["ports"]}
    assert {"8001", "8000", "8404"} == published
    tritons = [n for n in services if re.fullmatch(r"triton(-gpu\d+)?", n)]
    assert sorted(COMPOSE_SERVICES) == sorted(tritons)
    for name in ("openai", "locust", "sdk"):  # TRITON_HOST=gateway sends them through it
        assert "${TRITON_HOST:-triton}" in str(services[name])


def test_the_gateway_without_settings_renders_compose_config(compose, tmp_path):
    """The gateway service's own environment (empty strings: unset) renders what
    `compose-config` prints: no keys, no TLS; HAProxy checks it and then runs it."""
    from specdec.gateway.config import haproxy_binary, render_compose_config
    from specdec.gateway.serve import compose_command

    if haproxy_binary() is None:
        pytest.skip("haproxy not installed: the gateway refuses to start without it")
    gateway = compose["services"]["gateway"]
    env = {name: expand(value) for name, value in gateway["environment"].items()}
    assert set(env.values()) == {""}
    argv, haproxy_env = compose_command({**env, "RUN_DIR": str(tmp_path)})
    config_path = tmp_path / "gateway" / "haproxy.cfg"
    assert argv == [haproxy_binary(), "-db", "-f", str(config_path)]  # in the foreground
    text = config_path.read_text()
    assert text == render_compose_config()
    for name in [n for n in compose["services"] if re.fullmatch(r"triton(-gpu\d+)?", n)]:
        assert f"server {name} {name}:8001 resolvers docker " in text
    assert "ssl" not in text and "acl" not in text and "proto h2" in text
    assert haproxy_env == {**env, "RUN_DIR": str(tmp_path)}  # no key added
    assert not (tmp_path / "gateway" / "keys.lst").exists()


@pytest.mark.parametrize(
    ("settings", "variable"),
    [
        ({"GATEWAY_KEYS_FILE": "/opt/specdec/certs/missing.txt"}, "GATEWAY_KEYS_FILE"),
        (
            {"GATEWAY_KEYS_FILE": "{keys}", "TRITON_INFERENCE_KEY": "a secret"},
            "TRITON_INFERENCE_KEY",
        ),
        ({"GRPC_SSL_CERT": "/opt/specdec/certs/server.crt"}, "GRPC_SSL_ROOT_CERT"),
    ],
)
def test_the_gateway_refuses_a_bad_setting_before_haproxy_runs(
    compose, tmp_path, settings, variable
):
    """As `serve`: one line naming the variable (never a key), exit 2, nothing written."""
    from specdec.gateway.config import haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("haproxy not installed: the gateway refuses to start without it")
    (tmp_path / "keys.txt").write_text("a-secret-client-key\n")
    env = {k: expand(v) for k, v in compose["services"]["gateway"]["environment"].items()}
    env |= {k: str(tmp_path / "keys.txt") if v == "{keys}" else v for k, v in settings.items()}
    done = subprocess.run(
        [sys.executable, "-m", "specdec.gateway", "compose"],
        env={**env, "PATH": "/usr/bin:/bin", "RUN_DIR": str(tmp_path / "run")},
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"gateway: {variable}: ") and done.stderr.count("\n") == 1
    assert "secret" not in done.stderr + done.stdout
    assert not (tmp_path / "run").exists()


# -- the monitoring profile: Prometheus and Grafana -----------------------------------------
def mounted(service: dict, container_path: str) -> Path:
    """The repository file a service sees at `container_path` (a bind mount or below one)."""
    path = host_path(service, container_path)
    assert path is not None and path.exists(), container_path
    return path


def test_prometheus_scrapes_every_triton_service_and_the_gateway(compose):
    services = compose["services"]
    prometheus = services["prometheus"]
    flags = dict(arg.split("=", 1) for arg in prometheus["command"])
    config_path = mounted(prometheus, flags["--config.file"])
    config = yaml.safe_load(config_path.read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    tritons = {
        name
        for name, service in services.items()
        if service.get("image") == "specdec-triton"
        and "docker/triton_entrypoint.py" in service.get("command", [])
    }
    assert tritons == {"triton", "triton-gpu1", "triton-gpu2", "triton-gpu3"}
    # Each Triton service's metrics port inside the network (8002, whatever the host port).
    assert {f"{name}:8002" for name in tritons} | {"gateway:8404"} == targets
    for name in tritons:
        assert any(expand(p).endswith(":8002") for p in services[name]["ports"]), name
    assert all(expand(p).startswith("127.0.0.1:") for p in prometheus["ports"])
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: make prometheus (Debian's prometheus has it)")
    subprocess.run([promtool, "check", "config", str(config_path)], check=True)


def test_grafana_provisions_the_prometheus_service_and_the_dashboard(compose):
    services = compose["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    assert grafana["depends_on"] == ["prometheus"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    port = expand(prometheus["ports"][0]).rsplit(":", 1)[1]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == f"http://prometheus:{port}"
    # Grafana's $__rate_interval counts the scrape interval it is told.
    scrape = yaml.safe_load(mounted(prometheus, "/etc/prometheus/prometheus.yml").read_text())[
        "global"
    ]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "specdec.yaml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    dashboard = mounted(grafana, f"{folder}/speculative-decoding.json")
    assert dashboard == PROJECT_ROOT / "deploy" / "grafana" / "speculative-decoding.json"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted(grafana, home) == dashboard
    assert all(expand(p).startswith("127.0.0.1:") for p in grafana["ports"])
