"""The metric families' table (specdec/serving/metric_names.py): the outcome rule of a request,
the table's shape, docs/operations.md's metrics table (its output, exactly), and every name
the docs, deploy/ and the code's readers use is declared there. Pure: no server."""

from __future__ import annotations

import re

import pytest
import yaml

from specdec.paths import PROJECT_ROOT as ROOT
from specdec.serving.metric_names import (
    FAMILIES,
    FAMILY_BY_NAME,
    FAMILY_BY_SERIES,
    HISTOGRAMS,
    REQUEST_OUTCOMES,
    SEQUENCE_OUTCOMES,
    le_label,
    markdown_table,
    request_outcome,
)

OPERATIONS = ROOT / "docs" / "operations.md"
REGENERATE = "regenerate: .venv/bin/python -m specdec.serving.metric_names"


@pytest.mark.parametrize(
    ("reasons", "outcome"),
    [
        (["end"], "end"),
        (["length"], "length"),
        (["stop"], "stop"),
        (["end", "end", "end"], "end"),
        (["end", "length"], "length"),  # one answer cut short: "length",
        (["length", "end"], "length"),  # whichever finished last
        (["end", "stop"], "stop"),
        (["stop", "length", "end"], "length"),
    ],
)
def test_a_finished_request_counts_under_its_most_truncating_reason(reasons, outcome):
    assert request_outcome(reasons) == outcome
    assert request_outcome(iter(reasons)) == outcome  # a generator, as the BLS passes


@pytest.mark.parametrize("reasons", [[], [None], ["cancelled"], ["end", "error"], ["invalid"]])
def test_only_a_request_whose_sequences_all_finished_has_a_normal_outcome(reasons):
    with pytest.raises(ValueError):
        request_outcome(reasons)


def test_the_table_declares_each_family_once_in_prometheus_form():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names)) == len(FAMILY_BY_NAME)
    for family in FAMILIES:
        assert re.fullmatch(r"specdec_[a-z0-9_]+", family.name), family.name
        assert family.kind in ("counter", "gauge", "histogram"), family
        # Prometheus naming: counters end in _total, gauges and histograms do not; a
        # histogram's name ends in its unit, and /metrics adds _bucket, _sum and _count.
        assert family.name.endswith("_total") == (family.kind == "counter"), family.name
        if family.kind == "histogram":
            assert family.name.endswith(("_seconds", "_tokens")), family.name
            assert family.buckets and "le" not in family.labels, family.name
        else:
            assert not family.buckets, family.name
        assert family.help and "|" not in family.help and "\n" not in family.help, family.name
        assert "model" not in family.labels  # every metric carries it already
    # A sequence's outcome is also its request's when the request ends with it.
    assert set(SEQUENCE_OUTCOMES) < set(REQUEST_OUTCOMES)
    assert {"invalid", "rejected"} == set(REQUEST_OUTCOMES) - set(SEQUENCE_OUTCOMES)
    # No series of one family is named like another family or its series.
    assert len(FAMILY_BY_SERIES) == sum(len(f.series) for f in FAMILIES)


def test_histograms_export_three_series_and_their_le_labels_read_back():
    for family in HISTOGRAMS:
        assert family.series == tuple(family.name + s for s in ("_bucket", "_sum", "_count"))
        for bound in family.buckets:
            assert float(le_label(bound)) == bound, (family.name, bound)
    assert le_label(float("inf")) == "+Inf" and le_label(0.0025) == "0.0025"
    assert le_label(1.0) == "1" and le_label(16384) == "16384"


def documented_rows(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("| `specdec_")]


def metrics_section() -> str:
    text = OPERATIONS.read_text()
    return text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]


def test_the_operations_metrics_table_is_the_table():
    section = metrics_section()
    rows = documented_rows(section)
    documented = {re.match(r"\| `(\w+)", row)[1] for row in rows}
    declared = set(FAMILY_BY_NAME)
    assert not declared - documented, f"not documented: {sorted(declared - documented)}"
    assert not documented - declared, f"documented, not declared: {sorted(documented - declared)}"
    # Names, kinds, label names and meanings, in the table's order.
    assert markdown_table() in section, REGENERATE


def test_other_tables_of_operations_repeat_the_tables_rows():
    """A row elsewhere in docs/operations.md (the prefix cache's section) says what the
    table says."""
    declared = set(markdown_table().splitlines())
    rows = documented_rows(OPERATIONS.read_text())
    assert len(rows) > len(FAMILIES)  # the metrics table and at least one other
    for row in rows:
        assert row in declared, f"{row}\n{REGENERATE} and copy its rows"


def adapter_metric_names() -> set[str]:
    """Names prometheus-adapter serves (deploy/kubernetes/prometheus-adapter): derived
    metrics, not the BLS's."""
    config = yaml.safe_load(
        (ROOT / "deploy" / "kubernetes" / "prometheus-adapter" / "config.yaml").read_text()
    )
    return {rule["name"]["as"] for rule in config["rules"]}


def named_metrics() -> dict[str, set[str]]:
    """Every specdec_ metric name the docs, deploy/ (its dashboards too) and the code's string
    literals use, with where."""
    found: dict[str, set[str]] = {}
    prose = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    prose += [*(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "deploy").rglob("*.json")]
    for path in prose:
        for name in re.findall(r"\bspecdec_[a-z0-9_]+", path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for folder in ("specdec", "tests", "loadtest"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"[\"'](specdec_[a-z0-9_]+)", path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_docs_deploy_and_readers_name_only_declared_metrics():
    found = named_metrics()
    assert "specdec_requests_total" in found and "specdec_sequences_total" in found
    unknown = {
        name: sorted(where)
        for name, where in found.items()
        if name not in FAMILY_BY_NAME
        and name not in FAMILY_BY_SERIES
        and name not in adapter_metric_names()
    }
    assert not unknown, unknown
