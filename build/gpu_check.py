"""The GPU path end to end, on a machine with an NVIDIA GPU; writes a JSON report.

    .venv/bin/python -m build.gpu_check                      # results/gpu_check.json
    .venv/bin/python -m build.gpu_check --dry-run            # arguments and report, no server

Each step is recorded with its outcome; a failed step does not stop the next ones:
1. environment: GPU, CUDA, torch and TensorRT versions;
2. cpu: the reference, in this process: the torch engine on the CPU in float32 decodes each
   prompt greedily, one token at a time, and keeps each token's top-2 logit gap;
3. engines, in this process, no server: the torch engine's calls replayed from CUDA graphs
   (cuda_graphs=True) against eager ones on the same inputs, float32 and bfloat16: a verify
   of 5 tokens per row and a draft call at k = 4, at 1, half and all --num-slots rows
   (tokens that agree, equal in float32; ms per call; the graphs' pool bytes beside its
   estimate); where `tensorrt` imports, the target's plan in --dtype: its logits must stay
   on the GPU and follow the torch engine's (ms per step beside torch's);
4. tie_margin, in this process: the target in bfloat16 on the GPU against the CPU reference:
   where its plain greedy path departs from the reference and the largest reference top-2
   gap at such a departure; how far its one-token steps move float32's top-2 gaps and how
   far its verifies of 5 tokens move its own steps' (build/tie_margin.py's measures, here on
   the GPU's kernels), against --tie-margin and PRECISION_MARGIN;
5. cuda: the real Triton server (specdec.harness.ManagedServer) with the torch engine on CUDA;
6. tensorrt, where `tensorrt` imports: plans of both models in --dtype (build time), then
   the server with ENGINE=tensorrt.
Steps 5 and 6 serve k = 0, k = 4 and adaptive to one stream, and k = 0 and adaptive to each
level of --streams (output tokens/s of each), and hold every greedy text to the reference by
the tie-aware rule (build/greedy_parity.py): a text may leave the reference only where the
reference's top-2 logits lie within --tie-margin; a divergence anywhere else fails the step.
The exit status is 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from build.greedy_parity import TIE_MARGIN
from specdec.paths import PROJECT_ROOT

MODES = {"k0": 0, "k4": 4, "adaptive": None}  # num_draft_tokens; None = the server's choice


@dataclass
class GpuCheckConfig:
    out: Path
    target: Path
    draft: Path
    num_prompts: int
    max_tokens: int
    num_slots: int
    max_context: int
    skip_tensorrt: bool
    dry_run: bool
    dtype: str = "auto"  # the TensorRT plans' DTYPE: auto, bfloat16 or float16
    tie_margin: float = TIE_MARGIN
    streams: list[int] = field(default_factory=lambda: [1, 16])

    def runs(self) -> list[tuple[str, int]]:
        """(mode, streams): every mode at one stream, k = 0 and adaptive at the others."""
        more = [(m, n) for n in self.streams if n != 1 for m in ("k0", "adaptive")]
        return [(mode, 1) for mode in MODES] + more


def environment() -> dict:
    import importlib.util

    import torch

    info = {
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "tensorrt": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    if importlib.util.find_spec("tensorrt") is not None:
        import tensorrt

        info["tensorrt"] = tensorrt.__version__
    return info


def load_prompts(config: GpuCheckConfig) -> list[str]:
    from specdec.text.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(config.target)
    lines = (PROJECT_ROOT / "loadtest" / "prompts.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    step = max(1, len(items) // config.num_prompts)  # spread over the categories
    return [tokenizer.apply_chat_template(i["prompt"]) for i in items[::step]][: config.num_prompts]


def reference_top2s(config: GpuCheckConfig, tokenizer, prompts: list[str]) -> list:
    """The CPU float32 reference: per prompt, greedy token ids, their runners-up and their
    top-2 logit gaps (greedy_parity.greedy_top2)."""
    from build.greedy_parity import greedy_top2
    from specdec.engines.llama import LlamaEngine

    engine = LlamaEngine.from_checkpoint(config.target, 1, config.max_context)
    eos = tokenizer.eos_token_id
    return [greedy_top2(engine, tokenizer.encode(p), config.max_tokens, eos) for p in prompts]


def measure(url: str, prompts: list[str], k: int | None, max_tokens: int, streams: int) -> dict:
    """Greedy texts of the prompts and output tokens/s of `streams` concurrent streams (each
    prompt at least once, at least two requests per stream)."""
    from specdec.client import StreamingClient

    def one(prompt: str):
        with StreamingClient(url) as client:
            result = client.generate(
                prompt,
                max_tokens=max_tokens,
                num_draft_tokens=k,
                exclude_input_in_output=True,
                return_num_output_tokens=True,
                return_perf_metrics=True,
            )
        if result.error is not None:
            raise RuntimeError(str(result.error))
        return result

    jobs = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * streams))]
    started = time.time()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, jobs))
    seconds = time.time() - started
    tokens = sum(int(r.metrics.get("num_output_tokens", 0)) for r in results)
    accepted = [r.metrics.get("acceptance_rate", 0.0) for r in results]
    return {
        "texts": [r.text for r in results[: len(prompts)]],
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "acceptance_rate": round(sum(accepted) / len(accepted), 3),
    }


def parity(reference, texts: list[str], margin: float) -> dict:
    """Texts against the reference by the tie-aware rule: the near ties they part at, and
    the divergences outside the margin (bugs)."""
    from build.greedy_parity import find_divergences

    tokenizer, paths = reference
    found = find_divergences(tokenizer.decode, paths, texts, tokenizer.eos_token_id)
    return {
        "equal": len(texts) - len(found),
        "total": len(texts),
        "near_ties": [asdict(d) for d in found if d.near_tie(margin)],
        "divergences": [asdict(d) for d in found if not d.near_tie(margin)],
    }


def serve(name: str, env: dict[str, str], config: GpuCheckConfig, prompts, reference) -> dict:
    """One server of its own: each run's tokens/s and parity; raises on a divergence
    outside the margin (after the runs, so the report has them all)."""
    from specdec.harness import ManagedServer

    base = {
        "TARGET_CHECKPOINT": str(config.target),
        "DRAFT_CHECKPOINT": str(config.draft),
        "NUM_SLOTS": str(config.num_slots),
        "MAX_CONTEXT": str(config.max_context),
    }
    started = time.time()
    result: dict = {"runs": {}}
    with ManagedServer(name, {**base, **env}, timeout=1800) as server:
        result["ready_s"] = round(time.time() - started, 1)
        for mode, streams in config.runs():
            run = measure(server.url, prompts, MODES[mode], config.max_tokens, streams)
            run["parity"] = parity(reference, run.pop("texts"), config.tie_margin)
            result["runs"][f"{mode}@{streams}"] = run
    runs = result["runs"]
    result["adaptive_over_k0"] = {
        n: ratio(runs.get(f"adaptive@{n}"), runs.get(f"k0@{n}")) for n in config.streams
    }
    bad = {run: r["parity"]["divergences"] for run, r in result["runs"].items()}
    if any(bad.values()):
        raise GreedyDivergence(result, {run: d for run, d in bad.items() if d})
    return result


class GreedyDivergence(AssertionError):
    """Greedy text left the reference where its top two were not near a tie."""

    def __init__(self, result: dict, divergences: dict) -> None:
        super().__init__(f"greedy text left the CPU reference away from a near tie: {divergences}")
        self.result = result


def ratio(run: dict | None, baseline: dict | None) -> float | None:
    """tokens/s of one run over another's (None where either is missing)."""
    a, b = ((r or {}).get("tokens_per_s") for r in (run, baseline))
    return round(a / b, 3) if a and b else None


