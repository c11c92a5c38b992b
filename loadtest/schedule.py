"""`make loadtest`'s plan and its accounting: modes interleaved in windows within each stage.

The plan: stages of users (1, 4, 16, ... 512); within a stage the modes take turns in windows
in mirrored order (k0 adaptive k0-again k0-again adaptive k0, reversed at the next stage), as
`make bench` does, so that drift in the machine's speed over a stage hits every mode alike,
and k = 0 against itself (k0-again) is the run's noise floor. A user's request takes the
mode of the window it leaves in.

The accounting works in the server's time. With more users than KV slots, a request waits
in the queue before it runs, so a mode switch at the client reaches the running batch a
queue's wait later, and for one request's service time the batch mixes both modes. Each
response carries the request's server times (arrival, first scheduled, first token, last
token: return_perf_metrics), and the queue is first come, first served. A segment (one or
more adjacent windows of one stage and mode) is therefore measured over its *pure*
interval: from the last token of any earlier-sent request of another segment to the moment
the first later-sent request of another segment got a slot. In it, every running request
is the segment's own. Over that interval the server's token counter (sampled every half
second, interpolated) and the tokens the users received (by arrival time) are set side by
side; TTFT counts the segment's requests; inter-chunk times the gaps that fall inside.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from common import mirrored_order, percentile

STAGES = [1, 4, 16, 64, 128, 256, 512]


@dataclass
class PlannedWindow:
    """A stretch of the run in which `users` users send in `mode` (bench.MeasuredWindow is
    `make bench`'s: counted as it runs)."""

    index: int
    users: int
    mode: str
    start_s: float  # seconds from the run's start
    end_s: float


def window_seconds(users: int, base: float) -> float:
    """A window's length: `base` up to 16 users; beyond, longer, as one request's service
    time (its time in a slot) grows with the batch and a segment loses one service time to
    each mode switch (2x base at 64 users, 3x from 128)."""
    if users <= 16:
        return base
    return base * (2.0 if users <= 64 else 3.0)


def build_plan(stages: list[int], modes: list[str], base_seconds: float) -> list[PlannedWindow]:
    """Every stage's windows back to back: each mode twice in mirrored order (A B C C B A,
    the order reversed from stage to stage), as `make bench` orders its levels' windows."""
    windows: list[PlannedWindow] = []
    t = 0.0
    for i, users in enumerate(stages):
        seconds = window_seconds(users, base_seconds)
        for mode in mirrored_order(modes, i):
            windows.append(PlannedWindow(len(windows), users, mode, t, t + seconds))
            t += seconds
    return windows


def window_at(plan: list[PlannedWindow], run_time: float) -> PlannedWindow | None:
    """The window in force `run_time` seconds into the run (None: after the last)."""
    starts = [w.start_s for w in plan]
    i = bisect.bisect_right(starts, run_time) - 1
    if i < 0 or run_time >= plan[-1].end_s:
        return None
    return plan[i]


@dataclass
class Segment:
    """Adjacent windows of one stage and mode, and its pure interval (Unix ns)."""

    users: int
    mode: str
    windows: list[int]
    start_ns: int = 0  # pure interval; start >= end: none (a switch never settled)
    end_ns: int = 0
    requests: list[dict] = field(default_factory=list)  # the records sent in its windows

    @property
    def key(self) -> tuple[int, str]:
        return self.users, self.mode

    @property
    def seconds(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


def segments_of(plan: list[PlannedWindow], records: list[dict]) -> list[Segment]:
    """Groups adjacent same-stage same-mode windows; assigns each record by its window."""
    segments: list[Segment] = []
    by_window: dict[int, Segment] = {}
    for (users, mode), group in itertools.groupby(plan, key=lambda w: (w.users, w.mode)):
        indices = [w.index for w in group]
        segment = Segment(users, mode, indices)
        segments.append(segment)
        by_window.update({i: segment for i in indices})
    for record in records:
        segment = by_window.get(record.get("window", -1))
        if segment is not None:
            segment.requests.append(record)
    return segments


def served(record: dict) -> bool:
    """The server ran it (it has server times: not refused, not broken before a token)."""
    return bool(record.get("first_scheduled_ns"))


def set_pure_intervals(segments: list[Segment], cancels_heard: bool = False) -> None:
    """Each segment's pure interval from the server times of the requests around it.
    A request Locust cut off (fewer users, or the end of the run) may run on: through the
    ensemble, whose steps never hear of a cancellation, to its end (unknown); sent to the
    BLS itself (`cancels_heard`), only until the cut."""
    for i, segment in enumerate(segments):
        before = [r for s in segments[:i] for r in s.requests if served(r)]
        after = [r for s in segments[i + 1 :] for r in s.requests if served(r)]
        own = [r for r in segment.requests if served(r)]
        if not own:
            segment.start_ns = segment.end_ns = 0
            continue
        ends = [end_of(r, cancels_heard) for r in before]
        start = max([min(r["first_scheduled_ns"] for r in own), *ends])
        if after:
            end = min(r["first_scheduled_ns"] for r in after)
        else:  # the run's last segment: until its last token
            end = max(r.get("last_token_ns") or 0 for r in own)
        segment.start_ns, segment.end_ns = int(min(start, 2**62)), int(end)


def end_of(record: dict, cancels_heard: bool) -> float:
    """When a served request left the running batch, as far as the records tell."""
    if record["outcome"] == "unfinished":
        return record["done_ns"] if cancels_heard else float("inf")
    return record.get("last_token_ns") or record["first_scheduled_ns"]


def counter_between(samples: list[tuple[float, float]], start_s: float, end_s: float) -> float:
    """A counter's growth from start_s to end_s, linear between (time, value) samples."""

    def at(t: float) -> float:
        times = [s[0] for s in samples]
        i = bisect.bisect_left(times, t)
        if i == 0:
            return samples[0][1]
        if i == len(samples):
            return samples[-1][1]
        (t0, v0), (t1, v1) = samples[i - 1], samples[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1

    return at(end_s) - at(start_s)


def gauge_between(samples: list[tuple[float, float]], start_s: float, end_s: float) -> list:
    return [v for t, v in samples if start_s <= t <= end_s]


def client_tokens_between(records: list[dict], start_ns: int, end_ns: int) -> int:
    """Output tokens whose response arrived at a user inside [start_ns, end_ns)."""
    total = 0
    for record in records:
        before = 0
        chunks = zip(record.get("chunk_ns", []), record.get("chunk_tokens", []), strict=True)
        for ns, tokens in chunks:
            if start_ns <= ns < end_ns:
                total += tokens - before
            before = tokens
    return total


def summarize_segments(
    segments: list[Segment], records: list[dict], metrics: dict[str, list]
) -> list[dict]:
    """One row per stage and mode, its segments pooled. `metrics`: name -> [(unix s,
    value)] samples of specdec_emitted_tokens_total and specdec_queued_requests."""
    rows = []
    keys = list(dict.fromkeys(s.key for s in segments))
    for users, mode in keys:
        mine = [s for s in segments if s.key == (users, mode)]
        intervals = [(s.start_ns, s.end_ns) for s in mine if s.end_ns > s.start_ns]
        seconds = sum(b - a for a, b in intervals) / 1e9
        server_tokens = sum(
            counter_between(metrics["emitted"], a / 1e9, b / 1e9) for a, b in intervals
        )
        client_tokens = sum(client_tokens_between(records, a, b) for a, b in intervals)
        queued = [
            v for a, b in intervals for v in gauge_between(metrics["queued"], a / 1e9, b / 1e9)
        ]
        requests = [r for s in mine for r in s.requests]
        rows.append(
            {
                "users": users,
                "mode": mode,
                "requests": len(requests),
                "failures": sum(r["outcome"] == "failed" for r in requests),
                "refusals": sum(r["outcome"] == "refused" for r in requests),
                "refusal_p99_s": percentile(
                    [
                        (r["done_ns"] - r["sent_ns"]) / 1e9
                        for r in requests
                        if r["outcome"] == "refused"
                    ],
                    99,
                ),
                "counted_s": round(seconds, 2),
                "server_tokens_per_s": server_tokens / seconds if seconds else None,
                "client_tokens_per_s": client_tokens / seconds if seconds else None,
                "client_over_server": client_tokens / server_tokens if server_tokens else None,
                **ttft_figures(requests),
                **inter_chunk_figures(requests, intervals),
                "queue_mean": sum(queued) / len(queued) if queued else None,
                "queue_max": max(queued) if queued else None,
                "draft_tokens_per_output_token": drafted_per_token(requests),
                **validity_counts(requests),
            }
        )
    return rows


def validity_counts(requests: list[dict]) -> dict[str, int | None]:
    """Of the guided answers (structured: records with a `validity`), how many were valid,
    invalid and cut (structured.check); None each where the requests had none."""
    verdicts = [r["validity"] for r in requests if "validity" in r]
    names = ("valid", "invalid", "cut")
    if not verdicts:
        return {f"{name}_outputs": None for name in names}
    return {f"{name}_outputs": verdicts.count(name) for name in names}


def ttft_figures(requests: list[dict]) -> dict:
    """Client (send to first arrival) and server (arrival to first token) TTFT, over the
    requests that had a first token: the same requests on both sides."""
    pairs = [
        ((r["chunk_ns"][0] - r["sent_ns"]) / 1e9, (r["first_token_ns"] - r["arrival_ns"]) / 1e9)
        for r in requests
        if r.get("chunk_ns") and r.get("first_token_ns") and r.get("arrival_ns")
    ]
    client = [c for c, _ in pairs]
    server = [s for _, s in pairs]
    return {
        "ttft_requests": len(pairs),
        "ttft_p50_s": percentile(client, 50),
        "ttft_p99_s": percentile(client, 99),
        "server_ttft_p50_s": percentile(server, 50),
        "server_ttft_p99_s": percentile(server, 99),
    }


def inter_chunk_figures(requests: list[dict], intervals: list[tuple[int, int]]) -> dict:
    """Gaps between a request's consecutive responses, both inside a pure interval."""
    gaps = []
    for r in requests:
        for a, b in itertools.pairwise(r.get("chunk_ns", [])):
            if any(start <= a and b < end for start, end in intervals):
                gaps.append((b - a) / 1e9)
    return {
        "inter_chunk_p50_s": percentile(gaps, 50),
        "inter_chunk_p99_s": percentile(gaps, 99),
    }


def drafted_per_token(requests: list[dict]) -> float:
    ok = [r for r in requests if r["outcome"] == "ok"]
    tokens = sum(r.get("tokens", 0) for r in ok)
    return sum(r.get("drafted", 0) for r in ok) / tokens if tokens else 0.0
