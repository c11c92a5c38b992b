"""One GPU run, ready and one command long (issue 48, item 5): the measurements a lent GPU
host is for, in order, with the JSON report rewritten after every step (and every engine
configuration), so that a run cut short still leaves what it measured.

    python3 -m build.gpu_run                 # on the GPU host, through build/gpu_run.sh
    .venv/bin/python -m build.gpu_run --dry-run     # the same steps at toy sizes, on the CPU

Steps, each with its time budget (6 minutes on the host in all: gpu_run.sh's setup, about
10 s in each of its two calls, then these 330 s; a failed step does not stop the next):
1. engines (100 s; the rest of its configurations are skipped, with a note, once it is spent):
   in this process, no server, no checkpoint: Llama-3.1-8B and Llama-3.2-1B shapes with
   random bfloat16 weights made on the GPU, every row at CACHE_LENGTH cached positions:
   the target's decode (one token per row), its verify of 5 tokens per row (run_target), the
   draft's call at k = 4 (run_draft: 2 tokens fed, 4 proposed) on the 1B, at 1, 16, 64 and
   128 rows (128 only where free memory allows), eager and with cuda_graphs=True; median ms
   of REPEATS calls after WARMUP (a graph's capture among them), peak memory. Derived: the
   iteration at k = 4 (draft call + verify) over the k = 0 step (decode) at each row count.
   Issue 48's targets (graphed): at most 1.9x at 1 row, 2.5x at 64 rows.
2. served (150 s: 85 s for the 135M pair, 65 s for the tiny pair): loadtest/bench.py on the
   real Triton server with CUDA graphs, 64 streams, stream interval 16, chat workload,
   8 s per mode: the 135M-shaped random target with the tiny draft at k = 0 and k = 4 (and
   k0-again, the noise floor), then the tiny pair at k = 0. Recorded: tokens/s, iterations/s,
   ms per iteration by loop part, and host work = the iteration's time minus the engine
   calls'. Targets: host work at most 2 ms (k = 0) and 4 ms (k = 4) per iteration with the
   135M target; the tiny pair at k = 0 at least 8,000 tokens/s.
3. gpu_check (80 s): build.gpu_check with reduced arguments (4 prompts, 64 tokens, 16
   slots, 1 and 16 streams, no TensorRT): CUDA graphs against eager steps, the bfloat16 tie
   margin on the GPU, the real server on CUDA held to the CPU reference.

--dry-run runs the same code on the CPU: toy configurations instead of 8B / 1B, rows 1 and 2,
few repeats, eager only (CUDA graphs need CUDA: recorded as skipped); the served step on the
tiny pair alone at 4 streams for 2 s per mode (a server start and two short windows, about
30 s on 2 cores); gpu_check's own --dry-run.

The device calls (docs/gpu.md, "The GPU run (issue 48)"): `python -m build.gpu_pack` in the
session's checkout first; then, back to back on the same warm machine, `bash
build/gpu_run.sh engines` with carry [".gpu/server"] and timeout_s 200, and `bash
build/gpu_run.sh served` with carry [".gpu/site"] and timeout_s 330 (what the served steps
need does not fit one call's 64 MiB beside the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from specdec.engines.llama import LlamaConfig
from specdec.engines.wire import EngineBatch
from specdec.paths import PROJECT_ROOT

CACHE_LENGTH = 1024  # cached positions of every row
VERIFY_TOKENS = 5  # k + 1 at k = 4
DRAFT_FED, DRAFT_STEPS = 2, 4  # a drafting row after its proposals all won: 2 tokens fed
WEIGHT_STD = 0.02  # random weights' scale (HF's initializer_range)
BUDGETS_S = {"engines": 100, "served": 150, "gpu_check": 80}
SERVED_SPLIT_S = {"135m": 85, "tiny": 65}  # the served step's budget by pair
RATIO_TARGETS = {1: 1.9, 64: 2.5}  # rows: the most k = 4's iteration may cost over k = 0's
HOST_WORK_TARGETS_MS = {"k0-si16": 2.0, "k4-si16": 4.0}  # 135M pair, 64 streams
TINY_K0_TARGET_TOKENS_S = 8000.0


def llama_3_1_8b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_positions=8192,
    )


def llama_3_2_1b() -> LlamaConfig:
    return replace(
        llama_3_1_8b(),
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
    )


def toy(config: LlamaConfig, num_layers: int) -> LlamaConfig:
    """The dry run's stand-in: the same kind of model (RoPE, heads ratio, head tying) at
    toy sizes."""
    return replace(
        config,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )


def weight_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight LlamaEngine reads, by its Hugging Face name."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, m = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (m, h),
            p + "mlp.up_proj.weight": (m, h),
            p + "mlp.down_proj.weight": (h, m),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def parameter_count(c: LlamaConfig) -> int:
    return sum(int(np.prod(shape)) for shape in weight_shapes(c).values())


def random_weights(
    c: LlamaConfig, device: str, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights made where the engine runs (never on the host for CUDA): matrices
    normal * WEIGHT_STD, norms 1."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(c).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            tensor = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            weights[name] = tensor.mul_(WEIGHT_STD)
    return weights


def engine_batch(rows: int, fed: int, num_steps: int, vocab_size: int) -> EngineBatch:
    """Greedy rows in slots 0..rows-1, each at CACHE_LENGTH cached positions, feeding `fed`
    tokens and asking for `num_steps` (target: positions; draft: proposals)."""
    generator = np.random.default_rng(rows)
    return EngineBatch(
        input_ids=generator.integers(0, vocab_size, rows * fed).astype(np.int64),
        input_lengths=np.full(rows, fed, dtype=np.int32),
        slot_ids=np.arange(rows, dtype=np.int32),
        cache_lengths=np.full(rows, CACHE_LENGTH, dtype=np.int32),
        num_steps=np.full(rows, num_steps, dtype=np.int32),
        temperature=np.zeros(rows, dtype=np.float32),
        top_k=np.zeros(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        end_ids=np.full(rows, -1, dtype=np.int32),
        min_tokens_left=np.zeros(rows, dtype=np.int32),
        seeds=np.zeros(rows, dtype=np.int64),
    )


def max_length() -> int:
    """Positions per slot: the cache, then the longest call's new tokens (and spare)."""
    return CACHE_LENGTH + max(VERIFY_TOKENS, DRAFT_FED + DRAFT_STEPS) + 2