def step(report: dict, name: str, action) -> dict | None:
    """Runs one step, recording its result or its error (with what it measured)."""
    started = time.time()
    try:
        result = action()
        report["steps"][name] = {"ok": True, "seconds": round(time.time() - started, 1), **result}
        return result
    except Exception as error:  # recorded; the next steps still run
        measured = error.result if isinstance(error, GreedyDivergence) else {}
        report["steps"][name] = {
            "ok": False,
            "error": f"{type(error).__name__}: {error}",
            **measured,
        }
        return None


def tensorrt_step(config: GpuCheckConfig, prompts, reference) -> dict:
    from specdec.engines.onnx_engine import default_engines_root
    from specdec.engines.select import engine_dtype
    from specdec.engines.trt_plan import default_plan_dir, ensure_plan

    dtype = engine_dtype("tensorrt", config.dtype, "cuda")  # auto: bfloat16 if the GPU has it
    builds = {}
    for checkpoint in (config.target, config.draft):
        started = time.time()
        plan = default_plan_dir(checkpoint, default_engines_root(), dtype)
        ensure_plan(checkpoint, plan, config.num_slots, config.max_context, dtype)
        builds[checkpoint.name] = {"plan": str(plan), "seconds": round(time.time() - started, 1)}
    env = {"ENGINE": "tensorrt", "DTYPE": dtype}  # the plans just built
    result = serve("gpu-check-tensorrt", env, config, prompts, reference)
    return {"dtype": dtype, "builds": builds, **result}


