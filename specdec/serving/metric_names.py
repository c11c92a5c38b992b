"""The Prometheus metric families of speculative_decoding, declared in one table.

Pure, so that the BLS's metrics (serving/metrics.py, which creates them from FAMILIES), the
bench, the tests and docs/operations.md (its metrics table is `python -m
specdec.serving.metric_names`; tests/test_metric_names.py compares) read one definition.
Every family also carries the label model="speculative_decoding".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Where the loop's time goes, per iteration: asking Triton which streams were cancelled,
# the draft model's call, the target's call, the rest of the scheduler's step (admission,
# proposers, the cost model, acceptance), and building the responses and handing them to
# the outbox (serving/outbox.py; it waits only when the outbox is two iterations behind).
LOOP_PARTS = ("cancel_check", "draft", "target", "schedule", "respond")
# Seconds the outbox spent sending responses and applying metric updates.
OUTBOX_SECONDS = "specdec_outbox_seconds_total"
# Client requests, each counted once when its final response is decided, and the sequences
# they ran (one per prompt and per num_return_sequences): specdec_requests_total{outcome=...},
# specdec_sequences_total{outcome=...}.
REQUESTS = "specdec_requests_total"
SEQUENCES = "specdec_sequences_total"
# A sequence ends by its end token, max_tokens (or the context), a stop word, or with its
# request: cancelled, an engine error, shutdown.
SEQUENCE_OUTCOMES = ("end", "length", "stop", "cancelled", "error", "shutdown")
# A request also ends refused before any sequence ran: bad input, queue full, or an error.
REQUEST_OUTCOMES = (*SEQUENCE_OUTCOMES, "invalid", "rejected")
# A request whose sequences all finished counts under the first of these that one of them
# ended with: an answer cut short outweighs one stopped by a stop word, which outweighs the
# model's own end (request_outcome).
NORMAL_ENDS = ("length", "stop", "end")
# The engine calls the loop makes, and the bytes their results bring back through Triton
# (specdec_engine_calls_total{call=...}, specdec_engine_result_bytes_total{call=...}).
ENGINE_CALLS = "specdec_engine_calls_total"
ENGINE_RESULT_BYTES = "specdec_engine_result_bytes_total"
ENGINE_CALL_KINDS = ("draft", "target")
# Target passes by the tokens the sequence emitted in them (accepted + 1; 0 when its end
# token came first): specdec_target_passes_by_tokens_total{tokens="0".."max k + 1"}.
PASSES_BY_TOKENS = "specdec_target_passes_by_tokens_total"
# 1 once the start-up cost measurement is over (done, turned off or given up), 0 before:
# until then requests wait (specdec/loop/calibration.py).
CALIBRATED = "specdec_calibrated"
# Latency and size histograms, one observation per sequence (per output token for the
# inter-token latency): specdec/serving/histograms.py keeps their bucket counts in plain Python
# and the BLS pushes the cumulative series once per iteration as counters
# (<name>_bucket{le=...}, <name>_sum, <name>_count), which PromQL's histogram_quantile reads
# as a histogram whatever their TYPE line says. Their buckets span a GPU's pace (ms per token)
# and a 2-core CPU's under load (seconds); docs/operations.md, Latency histograms.
TIME_TO_FIRST_TOKEN = "specdec_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "specdec_inter_token_latency_seconds"
END_TO_END_LATENCY = "specdec_end_to_end_latency_seconds"
QUEUE_TIME = "specdec_queue_time_seconds"
INPUT_TOKENS = "specdec_sequence_input_tokens"
OUTPUT_TOKENS = "specdec_sequence_output_tokens"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")  # what a histogram exports, by suffix


@dataclass(frozen=True)
class Family:
    """One metric family: its HELP text is also its meaning in docs/operations.md."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()  # label names besides model (a histogram's le aside)
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, increasing (+Inf implied)

    @property
    def series(self) -> tuple[str, ...]:
        """The names it exports: a histogram's three series, another family's own name."""
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in HISTOGRAM_SERIES)
        return (self.name,)


def le_label(bound: float) -> str:
    """A bucket's le label as Prometheus writes it: 0.005, 1, 2.5, +Inf."""
    return "+Inf" if bound == float("inf") else f"{bound:g}"


def _listed(values: Iterable[str]) -> str:
    return ", ".join(values)