def memory_needed(c: LlamaConfig, rows: int, dtype_bytes: int = 2) -> int:
    """Bytes an engine of `rows` slots may need at its peak: the weights, with the joined
    q/k/v and gate/up copies made while the random dict is alive, its KV cache, and a
    verify's logits (float32, a few copies) with a margin for the rest."""
    shapes = weight_shapes(c)
    weights = sum(int(np.prod(s)) for s in shapes.values()) * dtype_bytes
    copied = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    joined = sum(int(np.prod(s)) for n, s in shapes.items() if n.split(".")[-2] in copied)
    cache = 2 * c.num_layers * rows * c.num_kv_heads * (max_length() + 1) * c.head_dim
    logits = rows * VERIFY_TOKENS * c.vocab_size * 4 * 4
    return weights + joined * dtype_bytes + cache * dtype_bytes + logits + 2**30


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(call: Callable[[], object], device: str, warmup: int, repeats: int) -> float:
    """Median wall ms of `call`, the device synchronized around each, after `warmup` calls
    (the first of them captures a CUDA graph where one is used)."""
    for _ in range(warmup):
        call()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return round(1000 * statistics.median(seconds), 3)


@dataclass
class RunConfig:
    out: Path = PROJECT_ROOT / "results" / "gpu_run.json"
    work_dir: Path = PROJECT_ROOT / ".run" / "gpu-run"
    tokenizer: Path = PROJECT_ROOT / ".gpu" / "tok"
    dry_run: bool = False
    rows: list[int] = field(default_factory=lambda: [1, 16, 64, 128])
    warmup: int = 3
    repeats: int = 10
    streams: int = 64
    level_seconds: float = 8.0
    max_tokens: int = 64
    budgets_s: dict[str, float] = field(default_factory=lambda: dict(BUDGETS_S))
    steps: list[str] = field(default_factory=lambda: list(BUDGETS_S))  # which, in order

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def dry(self) -> RunConfig:
        """The dry run's sizes."""
        return replace(
            self,
            dry_run=True,
            rows=[1, 2],
            warmup=1,
            repeats=2,
            streams=4,
            level_seconds=2.0,
            max_tokens=16,
        )


