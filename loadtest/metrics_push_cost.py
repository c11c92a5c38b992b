"""What the loop's metrics cost per iteration on the real Triton server, at 1 and 64 rows.

The cost that matters is the Python backend's: every counter update is a round trip from the
stub to the server. This runs the BLS's own LoopMetrics inside a Python model of a throwaway
repository on a real tritonserver (the wheel's, as the project serves), feeds it iterations
of 1 or 64 running rows whose tokens arrive 1 to 4 per commit a few tens of ms apart and
whose sequences end and start again (about one in 64 per row-iteration), and times, per
iteration, the observations (per row), their staging (stage_histograms) and the flush (the
pb_utils calls), beside the flush of the counters that record_iteration() gathers. Median
and p90 per part, in microseconds, and the pb_utils calls per flush, written as JSON:

    .venv/bin/python loadtest/metrics_push_cost.py --out results/metrics-push-cost.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

MODEL = "push_cost"
CONFIG = """name: "push_cost"
backend: "python"
max_batch_size: 0
input [ { name: "rows" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "report" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


@dataclass
class Config:
    rows: tuple[int, ...] = (1, 64)
    iterations: int = 400
    out: Path = Path("results/metrics-push-cost.json")


def percentiles_us(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": p90 * 1e6}


def fake_row(rng: random.Random, now_ns: int):
    """What the histograms read of a sequence: its times, output tokens and prompt."""
    from specdec.loop.sequence import SequenceTimes

    arrival = now_ns - rng.randint(10, 2000) * 1_000_000
    times = SequenceTimes(arrival_ns=arrival, first_scheduled_ns=arrival + 2_000_000)
    request = SimpleNamespace(prompt_ids=[0] * rng.randint(8, 1500))
    return SimpleNamespace(times=times, num_output_tokens=0, request=request, finish_reason=None)


def measure(rows: int, iterations: int) -> dict:
    """In the stub: LoopMetrics fed `rows` rows for `iterations` iterations."""
    from specdec.loop.scheduler import IterationStats
    from specdec.serving.metrics import LoopMetrics

    metrics = LoopMetrics(f"{MODEL}_{rows}", max_k=8, num_slots=64)
    rng = random.Random(rows)
    now = time.time_ns()
    batch = [fake_row(rng, now) for _ in range(rows)]
    parts: dict[str, list[float]] = {"observe": [], "stage": [], "flush": [], "counters": []}
    calls = []
    clock = time.perf_counter
    for _ in range(iterations):
        now += rng.randint(15, 60) * 1_000_000  # one iteration of the engines
        started = clock()
        emitted = []
        for i, row in enumerate(batch):
            n = rng.randint(1, 4)
            row.num_output_tokens += n
            times = row.times
            times.first_token_ns = times.first_token_ns or now
            times.previous_token_ns, times.last_token_ns = times.last_token_ns, now
            metrics.tokens_committed(row, n)
            emitted.append(n)
            if rng.random() < 1 / 64:  # it ends; a new sequence takes its slot
                row.finish_reason = "length"
                metrics.sequence_finished(row, now)
                batch[i] = fake_row(rng, now)
        observed = clock()
        metrics.stage_histograms()
        staged = clock()
        calls.append(metrics.pending.num_pending)
        metrics.flush()
        flushed = clock()
        metrics.record_iteration(IterationStats(batch_size=rows, emitted_per_row=emitted))
        counted = clock()
        metrics.flush()
        parts["observe"].append(observed - started)
        parts["stage"].append(staged - observed)
        parts["flush"].append(flushed - staged)
        parts["counters"].append(clock() - counted)
    return {
        "rows": rows,
        "iterations": iterations,
        "histogram_calls_per_flush": statistics.median(calls),
        **{part: percentiles_us(values) for part, values in parts.items()},
    }


class PushCostModel:
    """The Python model: answers `rows` with the measurement of each row count, as JSON."""

    def execute(self, requests):
        import numpy as np
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "rows").as_numpy().tolist()
            iterations = rows.pop()  # the last element: iterations
            report = json.dumps([measure(int(n), int(iterations)) for n in rows])
            tensor = pb_utils.Tensor("report", np.array([report], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([tensor]))
        return responses


def write_repository(repository: Path) -> None:
    folder = repository / MODEL / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (repository / MODEL / "config.pbtxt").write_text(CONFIG)
    (folder / "model.py").write_text(
        textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from metrics_push_cost import PushCostModel as TritonPythonModel
        """)
    )


def run(config: Config) -> list[dict]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    from specdec.paths import PROJECT_ROOT
    from specdec.processes import free_port, is_ready, terminate
    from specdec.server_config import ServerConfig, start

    run_dir = PROJECT_ROOT / ".run" / "metrics-push-cost"
    source = run_dir / "source_repository"
    write_repository(source)
    ports = [free_port() for _ in range(3)]
    http, grpc, metrics = ports
    server = ServerConfig(http, grpc, metrics, run_dir=run_dir, source_repository=source)
    with open(run_dir / "server.log", "wb") as log:
        process = start(server, log)
    try:
        deadline = time.monotonic() + 300
        while not is_ready(server.http_port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tritonserver did not start; see {run_dir / 'server.log'}")
            time.sleep(0.5)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        values = np.array([*config.rows, config.iterations], dtype=np.int32)
        rows = grpcclient.InferInput("rows", list(values.shape), "INT32")
        rows.set_data_from_numpy(values)
        result = client.infer(MODEL, [rows], client_timeout=600)
        report = json.loads(result.as_numpy("report")[0])
    finally:
        terminate(process, timeout=60)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64", help="row counts, comma-separated")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Config.out)
    args = parser.parse_args(argv)
    rows = tuple(int(n) for n in args.rows.split(","))
    for report in run(Config(rows, args.iterations, args.out)):
        print(json.dumps(report), file=sys.stdout)


if __name__ == "__main__":
    main()
