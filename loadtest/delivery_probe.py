"""Where a streamed response waits between the server and a gevent user (issue 18).

    .venv/bin/python loadtest/delivery_probe.py --path per-user --users 256 --seconds 90

Runs `--users` greenlets under gevent with gRPC's gevent mode, as Locust does, each sending
streamed requests back to back, by one of two paths:
- per-user: one tritonclient InferenceServerClient (one channel, one stream) per user and
  its callback, as loadtest/locustfile.py did before issue 18;
- shared: loadtest/grpc_streams.StreamPool, a few channels for all users.
Per response it takes three times (Unix ns, one machine's clock): `server` the response's
last token (last_token_time_ns, return_perf_metrics), `callback` when gRPC handed it to
Python (per-user: tritonclient's callback; shared: the greenlet's read), `user` when the
user's greenlet had it. Every 0.5 s it samples gevent's hub thread pool (threads, tasks
waiting) and the hub's lag (a 100 ms sleep's overshoot). Prints the delays' percentiles,
the pool, and over the steady part the client's output tokens against the server's
specdec_emitted_tokens_total and client against server time to first token (p50). Writes
results/probe-<path>-<users>.json.
"""

from __future__ import annotations

import os

# Name lookups in the hub: gevent's default resolver runs them in the hub's thread pool,
# which the per-user path fills with gRPC polls (the metrics scrape would wait behind them).
os.environ.setdefault("GEVENT_RESOLVER", "block")

from gevent import monkey  # noqa: E402

monkey.patch_all()

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import grpc.experimental.gevent as grpc_gevent  # noqa: E402

grpc_gevent.init_gevent()

import tritonclient.grpc as grpcclient  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_streams import StreamPool  # noqa: E402

from report import percentile  # noqa: E402
from specdec.client import build_inputs, requested_outputs, scrape_metrics  # noqa: E402
from specdec.paths import PROJECT_ROOT  # noqa: E402

PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def params(max_tokens: int, k: int) -> dict:
    return dict(
        max_tokens=max_tokens,
        stream=True,
        num_draft_tokens=k,
        exclude_input_in_output=True,
        return_perf_metrics=True,
        return_num_output_tokens=True,
    )


def scalar(response, name: str) -> int:
    value = response.as_numpy(name)
    return 0 if value is None else int(value.reshape(-1)[0])


def per_user(url: str, deadline: float, args, rows: list, requests: list) -> None:
    """One tritonclient stream of its own; its callback stamps each response."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: responses.put((result, error, time.time_ns()))
    )
    p = params(args.max_tokens, args.num_draft_tokens)
    while time.time() < deadline:
        sent, first, key = time.time_ns(), None, len(requests) + 1000 * id(responses)
        client.async_stream_infer(
            "ensemble",
            build_inputs(PROMPT, **p),
            outputs=requested_outputs(**p),
            enable_empty_final_response=True,
        )
        while True:
            response, error, callback_ns = responses.get()
            user_ns = time.time_ns()
            if error is not None:
                requests.append({"error": str(error)})
                break
            final = response.get_response().parameters.get("triton_final_response")
            if response.as_numpy("text_output") is not None:
                tokens = scalar(response, "num_output_tokens")
                server_ns = scalar(response, "last_token_time_ns")
                rows.append((key, server_ns, callback_ns, user_ns, tokens))
                if first is None:  # the request's entry, at its first token
                    first = user_ns
                    server_ttft = scalar(response, "first_token_time_ns") - scalar(
                        response, "arrival_time_ns"
                    )
                    requests.append({"sent": sent, "first": first, "server_ttft_ns": server_ttft})
            if final is not None and final.bool_param:
                break
    client.stop_stream(cancel_requests=True)
    client.close()


def shared(pool: StreamPool, deadline: float, args, rows: list, requests: list) -> None:
    """StreamPool's call, read by this greenlet: callback and user are one time."""
    p = params(args.max_tokens, args.num_draft_tokens)

    def on_chunk(result) -> None:  # each response with text, as it arrives
        ns = result.chunk_ns[-1]
        server_ns = int(result.metrics.get("last_token_time_ns", 0))
        rows.append((id(result), server_ns, ns, ns, result.chunk_tokens[-1]))
        if len(result.chunk_ns) == 1:  # the request's entry, at its first token
            requests.append(
                {
                    "sent": result.sent_ns,
                    "first": ns,
                    "server_ttft_ns": int(1e9 * (result.server_time_to_first_token or 0)),
                }
            )

    while time.time() < deadline:
        result = pool.generate(PROMPT, on_chunk=on_chunk, **p)
        if result.error:
            requests.append({"error": result.error})