# -- step 1: the engines in this process ------------------------------------------------------
Progress = Callable[[dict], None]  # called with the step's figures so far
ENGINE_MODES = (("graphed", True), ("eager", False))  # the targets are graphed


def engine_calls(role: str, rows: int, vocab_size: int) -> dict[str, Callable]:
    """The calls timed on an engine: what the loop makes, as EngineBatch calls."""
    from specdec.engines.calls import run_draft, run_target

    if role == "draft":
        draft = engine_batch(rows, DRAFT_FED, DRAFT_STEPS, vocab_size)
        return {"draft_ms": lambda engine: run_draft(engine, draft)}
    decode = engine_batch(rows, 1, 1, vocab_size)
    verify = engine_batch(rows, VERIFY_TOKENS, VERIFY_TOKENS, vocab_size)
    return {
        "decode_ms": lambda engine: run_target(engine, decode),
        "verify_ms": lambda engine: run_target(engine, verify),
    }


def time_engine(config: RunConfig, c: LlamaConfig, role: str, rows: int, graphs: bool) -> dict:
    """One engine of `rows` slots with fresh random weights: its calls' median ms and the
    memory it held; freed before returning."""
    from specdec.engines.llama import LlamaEngine

    cuda = config.device == "cuda"
    if cuda:
        free = torch.cuda.mem_get_info()[0]
        if memory_needed(c, rows) > free:
            needed = memory_needed(c, rows) / 2**30
            return {"skipped": f"needs about {needed:.1f} GiB, {free / 2**30:.1f} GiB free"}
    weights = random_weights(c, config.device, torch.bfloat16)
    engine = LlamaEngine(
        c, weights, rows, max_length(), config.device, torch.bfloat16, cuda_graphs=graphs
    )
    del weights  # the engine keeps what it uses; joined copies replaced the rest
    result: dict = {}
    if cuda:
        torch.cuda.empty_cache()
        result["engine_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    for name, call in engine_calls(role, rows, c.vocab_size).items():
        timed = partial(call, engine)
        result[name] = median_ms(timed, config.device, config.warmup, config.repeats)
    if cuda:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return result


def iteration_ratios(timings: dict) -> dict:
    """timings[mode][role][rows] -> per mode and rows: the iteration at k = 4 (the draft's
    call, then the target's verify of 5) and the k = 0 step (the target's decode), ms, and
    their ratio (None where a figure is missing)."""
    ratios: dict = {}
    for mode, roles in timings.items():
        target, draft = roles.get("target", {}), roles.get("draft", {})
        for rows in sorted(set(target) | set(draft), key=int):
            decode = target.get(rows, {}).get("decode_ms")
            verify = target.get(rows, {}).get("verify_ms")
            proposal = draft.get(rows, {}).get("draft_ms")
            k4 = proposal + verify if proposal is not None and verify is not None else None
            ratio = round(k4 / decode, 3) if k4 is not None and decode else None
            ratios.setdefault(mode, {})[rows] = {"k4_ms": k4, "k0_ms": decode, "ratio": ratio}
    return ratios


def ratio_targets(ratios: dict) -> dict:
    """Issue 48's targets for the graphed ratios: met (True/False), or None if not measured."""
    graphed = ratios.get("graphed", {})
    met = {}
    for rows, most in RATIO_TARGETS.items():
        ratio = graphed.get(str(rows), {}).get("ratio")
        met[f"graphed {rows} rows <= {most}x"] = None if ratio is None else ratio <= most
    return met


def engines_step(config: RunConfig, progress: Progress) -> dict:
    """Every (rows, mode, role) in order of rows, graphed before eager, target before draft,
    until the step's budget is spent."""
    models = {"target": llama_3_1_8b(), "draft": llama_3_2_1b()}
    if config.dry_run:
        models = {"target": toy(models["target"], 2), "draft": toy(models["draft"], 1)}
    deadline = time.time() + config.budgets_s["engines"]
    result: dict = {
        "models": {r: {**asdict(c), "parameters": parameter_count(c)} for r, c in models.items()},
        "cache_length": CACHE_LENGTH,
        "repeats": config.repeats,
        "timings": {},
    }
    for rows in config.rows:
        for mode, graphs in ENGINE_MODES:
            for role, c in models.items():
                where = result["timings"].setdefault(mode, {}).setdefault(role, {})
                where[str(rows)] = engine_figures(config, c, role, rows, graphs, deadline)
                result["ratios"] = iteration_ratios(result["timings"])
                result["targets"] = ratio_targets(result["ratios"])
                progress(result)
    return result


def engine_figures(
    config: RunConfig, c: LlamaConfig, role: str, rows: int, graphs: bool, deadline: float
) -> dict:
    """One configuration's figures, or why it was skipped, or its error."""
    if graphs and config.device != "cuda":
        return {"skipped": "cuda_graphs runs on CUDA only"}
    if time.time() > deadline:
        return {"skipped": "the step's time budget is spent"}
    try:
        return time_engine(config, c, role, rows, graphs)
    except Exception as error:  # recorded; the next configuration still runs
        if config.device == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(error).__name__}: {error}"}