def _bucket_list(buckets: tuple[float, ...]) -> str:
    return ", ".join(le_label(bound) for bound in buckets)


SECONDS_HELP = "; buckets (le, seconds): "
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INPUT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
OUTPUT_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


FAMILIES = (
    Family("specdec_draft_tokens_total", "counter", "Draft tokens proposed"),
    Family("specdec_accepted_draft_tokens_total", "counter", "Draft tokens the target accepted"),
    Family(
        "specdec_target_passes_total",
        "counter",
        "Sequences verified by the target (one per sequence per iteration)",
    ),
    Family("specdec_iterations_total", "counter", "Loop iterations (one target call each)"),
    Family("specdec_emitted_tokens_total", "counter", "Output tokens emitted"),
    Family(
        REQUESTS,
        "counter",
        "Client requests by outcome, each counted once, when its final response is decided: "
        f"{_listed(NORMAL_ENDS)} once every sequence finished (the first of these among the "
        "sequences' reasons); cancelled, error (an engine error, or an internal error before "
        "the loop), shutdown; invalid (bad input) and rejected (queue full), refused before "
        "any sequence ran",
        ("outcome",),
    ),
    Family(
        SEQUENCES,
        "counter",
        "Sequences (one per prompt of a request and per num_return_sequences) by how they "
        "ended: end (end token), length (max_tokens or the context), stop (a stop word), or "
        "with their request: cancelled, error, shutdown",
        ("outcome",),
    ),
    Family(
        "specdec_running_batch_size",
        "gauge",
        "Sequences in the running batch (each holds a KV slot)",
    ),
    Family(
        "specdec_queued_requests",
        "gauge",
        "Sequences waiting for a KV slot (every sequence of the queued requests)",
    ),
    Family(
        "specdec_current_num_draft_tokens",
        "gauge",
        "the draft model's k for its adaptive rows, as the cost model chose it",
    ),
    Family("specdec_free_kv_slots", "gauge", "KV-cache slots free in each engine"),
    Family(
        CALIBRATED,
        "gauge",
        "1 once the start-up measurement of the engines' costs is over (done, off or given "
        "up), 0 before; requests wait until then",
    ),
    Family(
        "specdec_loop_seconds_total",
        "counter",
        "Seconds the loop spent, by part: cancel_check (asking Triton which streams were "
        "cancelled), draft and target (the engine calls), schedule (the rest of the step: "
        "admission, proposers, the cost model, acceptance), respond (building the responses and "
        "handing them, with the metric updates, to the outbox; inline, the default, that "
        "includes sending them)",
        ("part",),
    ),
    Family(
        OUTBOX_SECONDS,
        "counter",
        "Seconds the outbox spent sending responses and applying metric updates (each a "
        "round trip to the server process); with the response thread on (RESPONSE_THREAD) "
        "beside the loop, so it overlaps the loop's parts",
    ),
    Family(
        PASSES_BY_TOKENS,
        "counter",
        "Target passes by the tokens the sequence emitted in them (accepted + 1; 0 when its "
        'end token came first), tokens="0" to max k + 1; they sum to '
        "specdec_target_passes_total",
        ("tokens",),
    ),
    Family(
        ENGINE_CALLS,
        "counter",
        "Engine model calls by the loop: draft (0 or more per iteration), target (one per "
        "iteration that ran)",
        ("call",),
    ),
    Family(
        ENGINE_RESULT_BYTES,
        "counter",
        "Bytes the engine calls' results brought back through Triton, draft and target",
        ("call",),
    ),
    Family(
        "specdec_proposer_draft_tokens_total",
        "counter",
        "Draft tokens proposed, by proposer",
        ("proposer",),
    ),
    Family(
        "specdec_proposer_accepted_draft_tokens_total",
        "counter",
        "Draft tokens the target accepted, by proposer",
        ("proposer",),
    ),
    Family(
        "specdec_prefix_hits_total",
        "counter",
        "Sequences that started from a reused prefix",
    ),
    Family(
        "specdec_prefix_reused_tokens_total",
        "counter",
        "Prompt positions reused from a cached or running sequence instead of prefilled",
    ),
    Family(
        "specdec_prefix_evictions_total",
        "counter",
        "Cached prefixes dropped to give their slot to a new sequence",
    ),
    Family("specdec_cached_prefixes", "gauge", "Free KV slots that hold a reusable prefix"),
    Family(
        "specdec_suffix_store_bytes",
        "gauge",
        "The suffix proposer's store of earlier requests' text: its size as counted, in bytes "
        "(at most SUFFIX_STORE_BYTES)",
    ),
    Family("specdec_suffix_store_tokens", "gauge", "Tokens of text the suffix store holds"),
    Family(
        "specdec_suffix_store_evicted_tokens_total",
        "counter",
        "Tokens of text evicted from the suffix store (the oldest first) to keep its bound",
    ),
    Family(
        "specdec_suffix_store_evictions_total",
        "counter",
        "Requests' texts evicted from the suffix store",
    ),
    Family(
        TIME_TO_FIRST_TOKEN,
        "histogram",
        "Seconds from a sequence's arrival in the BLS to its first output token, committed "
        "(first_token_time_ns - arrival_time_ns; queue and prefill included), one observation "
        "per sequence that emitted a token" + SECONDS_HELP + _bucket_list(TTFT_BUCKETS),
        buckets=TTFT_BUCKETS,
    ),
    Family(
        INTER_TOKEN_LATENCY,
        "histogram",
        "Seconds between a sequence's output tokens, one observation per token after its "
        "first: the n tokens one iteration commits share the time since the sequence's "
        "previous commit (n observations of gap / n; those committed with the first token, 0), "
        "so a sequence's observations sum to last_token_time_ns - first_token_time_ns; "
        "stream_interval changes what clients receive, not this"
        + SECONDS_HELP
        + _bucket_list(ITL_BUCKETS),
        buckets=ITL_BUCKETS,
    ),
    Family(
        END_TO_END_LATENCY,
        "histogram",
        "Seconds from a sequence's arrival to its last response (built at the end of the "
        "iteration that finished it), for sequences that finished "
        f"({_listed(NORMAL_ENDS)})" + SECONDS_HELP + _bucket_list(E2E_BUCKETS),
        buckets=E2E_BUCKETS,
    ),
    Family(
        QUEUE_TIME,
        "histogram",
        "Seconds a sequence waited for its KV slot (first_scheduled_time_ns - "
        "arrival_time_ns), observed with its first output token"
        + SECONDS_HELP
        + _bucket_list(QUEUE_BUCKETS),
        buckets=QUEUE_BUCKETS,
    ),
    Family(
        INPUT_TOKENS,
        "histogram",
        f"Prompt tokens per sequence that finished ({_listed(NORMAL_ENDS)}); buckets (le, "
        "tokens): " + _bucket_list(INPUT_TOKEN_BUCKETS),
        buckets=INPUT_TOKEN_BUCKETS,
    ),
    Family(
        OUTPUT_TOKENS,
        "histogram",
        f"Output tokens per sequence that finished ({_listed(NORMAL_ENDS)}); buckets (le, "
        "tokens): " + _bucket_list(OUTPUT_TOKEN_BUCKETS),
        buckets=OUTPUT_TOKEN_BUCKETS,
    ),
)
FAMILY_BY_NAME = {family.name: family for family in FAMILIES}
HISTOGRAMS = tuple(family for family in FAMILIES if family.kind == "histogram")
# Every series name /metrics shows -> its family (a histogram's _bucket, _sum, _count).
FAMILY_BY_SERIES = {series: family for family in FAMILIES for series in family.series}


def request_outcome(sequence_reasons: Iterable[str | None]) -> str:
    """The outcome of a request whose sequences all finished, from their finish reasons:
    the first of NORMAL_ENDS among them ("length" and "end" give "length")."""
    reasons = set(sequence_reasons)
    unexpected = reasons - set(NORMAL_ENDS)
    if unexpected or not reasons:
        raise ValueError(f"not a request whose sequences all finished: {sorted(map(str, reasons))}")
    return next(outcome for outcome in NORMAL_ENDS if outcome in reasons)


def markdown_table() -> str:
    """docs/operations.md's metrics table."""
    lines = ["| metric | kind | meaning |", "|---|---|---|"]
    for family in FAMILIES:
        labels = ", ".join(f"{label}=..." for label in family.labels)
        name = f"{family.name}{{{labels}}}" if labels else family.name
        lines.append(f"| `{name}` | {family.kind} | {family.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
