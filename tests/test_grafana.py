"""The Grafana dashboard (deploy/grafana/): the committed JSON is what its generator makes,
it reads back into grafana-foundation-sdk's types unchanged and lays out on Grafana's grid,
and every panel's query returns series from a real Prometheus (Debian's `prometheus`,
`make prometheus`) scraping a real server under a short load."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from live import scrape
from specdec.client import generate, wait_until_idle
from specdec.paths import PROJECT_ROOT
from specdec.processes import end_with_parent, free_port, terminate

GENERATOR = PROJECT_ROOT / "deploy" / "grafana" / "dashboard.py"
COMMITTED = PROJECT_ROOT / "deploy" / "grafana" / "speculative-decoding.json"
PROMETHEUS_CONFIG = PROJECT_ROOT / "deploy" / "prometheus" / "prometheus.yml"
CONFIG_MAP = PROJECT_ROOT / "deploy" / "kubernetes" / "base" / "grafana-dashboard.yaml"
PANEL_TYPES = {"row", "timeseries"}
SCRAPE_S = 1
RATE_WINDOW = "1m"  # $__rate_interval as Grafana would set it for 1 s scrapes over a short run


def load_generator():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads(COMMITTED.read_text())


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, legend, expression) of every target."""
    return [(p["title"], t["legendFormat"], t["expr"]) for p in panels(board) for t in p["targets"]]


def test_the_committed_files_are_what_the_generator_makes(tmp_path):
    generator = load_generator()
    files = generator.render()
    assert set(files) == {COMMITTED, CONFIG_MAP}
    for path, text in files.items():
        assert path.read_text() == text, f"{path}: run deploy/grafana/dashboard.py"
    assert generator.main(["--check"]) == 0
    # The ConfigMap carries the dashboard's JSON exactly, labelled for Grafana's sidecar.
    config_map = yaml.safe_load(CONFIG_MAP.read_text())
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {COMMITTED.name: COMMITTED.read_text()}
    # --check sees a stale file.
    generator.OUTPUT = tmp_path / COMMITTED.name
    generator.OUTPUT.write_text("{}\n")
    assert generator.main(["--check"]) == 1


def read_back(board: dict) -> dict:
    """The dashboard parsed into the SDK's types (panels' and queries' plugin types too)
    and written back as JSON."""
    register_default_plugins()
    parsed = Dashboard.from_json(copy.deepcopy(board))
    return json.loads(json.dumps(parsed.to_json(), default=lambda o: o.to_json()))


def test_the_dashboard_reads_back_into_grafana_s_types_unchanged(board):
    """Grafana 11.6's dashboard model (the SDK's types, generated from Grafana's schema):
    parsing and writing back loses nothing, so no key is unknown to it."""
    assert read_back(board) == board
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 39
    # Negative controls: a misspelt key of the dashboard, a panel's field config or a
    # Prometheus query does not survive the types.
    for path, key in (
        (["panels", 1], "gridpos"),
        (["panels", 1, "targets", 0], "exp"),
        (["panels", 1, "fieldConfig", "defaults", "custom"], "linewidth"),
    ):
        bad = copy.deepcopy(board)
        node = bad
        for step in path:
            node = node[step]
        node[key] = 1
        assert read_back(bad) != bad, (path, key)


def test_panels_fit_grafana_s_grid_and_name_one_datasource(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        assert p["type"] in PANEL_TYPES, p["title"]
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{p['title']} overlaps another panel"
        cells |= covered
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels(board):
        assert p["targets"], p["title"]
        for target in [p, *p["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    refs = [[t["refId"] for t in p["targets"]] for p in panels(board)]
    assert all(len(r) == len(set(r)) for r in refs)


AGGREGATED = re.compile(
    r"sum( by \([a-z_]+\))? \(rate\(specdec_\w+\[[$\w]+\]\)\)|(sum|avg) \(specdec_\w+\)"
)


def test_every_query_sums_over_replicas(board):
    """One line per legend whatever the replicas: every metric a query reads sits inside an
    aggregation (a sum of its rate, or the sum or mean of a gauge)."""
    for title, _, expr in queries(board):
        assert AGGREGATED.search(expr), (title, expr)
        assert "specdec_" not in AGGREGATED.sub("", expr), (title, expr)
    assert "specdec_" in AGGREGATED.sub("", "rate(specdec_x_total[1m])")  # caught bare


# -- against a real Prometheus ---------------------------------------------------------------
def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )


def prometheus_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(server, tmp_path):
    """Prometheus with the compose file's configuration, scraping the test server's metrics
    port every second; yields its URL."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("prometheus is not installed: make prometheus (apt-get install prometheus)")
    port = free_port()
    # docker-compose.yml's configuration, its triton job pointed at the test server.
    settings = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    settings["global"] |= {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    (job,) = [j for j in settings["scrape_configs"] if j["job_name"] == "triton"]
    job["static_configs"] = [{"targets": [server.metrics_url.split("/")[2]]}]
    settings["scrape_configs"] = [job]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(settings))
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=end_with_parent,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if prometheus_query(base, "up"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.5)
        yield base
    finally:
        terminate(process, timeout=30)
        log.close()


# Lines that must show a value after the load (the others may be 0 or NaN: no prefix
# reuse, no queue, the adaptive k of fixed-k requests): (panel, legend).
MUST_MOVE = {
    ("Output tokens / s", "tokens/s"),
    ("Requests / s by outcome", "{{outcome}}"),
    ("Time to first token", "p50"),
    ("Inter-token latency", "mean"),
    ("End-to-end latency", "p99"),
    ("Tokens per target pass", "tokens / pass"),
    ("Loop time per iteration by part", "{{part}}"),
    ("Tokens per sequence", "output p50"),
}


@pytest.mark.server
def test_every_panel_query_returns_series_from_a_real_prometheus(server, prometheus, board):
    wait_until_idle(server.metrics_url)
    prompts = ["Count to ten:", "Name four fruits.", "Say hello in French.", "List two colours."]
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(
                lambda p: generate(p, url=server.url, max_tokens=12, num_draft_tokens=3), prompts
            )
        )
    assert all(r.error is None and r.text for r in results)
    emitted = scrape(server.metrics_url)["specdec_emitted_tokens_total"]
    # Prometheus has scraped the load's end (a sample at the final total), and one more.
    deadline = time.monotonic() + 60
    while True:
        samples = prometheus_query(prometheus, "specdec_emitted_tokens_total")
        if samples and float(samples[0]["value"][1]) >= emitted:
            break
        assert time.monotonic() < deadline, "Prometheus did not scrape the server"
        time.sleep(SCRAPE_S)
    time.sleep(2 * SCRAPE_S)
    lines = queries(board)
    assert MUST_MOVE <= {(title, legend) for title, legend, _ in lines}
    for title, legend, expr in lines:
        result = prometheus_query(prometheus, expr.replace("$__rate_interval", RATE_WINDOW))
        assert result, f"{title}: no series for {expr}"
        values = [float(series["value"][1]) for series in result]
        if (title, legend) in MUST_MOVE:
            assert any(math.isfinite(v) and v > 0 for v in values), (title, expr, values)