# -- step 2: served, through loadtest/bench.py --------------------------------------------------
BENCH_PARTS = ("cancel_check", "draft", "target", "schedule", "respond", "outbox")


def make_checkpoints(config: RunConfig) -> dict[str, Path]:
    """Random checkpoints with the target's tokenizer (build/tiny_checkpoint.py): the tiny
    one (1 layer, width 64) and, on the GPU, one in SmolLM2-135M's shape."""
    from build.tiny_checkpoint import TinyConfig
    from build.tiny_checkpoint import run as write_checkpoint

    def made(checkpoint: TinyConfig) -> Path:  # once per work folder
        done = (checkpoint.out / "model.safetensors").exists()
        return checkpoint.out if done else write_checkpoint(checkpoint)

    tiny = TinyConfig(out=config.work_dir / "tiny", tokenizer_from=config.tokenizer)
    paths = {"tiny": made(tiny)}
    if not config.dry_run:
        shaped = replace(  # SmolLM2-135M's shape
            tiny,
            out=config.work_dir / "shaped-135m",
            hidden_size=576,
            intermediate_size=1536,
            num_heads=9,
            num_kv_heads=3,
            num_layers=30,
        )
        paths["135m"] = made(shaped)
    return paths


def bench_tokenizer(config: RunConfig) -> None:
    """The bench renders its prompts with models/smollm2-135m-instruct's chat template: give
    it the carried tokenizer where that folder is missing (a bare GPU host)."""
    from build.checkpoint import TOKENIZER_FILES

    folder = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    if (folder / "tokenizer.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (config.tokenizer / name).exists():
            (folder / name).write_bytes((config.tokenizer / name).read_bytes())


def server_env(config: RunConfig, target: Path, draft: Path, dtype: str) -> str:
    env = {
        "TARGET_CHECKPOINT": str(target),
        "DRAFT_CHECKPOINT": str(draft),
        "NUM_SLOTS": str(config.streams),
        "MAX_CONTEXT": "512",
        "DTYPE": "float32" if config.dry_run else dtype,
        "DEVICE": config.device,
    }
    if not config.dry_run:
        env["CUDA_GRAPHS"] = "true"
    return ",".join(f"{k}={v}" for k, v in env.items())


def run_logged(command: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs a step's command from the checkout, its output into `log`."""
    with log.open("w") as handle:
        return subprocess.run(
            command,
            cwd=PROJECT_ROOT,
            env=subprocess_env(),
            stdout=handle,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )


def subprocess_env() -> dict[str, str]:
    """This checkout first on PYTHONPATH: loadtest/bench.py's folder comes first on its
    path, and an installed `specdec` (an editable install of another checkout) must not
    answer its imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    return env


def bench(config: RunConfig, name: str, modes: list[str], env: str, timeout: float) -> dict:
    """loadtest/bench.py at config.streams streams; its JSON report."""
    command = [
        sys.executable,
        str(PROJECT_ROOT / "loadtest" / "bench.py"),
        *("--name", f"gpu-run-{name}", "--out-dir", str(config.work_dir)),
        *("--workloads", "chat", "--modes", ",".join(modes)),
        *("--concurrency", str(config.streams), "--level-seconds", str(config.level_seconds)),
        *("--max-tokens", str(config.max_tokens), "--server-env", env),
    ]
    log = config.work_dir / f"bench-{name}.log"
    done = run_logged(command, log, timeout)
    if done.returncode:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"bench exited with {done.returncode}: {tail}")
    return json.loads((config.work_dir / f"gpu-run-{name}.json").read_text())


def level_figures(level: dict) -> dict:
    """One mode of a bench level: tokens/s, iterations/s, ms per iteration by part, and the
    host work: the iteration's time less the engine calls' (None without iterations)."""
    per_s = level.get("iterations_per_s") or 0.0
    parts = {part: round(level.get(f"{part}_ms_per_iteration", 0.0), 3) for part in BENCH_PARTS}
    iteration = 1000 / per_s if per_s else None
    host = iteration - parts["draft"] - parts["target"] if iteration is not None else None
    return {
        "tokens_per_s": round(level["tokens_per_s"], 1),
        "iterations_per_s": round(per_s, 2),
        "tokens_per_iteration": round(level.get("tokens_per_iteration", 0.0), 2),
        "ms_per_iteration": parts,
        "iteration_ms": None if iteration is None else round(iteration, 3),
        "host_work_ms": None if host is None else round(host, 3),
        "errors": level.get("num_errors", 0),
    }


def served_targets(pairs: dict) -> dict:
    """Issue 48's targets for the served figures: met, or None where not measured."""
    shaped = pairs.get("135m", {}).get("modes", {})
    met: dict[str, bool | None] = {}
    for mode, most in HOST_WORK_TARGETS_MS.items():
        host = shaped.get(mode, {}).get("host_work_ms")
        met[f"135m {mode} host work <= {most} ms"] = None if host is None else host <= most
    tiny = pairs.get("tiny", {}).get("modes", {}).get("k0-si16", {}).get("tokens_per_s")
    key = f"tiny k0-si16 >= {TINY_K0_TARGET_TOKENS_S:.0f} tok/s"
    met[key] = None if tiny is None else tiny >= TINY_K0_TARGET_TOKENS_S
    return met


def served_pairs(config: RunConfig, checkpoints: dict[str, Path]) -> list[tuple]:
    """(name, target, draft, DTYPE, modes) of each served pair, in order."""
    pairs = []
    if "135m" in checkpoints:
        modes = ["k0-si16", "k4-si16", "k0-again-si16"]
        pairs.append(("135m", checkpoints["135m"], checkpoints["tiny"], "bfloat16", modes))
    tiny = checkpoints["tiny"]
    pairs.append(("tiny", tiny, tiny, "float32", ["k0-si16", "k0-again-si16"]))
    return pairs


def served_step(config: RunConfig, progress: Progress) -> dict:
    config.work_dir.mkdir(parents=True, exist_ok=True)
    bench_tokenizer(config)
    checkpoints = make_checkpoints(config)
    result: dict = {"streams": config.streams, "stream_interval": 16, "pairs": {}}
    if config.dry_run:
        result["pairs"]["135m"] = {"skipped": "dry run: the 135M shape on 2 CPU cores is slow"}
    for name, target, draft, dtype, modes in served_pairs(config, checkpoints):
        env = server_env(config, target, draft, dtype)
        pair: dict = {"server_env": env}
        try:
            report = bench(config, name, modes, env, SERVED_SPLIT_S[name])
            pair["modes"] = {lv["mode"]: level_figures(lv) for lv in report["levels"]}
            pair["noise_floor"] = report["meta"].get("noise_floor")
        except Exception as error:  # recorded; the next pair still runs
            pair["error"] = f"{type(error).__name__}: {error}"
        result["pairs"][name] = pair
        result["targets"] = served_targets(result["pairs"])
        progress(result)
    errors = [p["error"] for p in result["pairs"].values() if "error" in p]
    if errors:
        raise StepFailed(result, "; ".join(errors))
    return result


# -- step 3: build.gpu_check with reduced arguments -------------------------------------------
GPU_CHECK_ARGS = (
    *("--num-prompts", "4", "--max-tokens", "64", "--num-slots", "16"),
    *("--max-context", "512", "--streams", "1,16", "--skip-tensorrt"),
)
BULKY_KEYS = ("paths", "top2s", "texts")  # the reference's token ids: in gpu_check's own file


def without_bulk(value):
    if isinstance(value, dict):
        return {k: without_bulk(v) for k, v in value.items() if k not in BULKY_KEYS}
    return value


def gpu_check_step(config: RunConfig, progress: Progress) -> dict:
    """build.gpu_check on the served step's checkpoints (made again where that step did not
    get so far); its report without the reference's token ids."""
    checkpoints = make_checkpoints(config)
    target = checkpoints.get("135m", checkpoints["tiny"])
    out = config.work_dir / "gpu_check.json"
    command = [sys.executable, "-m", "build.gpu_check", "--out", str(out), *GPU_CHECK_ARGS]
    command += ["--target", str(target), "--draft", str(checkpoints["tiny"])]
    if config.dry_run:
        command.append("--dry-run")
    log = config.work_dir / "gpu_check.log"
    done = run_logged(command, log, config.budgets_s["gpu_check"])
    if not out.exists():
        raise RuntimeError(
            f"gpu_check wrote no report (exit {done.returncode}): {log.read_text()[-1500:]}"
        )
    result = {"exit_status": done.returncode, "report": without_bulk(json.loads(out.read_text()))}
    if done.returncode:
        raise StepFailed(result, f"gpu_check exited with {done.returncode}")
    return result


# -- the run ---------------------------------------------------------------------------------
class StepFailed(RuntimeError):
    """A step that measured something and still failed: its figures go in the report."""

    def __init__(self, result: dict, message: str) -> None:
        super().__init__(message)
        self.result = result


Step = Callable[[RunConfig, Progress], dict]
STEPS: dict[str, Step] = {
    "engines": engines_step,
    "served": served_step,
    "gpu_check": gpu_check_step,
}


def environment() -> dict:
    info: dict[str, object] = {
        "host": platform.node(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def write(config: RunConfig, report: dict) -> None:
    config.out.parent.mkdir(parents=True, exist_ok=True)
    partial = config.out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(config.out)  # a reader never sees half a report


def run_step(config: RunConfig, report: dict, name: str, step: Step) -> None:
    """Runs one step; its outcome, duration and figures (or error) go in the report, which
    is written while it runs (progress) and after it."""
    started = time.time()
    budget = config.budgets_s[name]
    outcome: dict[str, object] = {"ok": None, "budget_s": budget, "running": True}
    report["steps"][name] = outcome

    def progress(figures: dict) -> None:
        outcome.update(figures, seconds=round(time.time() - started, 1))
        write(config, report)

    try:
        outcome.update(step(config, progress), ok=True)
    except Exception as error:  # recorded; the next step still runs
        figures = error.result if isinstance(error, StepFailed) else {}
        outcome.update(figures, ok=False, error=f"{type(error).__name__}: {error}")
    outcome.pop("running")
    outcome["seconds"] = round(time.time() - started, 1)
    write(config, report)


def run(config: RunConfig) -> dict:
    report: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "environment": environment(),
        "steps": {},
    }
    write(config, report)
    for name, step in STEPS.items():
        if name in config.steps:
            run_step(config, report, name, step)
    return report


def parse_args(argv: list[str] | None = None) -> RunConfig:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=defaults.out)
    parser.add_argument("--work-dir", type=Path, default=defaults.work_dir)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=defaults.tokenizer,
        help="the target's tokenizer files and config.json (build/gpu_pack.py: .gpu/tok)",
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help="which steps, e.g. engines (build/gpu_run.sh runs them in two device calls)",
    )
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    args = parser.parse_args(argv)
    steps = args.steps.split(",")
    if set(steps) - set(STEPS):
        parser.error(f"--steps: of {', '.join(STEPS)}")
    config = RunConfig(args.out, args.work_dir, args.tokenizer, steps=steps)
    return config.dry() if args.dry_run else config


def main() -> None:
    report = run(parse_args())
    for name, outcome in report["steps"].items():
        status = {True: "ok", False: outcome.get("error"), None: "not run"}[outcome["ok"]]
        print(f"{name}: {status} ({outcome.get('seconds')} s)")
    print(f"wrote {report['config']['out']}")


if __name__ == "__main__":
    main()
