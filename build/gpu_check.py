"""The GPU path end to end, on a machine with an NVIDIA GPU; writes a JSON report.

    .venv/bin/python -m build.gpu_check                      # results/gpu_check.json
    .venv/bin/python -m build.gpu_check --dry-run            # arguments and report, no server

Each step runs the real Triton server (specdec.launch.ManagedServer) on the default pair and
is recorded with its outcome; a failed step does not stop the next ones:
1. environment: GPU, CUDA, torch and TensorRT versions;
2. cpu: greedy text of the prompts at k = 0 with the torch engine on the CPU (the reference);
3. cuda: the torch engine with DEVICE=cuda: greedy text at k = 0 and k = 4 must equal the
   CPU's; output tokens/s at k = 0, k = 4 and adaptive (one stream, requests in sequence);
4. tensorrt, where `tensorrt` imports: float16 plans of both models (build time), then the
   server with ENGINE=tensorrt: agreement with the CPU text (float16 may drift: reported,
   not required) and tokens/s.
The exit status is 0 when the required checks (2 and 3) passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
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
    from specdec.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(config.target)
    lines = (PROJECT_ROOT / "loadtest" / "prompts.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    step = max(1, len(items) // config.num_prompts)  # spread over the categories
    return [tokenizer.apply_chat_template(i["prompt"]) for i in items[::step]][: config.num_prompts]


def measure(url: str, prompts: list[str], k: int | None, max_tokens: int) -> dict:
    """Greedy texts and output tokens/s of prompts sent one after another on one stream."""
    from specdec.client import StreamingClient

    texts, tokens, seconds, accepted = [], 0, 0.0, []
    with StreamingClient(url) as client:
        for prompt in prompts:
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
            texts.append(result.text)
            tokens += int(result.metrics.get("num_output_tokens", 0))
            seconds += result.elapsed
            accepted.append(result.metrics.get("acceptance_rate", 0.0))
    return {
        "texts": texts,
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "acceptance_rate": round(sum(accepted) / len(accepted), 3) if accepted else None,
    }


def serve(name: str, env: dict[str, str], config: GpuCheckConfig, prompts, modes) -> dict:
    """One server of its own: {mode: measure(...)} for the given modes."""
    from specdec.launch import ManagedServer

    base = {
        "TARGET_CHECKPOINT": str(config.target),
        "DRAFT_CHECKPOINT": str(config.draft),
        "NUM_SLOTS": str(config.num_slots),
        "MAX_CONTEXT": str(config.max_context),
    }
    started = time.time()
    with ManagedServer(name, {**base, **env}, timeout=1800) as server:
        ready_s = round(time.time() - started, 1)
        results = {
            mode: measure(server.url, prompts, MODES[mode], config.max_tokens) for mode in modes
        }
    return {"ready_s": ready_s, **results}


def agreement(reference: list[str], texts: list[str]) -> dict:
    equal = [a == b for a, b in zip(reference, texts, strict=True)]
    return {
        "equal": sum(equal),
        "total": len(equal),
        "differing_prompts": [i for i, e in enumerate(equal) if not e],
    }


def step(report: dict, name: str, action) -> dict | None:
    """Runs one step, recording its result or its error."""
    started = time.time()
    try:
        result = action()
        report["steps"][name] = {"ok": True, "seconds": round(time.time() - started, 1), **result}
        return result
    except Exception as error:  # recorded; the next steps still run
        report["steps"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        return None


def cuda_step(config: GpuCheckConfig, prompts, reference) -> dict:
    result = serve("gpu-check-cuda", {"ENGINE": "torch", "DEVICE": "cuda"}, config, prompts, MODES)
    for mode in ("k0", "k4"):
        result[f"{mode}_vs_cpu"] = agreement(reference, result[mode]["texts"])
    speedup = result["k4"]["tokens_per_s"] / result["k0"]["tokens_per_s"]
    result["k4_over_k0"] = round(speedup, 3)
    result["adaptive_over_k0"] = round(
        result["adaptive"]["tokens_per_s"] / result["k0"]["tokens_per_s"], 3
    )
    if any(result[f"{m}_vs_cpu"]["equal"] != len(prompts) for m in ("k0", "k4")):
        raise AssertionError(f"greedy text on CUDA differs from the CPU's: {result}")
    return result


def tensorrt_step(config: GpuCheckConfig, prompts, reference) -> dict:
    from specdec.onnx_engine import default_engines_root
    from specdec.trt_engine import default_plan_dir, ensure_plan

    builds = {}
    for checkpoint in (config.target, config.draft):
        started = time.time()
        plan = default_plan_dir(checkpoint, default_engines_root())
        ensure_plan(checkpoint, plan, config.num_slots, config.max_context)
        builds[checkpoint.name] = {"plan": str(plan), "seconds": round(time.time() - started, 1)}
    # DTYPE: the plans just built (the committed configs say float32, which tensorrt refuses)
    env = {"ENGINE": "tensorrt", "DTYPE": "float16"}
    result = serve("gpu-check-tensorrt", env, config, prompts, ("k0", "k4"))
    result["k0_vs_cpu"] = agreement(reference, result["k0"]["texts"])
    result["k4_vs_k0"] = agreement(result["k0"]["texts"], result["k4"]["texts"])
    return {"builds": builds, **result}


def run(config: GpuCheckConfig) -> dict:
    report = {"config": {k: str(v) for k, v in asdict(config).items()}, "steps": {}}
    report["environment"] = environment()
    if config.dry_run:
        report["steps"] = {
            s: {"ok": None, "skipped": "dry run"} for s in ("cpu", "cuda", "tensorrt")
        }
    else:
        prompts = load_prompts(config)
        env = {"ENGINE": "torch", "DEVICE": "cpu"}
        cpu = step(report, "cpu", lambda: serve("gpu-check-cpu", env, config, prompts, ["k0"]))
        reference = cpu["k0"]["texts"] if cpu else None
        if reference is not None:
            step(report, "cuda", lambda: cuda_step(config, prompts, reference))
        if reference is not None and report["environment"]["tensorrt"] and not config.skip_tensorrt:
            step(report, "tensorrt", lambda: tensorrt_step(config, prompts, reference))
    required = [report["steps"].get(s, {}).get("ok") for s in ("cpu", "cuda")]
    report["passed"] = None if config.dry_run else all(required)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse_args(argv: list[str] | None = None) -> GpuCheckConfig:
    models = PROJECT_ROOT / "models"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "gpu_check.json")
    parser.add_argument("--target", type=Path, default=models / "smollm2-135m-instruct")
    parser.add_argument("--draft", type=Path, default=models / "smollm2-135m-draft")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-slots", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--skip-tensorrt", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="write the report, start nothing")
    return GpuCheckConfig(**vars(parser.parse_args(argv)))


def main() -> None:
    report = run(parse_args())
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=2))
    for name, outcome in report["steps"].items():
        print(name, "ok" if outcome.get("ok") else outcome.get("error") or outcome.get("skipped"))
    raise SystemExit(0 if report["passed"] in (True, None) else 1)


if __name__ == "__main__":
    main()