# -- step 3: the engines in this process ------------------------------------------------------
PLAN_TOLERANCE = 1.0  # |plan (float16 / bfloat16) - torch float32| logits of the target


def engines_step(config: GpuCheckConfig, has_tensorrt: bool) -> dict:
    """CUDA graphs against eager calls; a TensorRT plan's logits on the GPU."""
    import torch

    from specdec.engines.llama import LlamaEngine

    result: dict = {"cuda_graphs": {}}
    for dtype in ("float32", "bfloat16"):
        engines = [
            LlamaEngine.from_checkpoint(
                config.target,
                config.num_slots,
                config.max_context,
                "cuda",
                getattr(torch, dtype),
                cuda_graphs=graphs,
            )
            for graphs in (False, True)
        ]
        result["cuda_graphs"][dtype] = compare_call_graphs(*engines, exact=dtype == "float32")
        del engines
    if has_tensorrt and not config.skip_tensorrt:
        result["tensorrt"] = tensorrt_logits(config)
    return result


def prefill_all(engines, num_slots: int, length: int = 100) -> list[int]:
    """The same random prompt of `length` tokens in every slot of every engine."""
    import torch

    prompt = torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(5))
    for engine in engines:
        for slot in range(num_slots):
            engine.forward(prompt, [length], [slot], [0], [1])
    return [length] * num_slots