def sample_hub(deadline: float, samples: list) -> None:
    """(time, pool threads, pool maxsize, greenlets waiting for a pool thread, hub lag).
    ThreadPool.spawn waits on a semaphore of maxsize before it queues a task: the greenlets
    waiting there are the polls (and name lookups) that have no thread."""
    pool = gevent.get_hub().threadpool
    while time.time() < deadline:
        before = time.perf_counter()
        gevent.sleep(0.1)
        lag = time.perf_counter() - before - 0.1
        waiting = pool._available_worker_threads_greenlet_sem.linkcount()
        samples.append((time.time(), pool.size, pool.maxsize, waiting, lag))
        gevent.sleep(0.4)


def summary(args, rows, requests, samples, window, counted) -> dict:
    server_to_callback = [(c - s) / 1e6 for _, s, c, _, _ in rows if s]
    callback_to_user = [(u - c) / 1e6 for _, _, c, u, _ in rows]
    start, end = window
    ok = [r for r in requests if "error" not in r]
    # Tokens the users had in the window: per request, the growth of its count at each
    # response the user read inside the window.
    client_tokens, seen = 0, {}
    for key, _, _, user_ns, tokens in sorted(rows, key=lambda r: r[3]):
        if start * 1e9 <= user_ns < end * 1e9:
            client_tokens += tokens - seen.get(key, 0)
        seen[key] = tokens
    ttft = [(r["first"] - r["sent"]) / 1e9 for r in ok if r["first"] and r["sent"] > start * 1e9]
    server_ttft = [r["server_ttft_ns"] / 1e9 for r in ok if r["sent"] > start * 1e9]
    return {
        "path": args.path,
        "users": args.users,
        "requests": len(requests),
        "errors": sum("error" in r for r in requests),
        "server_to_callback_ms": [percentile(server_to_callback, q) for q in (50, 90, 99)],
        "callback_to_user_ms": [percentile(callback_to_user, q) for q in (50, 90, 99)],
        "pool_threads_max": max(s[1] for s in samples),
        "pool_maxsize": samples[0][2],
        "pool_greenlets_waiting": [percentile([s[3] for s in samples], q) for q in (50, 90, 99)],
        "hub_lag_ms": [percentile([1000 * s[4] for s in samples], q) for q in (50, 90, 99)],
        "window_s": end - start,
        "server_tokens": counted,
        "client_tokens": client_tokens,
        "client_over_server": client_tokens / counted if counted else None,
        "client_ttft_p50_s": percentile(ttft, 50),
        "server_ttft_p50_s": percentile(server_ttft, 50),
        "num_ttft": len(ttft),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--metrics-url", default=None)
    parser.add_argument("--path", choices=("per-user", "shared"), default="per-user")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=0)
    args = parser.parse_args()
    server = None
    if args.url is None:
        from specdec.harness import ManagedServer

        server = ManagedServer("probe")
        args.url, args.metrics_url = server.url, server.metrics_url
    # A run that cannot end (a hub that never wakes) shows where everything waits.
    faulthandler.dump_traceback_later(args.seconds + 60, exit=True)
    try:
        rows: list = []
        requests: list = []
        samples: list = []
        deadline = time.time() + args.seconds
        pool = StreamPool(args.url) if args.path == "shared" else None
        users = [
            gevent.spawn(per_user, args.url, deadline, args, rows, requests)
            if pool is None
            else gevent.spawn(shared, pool, deadline, args, rows, requests)
            for _ in range(args.users)
        ]
        sampler = gevent.spawn(sample_hub, deadline, samples)
        gevent.sleep(args.warmup)
        start, before = time.time(), scrape_metrics(args.metrics_url)
        gevent.sleep(max(1.0, deadline - time.time() - 5))
        end, after = time.time(), scrape_metrics(args.metrics_url)
        counted = after["specdec_emitted_tokens_total"] - before["specdec_emitted_tokens_total"]
        # Requests still under way are left to the server (it finishes them): the figures
        # are those of the window, not of a drained load.
        gevent.killall([*users, sampler], block=True, timeout=10)
    finally:
        if server is not None:
            server.stop()
    result = summary(args, rows, requests, samples, (start, end), counted)
    print(json.dumps(result, indent=1))
    out = PROJECT_ROOT / "results" / f"probe-{args.path}-{args.users}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"summary": result, "rows": rows, "requests": requests}))


if __name__ == "__main__":
    main()
