"""The Grafana dashboard of the speculative decoding server, built from code.

    .venv/bin/python deploy/grafana/dashboard.py          # writes speculative-decoding.json
    .venv/bin/python deploy/grafana/dashboard.py --check  # exit 1 if the file differs

Built with grafana-foundation-sdk (its builders and types for Grafana 11.6). One page:
throughput and outcomes, latency quantiles from the histograms, capacity, speculation, where
the loop's time goes, prefix reuse. Every query sums over replicas (sum / sum by), so one
panel serves one server or many behind the gateway; the metric names are the BLS's
(specdec/serving/metric_names.py; tests/test_metric_names.py holds the file to them, and
tests/test_grafana.py runs every query against a real Prometheus scraping a real server).
Provisioned by docker-compose.yml's monitoring profile and, on Kubernetes, by the ConfigMap
in deploy/kubernetes/base/grafana-dashboard.yaml (Grafana's dashboard sidecar).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "speculative-decoding.json"
UID = "specdec-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def rate(series: str, by: str = "") -> str:
    """Per-second increase of a counter summed over replicas (and `by` labels)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({series}[{RATE}]))"


def quantiles(
    histogram: str, qs: tuple[float, ...] = QUANTILES, name: str = ""
) -> tuple[Query, ...]:
    """Quantiles (p50, p90, p99) of a histogram over every replica's buckets."""
    return tuple(
        Query(
            f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le')})",
            f"{name}p{round(q * 100)}",
        )
        for q in qs
    )


def mean(histogram: str) -> Query:
    return Query(f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}", "mean")


# Rows of panels, in page order.
ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Throughput",
        (
            PanelSpec(
                "Output tokens / s",
                "tokens/s",
                (Query(rate("specdec_emitted_tokens_total"), "tokens/s"),),
                "Output tokens emitted per second, every replica together.",
            ),
            PanelSpec(
                "Requests / s by outcome",
                "reqps",
                (Query(rate("specdec_requests_total", "outcome"), "{{outcome}}"),),
                "Client requests as they end: length, stop, end, cancelled, error, shutdown, "
                "invalid, rejected (queue full).",
            ),
        ),
    ),
    (
        "Latency",
        (
            PanelSpec(
                "Time to first token",
                "s",
                (*quantiles("specdec_time_to_first_token_seconds"),),
                "Arrival in the BLS to the first output token committed, per sequence.",
            ),
            PanelSpec(
                "Inter-token latency",
                "s",
                (
                    *quantiles("specdec_inter_token_latency_seconds"),
                    mean("specdec_inter_token_latency_seconds"),
                ),
                "Per output token after the first: the tokens one verify commits share the "
                "time since the sequence's previous commit (docs/operations.md).",
            ),
            PanelSpec(
                "End-to-end latency",
                "s",
                quantiles("specdec_end_to_end_latency_seconds"),
                "Arrival to the last response, per sequence that finished.",
            ),
            PanelSpec(
                "Queue time",
                "s",
                quantiles("specdec_queue_time_seconds"),
                "Arrival to a KV slot, per sequence.",
            ),
        ),
    ),
    (
        "Capacity",
        (
            PanelSpec(
                "Queue and KV slots",
                "short",
                (
                    Query("sum (specdec_queued_requests)", "waiting"),
                    Query("sum (specdec_running_batch_size)", "running"),
                    Query("sum (specdec_free_kv_slots)", "free slots"),
                ),
                "Sequences waiting for a slot, running, and slots free, every replica.",
            ),
            PanelSpec(
                "Tokens per sequence",
                "short",
                (
                    *quantiles("specdec_sequence_input_tokens", (0.5,), "input "),
                    *quantiles("specdec_sequence_output_tokens", (0.5,), "output "),
                ),
                "Median prompt and output tokens of the sequences that finished.",
            ),
        ),
    ),
    (
        "Speculation",
        (
            PanelSpec(
                "Acceptance by proposer",
                "percentunit",
                (
                    Query(
                        f"{rate('specdec_proposer_accepted_draft_tokens_total', 'proposer')} / "
                        f"{rate('specdec_proposer_draft_tokens_total', 'proposer')}",
                        "{{proposer}}",
                    ),
                ),
                "Draft tokens the target accepted / draft tokens proposed, by proposer.",
            ),
            PanelSpec(
                "Tokens per target pass",
                "short",
                (
                    Query(
                        f"{rate('specdec_emitted_tokens_total')} / "
                        f"{rate('specdec_target_passes_total')}",
                        "tokens / pass",
                    ),
                    Query("avg (specdec_current_num_draft_tokens)", "k (adaptive)"),
                ),
                "Output tokens per sequence verified (1 without speculation), and the cost "
                "model's k.",
            ),
        ),
    ),
    (
        "Loop",
        (
            PanelSpec(
                "Loop time per iteration by part",
                "s",
                (
                    Query(
                        f"{rate('specdec_loop_seconds_total', 'part')} / ignoring (part) "
                        f"group_left {rate('specdec_iterations_total')}",
                        "{{part}}",
                    ),
                ),
                "Seconds per iteration: cancel_check, draft, target, schedule, respond.",
            ),
            PanelSpec(
                "Prefix reuse",
                "short",
                (
                    Query(rate("specdec_prefix_hits_total"), "hits / s"),
                    Query(rate("specdec_prefix_reused_tokens_total"), "reused tokens / s"),
                    Query("sum (specdec_cached_prefixes)", "cached prefixes"),
                ),
                "Sequences that started from a reused prefix, the prompt positions reused, "
                "and the cached prefixes held.",
            ),
        ),
    ),
)


def panel(spec: PanelSpec, panel_id: int, width: int) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .unit(spec.unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
        .line_width(1)
        .fill_opacity(10)
    )
    for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
        built = built.with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(query.legend)
            .ref_id(ref)
            .datasource(DATASOURCE)
        )
    return built


def build() -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    board = (
        dashboard.Dashboard("Speculative decoding")
        .uid(UID)
        .description("Speculative decoding on Triton: throughput, latency, capacity, speculation")
        .tags(["specdec", "triton"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
    )
    panel_id = 1
    for title, specs in ROWS:
        board = board.with_row(dashboard.Row(title).id(panel_id))
        panel_id += 1
        for spec in specs:
            board = board.with_panel(panel(spec, panel_id, 24 // len(specs)))
            panel_id += 1
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = OUTPUT.exists() and OUTPUT.read_text() == text
        if not same:
            print(f"{OUTPUT} differs: run deploy/grafana/dashboard.py", file=sys.stderr)
        return 0 if same else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