def decode_rows(num_slots: int) -> list[int]:
    return sorted({1, max(1, num_slots // 2), num_slots})


def compare_call_graphs(reference, candidate, exact: bool) -> dict:
    """Verify (5 tokens per row) and draft (k = 4) calls of greedy rows on both engines from
    the same cache: the share of tokens that agree (exact: all of them; bfloat16 may part at
    near ties, padded shapes picking other kernels), ms per call of each, and the graphs'
    pool bytes beside graph_pool_bytes_estimate."""
    import numpy as np

    from specdec.engines.calls import run_draft, run_target
    from specdec.engines.graphs import SPARE_POSITIONS, graph_pool_bytes_estimate

    cache_lengths = prefill_all([reference, candidate], reference.num_slots)
    report: dict = {}
    for rows in decode_rows(reference.num_slots):
        for name, run, width, steps in (("verify", run_target, 5, 5), ("draft", run_draft, 1, 4)):
            batch = greedy_batch(rows, width, steps, cache_lengths[0])
            expected, got = run(reference, batch), run(candidate, batch)
            agree = float(np.mean(expected.token_ids == got.token_ids))
            report[f"{name}, {rows} rows"] = {
                "tokens_equal": round(agree, 4),
                "reference_ms": call_ms(reference, run, batch),
                "candidate_ms": call_ms(candidate, run, batch),
            }
            if exact and agree < 1:
                raise AssertionError(f"tokens differ at {name}, {rows} rows: {report}")
    estimate = graph_pool_bytes_estimate(
        candidate.config,
        candidate.num_slots,
        SPARE_POSITIONS,
        candidate.dtype,
        candidate.max_length,
    )
    report["pool_bytes"] = candidate.call_graphs.pool_bytes()
    report["pool_bytes_estimate"] = estimate
    return report


def greedy_batch(rows: int, width: int, steps: int, cached: int):
    """An engine call of `rows` greedy rows in slots 0.., `width` new tokens each after
    `cached` positions, `steps` tokens asked of each."""
    import numpy as np

    from specdec.engines.wire import EngineBatch

    def column(value, dtype) -> np.ndarray:
        return np.full(rows, value, dtype=dtype)

    return EngineBatch(
        input_ids=(np.arange(rows * width) + 7).astype(np.int64),
        input_lengths=column(width, np.int32),
        slot_ids=np.arange(rows, dtype=np.int32),
        cache_lengths=column(cached, np.int32),
        num_steps=column(steps, np.int32),
        temperature=column(0.0, np.float32),
        top_k=column(0, np.int32),
        top_p=column(1.0, np.float32),
        end_ids=column(-1, np.int32),
        min_tokens_left=column(0, np.int32),
        seeds=column(0, np.int64),
    )


def call_ms(engine, run, batch, repeats: int = 20) -> float:
    """Median ms of an engine call (the same positions rewritten each time); the first call
    is a warm-up (a CUDA graph's capture). Each call waits for its tokens."""
    import statistics

    run(engine, batch)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(engine, batch)
        seconds.append(time.perf_counter() - started)
    return round(1000 * statistics.median(seconds), 3)


def compare_decode_steps(reference, candidate, tolerance: float, num_steps: int = 8) -> dict:
    """Both engines decode the same rows from the same cache; each step's logits must
    agree within `tolerance`. Then ms per step of each (median of 20, after a warm-up)."""
    import torch

    cache_lengths = prefill_all([reference, candidate], reference.num_slots)
    report: dict = {}
    for rows in decode_rows(reference.num_slots):
        worst, agree, slots = 0.0, 0, list(range(rows))
        tokens = torch.arange(rows) + 7
        for _ in range(num_steps):
            args = (tokens, [1] * rows, slots, cache_lengths[:rows], [1] * rows)
            expected, got = reference.forward(*args), candidate.forward(*args)
            if not got.is_cuda:
                raise AssertionError(f"logits on {got.device}, not on the GPU")
            worst = max(worst, (expected - got).abs().max().item())
            agree += int(torch.equal(expected.argmax(-1), got.argmax(-1)))
            tokens = expected.argmax(-1).cpu()
            cache_lengths[:rows] = [n + 1 for n in cache_lengths[:rows]]
        report[f"{rows} rows"] = {
            "max_abs_diff": round(worst, 5),
            "steps_with_equal_argmax": f"{agree}/{num_steps}",
            "reference_ms": step_ms(reference, rows, cache_lengths),
            "candidate_ms": step_ms(candidate, rows, cache_lengths),
        }
        if worst > tolerance:
            raise AssertionError(f"logits differ by {worst} at {rows} rows: {report}")
    return report


def step_ms(engine, rows: int, cache_lengths: list[int], repeats: int = 20) -> float:
    """Median ms of a decode step of `rows` rows (the same positions rewritten each time)."""
    import statistics

    import torch

    args = (torch.arange(rows), [1] * rows, list(range(rows)), cache_lengths[:rows], [1] * rows)
    engine.forward(*args)  # warm-up (a CUDA graph's capture)
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.forward(*args)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return round(1000 * statistics.median(seconds), 3)


def tensorrt_logits(config: GpuCheckConfig) -> dict:
    """The target's plan (built as the tensorrt step builds it) against the torch engine in
    float32 on CUDA: logits on the GPU, within PLAN_TOLERANCE, and ms per step of each."""
    from specdec.engines.llama import LlamaEngine
    from specdec.engines.onnx_engine import default_engines_root
    from specdec.engines.select import engine_dtype
    from specdec.engines.trt_engine import TrtEngine
    from specdec.engines.trt_plan import default_plan_dir, ensure_plan

    dtype = engine_dtype("tensorrt", config.dtype, "cuda")
    plan = default_plan_dir(config.target, default_engines_root(), dtype)
    ensure_plan(config.target, plan, config.num_slots, config.max_context, dtype)
    engine = TrtEngine(plan, config.num_slots, config.max_context)
    reference = LlamaEngine.from_checkpoint(
        config.target, config.num_slots, config.max_context, "cuda"
    )
    return {"dtype": dtype, **compare_decode_steps(reference, engine, PLAN_TOLERANCE)}


# -- step 4: the bfloat16 tie margin on the GPU -----------------------------------------------
VERIFY_WIDTH = 5  # k + 1 at the draft's k = 4


def first_departures(reference: list, outputs: list[list[int]]) -> list[dict]:
    """Where each output's tokens first leave its reference path (greedy_top2's ids, runners-up
    and gaps): the position and the reference's top-2 logit gap there."""
    found = []
    for prompt, ((ids, _, gaps), output) in enumerate(zip(reference, outputs, strict=True)):
        pairs = zip(ids, output, strict=False)  # a path that ended early differs at its end
        position = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if position is not None:
            found.append({"prompt": prompt, "position": position, "gap": round(gaps[position], 6)})
    return found


def tie_margin_step(
    config: GpuCheckConfig, prompt_ids: list[list[int]], reference: list, eos, device="cuda"
) -> dict:
    """The target in bfloat16 on `device` against the CPU's float32 reference (`reference`:
    greedy_top2 per prompt): where its plain greedy path departs, and the largest reference
    gap at such a departure; how far its one-token steps move float32's top-2 gaps
    (precision) and how far its verifies of VERIFY_WIDTH tokens move its own one-token
    steps' (verify); the committed margins against both (build/tie_margin.py's figures)."""
    import torch

    from build.greedy_parity import PRECISION_MARGIN, greedy_top2, precision_moves
    from build.tie_margin import TieMarginConfig, bounds, summary, verify_figures
    from specdec.engines.llama import LlamaEngine

    length = max(len(ids) for ids in prompt_ids) + config.max_tokens + 1
    engine = LlamaEngine.from_checkpoint(
        config.target, len(prompt_ids), length, device, torch.bfloat16
    )
    greedy = [greedy_top2(engine, ids, config.max_tokens, eos)[0] for ids in prompt_ids]
    departures = first_departures(reference, greedy)
    moves = [
        (r, move)
        for r, ids in enumerate(prompt_ids)
        for move in precision_moves(engine, ids, reference[r])
    ]
    own = TieMarginConfig(config.target, len(prompt_ids), config.max_tokens, [VERIFY_WIDTH], 1)
    verify, precision = verify_figures(own, engine, prompt_ids)["all"], summary(moves)
    for figures in (verify, precision):
        figures["flips"] = len(figures["flips"])
    return {
        "dtype": "bfloat16",
        "device": device,
        "greedy": {
            "equal": len(prompt_ids) - len(departures),
            "departures": departures,
            "max_gap_at_departure": max((d["gap"] for d in departures), default=None),
        },
        "verify": verify,
        "precision": precision,
        "tie_margin": bounds(verify["max_move"], config.tie_margin),
        "precision_margin": bounds(precision["max_move"], PRECISION_MARGIN),
    }


def run(config: GpuCheckConfig) -> dict:
    report = {"config": {k: str(v) for k, v in asdict(config).items()}, "steps": {}}
    report["environment"] = environment()
    if config.dry_run:
        report["steps"] = {
            s: {"ok": None, "skipped": "dry run"}
            for s in ("cpu", "engines", "tie_margin", "cuda", "tensorrt")
        }
    else:
        run_steps(config, report)
    ran = [outcome.get("ok") for outcome in report["steps"].values()]
    report["passed"] = None if config.dry_run else bool(ran) and all(ran)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_steps(config: GpuCheckConfig, report: dict) -> None:
    from specdec.text.tokenizer import TextTokenizer

    prompts, tokenizer = load_prompts(config), TextTokenizer(config.target)

    def cpu_step() -> dict:
        top2s = reference_top2s(config, tokenizer, prompts)
        paths = [(ids, gaps) for ids, _, gaps in top2s]
        return {
            "texts": [tokenizer.decode(ids) for ids, _ in paths],
            "paths": paths,
            "top2s": top2s,
        }

    cpu = step(report, "cpu", cpu_step)
    if cpu is None:
        return
    reference = (tokenizer, cpu["paths"])
    step(report, "engines", lambda: engines_step(config, bool(report["environment"]["tensorrt"])))
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    eos = tokenizer.eos_token_id
    step(report, "tie_margin", lambda: tie_margin_step(config, prompt_ids, cpu["top2s"], eos))
    env = {"ENGINE": "torch", "DEVICE": "cuda"}
    step(report, "cuda", lambda: serve("gpu-check-cuda", env, config, prompts, reference))
    if report["environment"]["tensorrt"] and not config.skip_tensorrt:
        step(report, "tensorrt", lambda: tensorrt_step(config, prompts, reference))
        cuda, trt = (report["steps"][s].get("runs", {}) for s in ("cuda", "tensorrt"))
        report["tensorrt_over_cuda"] = {run: ratio(trt[run], cuda.get(run)) for run in trt}


def parse_args(argv: list[str] | None = None) -> GpuCheckConfig:
    models = PROJECT_ROOT / "models"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "gpu_check.json")
    parser.add_argument("--target", type=Path, default=models / "smollm2-135m-instruct")
    parser.add_argument("--draft", type=Path, default=models / "smollm2-135m-draft")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-slots", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--dtype", default="auto", help="TensorRT plans: auto, bfloat16, float16")
    parser.add_argument("--tie-margin", type=float, default=TIE_MARGIN, help="top-2 logit gap")
    parser.add_argument("--streams", type=streams_list, default=[1, 16], help="e.g. 1,16")
    parser.add_argument("--skip-tensorrt", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="write the report, start nothing")
    return GpuCheckConfig(**vars(parser.parse_args(argv)))


def streams_list(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main() -> None:
    report = run(parse_args())
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=2))
    for name, outcome in report["steps"].items():
        print(name, "ok" if outcome.get("ok") else outcome.get("error") or outcome.get("skipped"))
    raise SystemExit(0 if report["passed"] in (True, None) else 1)


if __name__ == "__main__":
    main()
