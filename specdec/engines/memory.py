"""Memory the engines will take, counted before they allocate it, and the check against what
the device has free: a server too big for its host is refused with one line that names
NUM_SLOTS and MAX_CONTEXT, instead of dying in whichever engine loads second.

Per engine (draft and target), from its checkpoint's dimensions, its compute dtype, the
slots and the positions per slot:
- weights: exactly what LlamaEngine keeps (matrices in the compute dtype, norms and RoPE
  frequencies float32, a draft's reduced head and its token ids);
- KV cache: exactly SlotCache's keys and values (engine.py), the spare positions included;
- CUDA graph pool (torch engine on CUDA with graphs on): graph_pool_bytes, an estimate;
- work space: the activations of the largest call the loop makes (work_bytes), an estimate.
Per server: a runtime margin (a CUDA context per engine process; on the CPU, the Python,
torch and Triton processes around the weights). N replicas on one host need N times it.
Not counted: the float32 copy of a checkpoint an engine holds while it loads (host memory,
transient) and allocator fragmentation; the margins are there for them.

Pure: no Triton; torch only to ask CUDA for its free memory (available_memory).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.engines.engine import MAX_BATCHED_QUERY
from specdec.engines.graphs import SPARE_POSITIONS, graph_pool_bytes_estimate
from specdec.engines.llama import HEAD_TOKEN_IDS, LlamaConfig

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Positions past max_length each slot of the torch engine keeps (LlamaEngine's `max_length +
# 1`: a CUDA graph's padding rows write there). The one place to change when that grows;
# tests/test_memory.py compares the count with a real engine's cache.
TORCH_SPARE_POSITIONS = SPARE_POSITIONS  # the padded calls' spares (graphs.py)
CUDA_CONTEXT_BYTES = GIB // 2  # per process that holds one (the engines' stubs)
# An idle CPU server beyond its weights and caches: tritonserver and its Python stubs
# (preprocessing, BLS, the two engines) took about 1.1 GiB resident here (2026-12-07,
# SmolLM2 pair, NUM_SLOTS=1: 1,783 MiB in all, 684 MiB of it weights).
CPU_RUNTIME_BYTES = 5 * GIB // 4
ENGINE_PROCESSES = 1  # both engines live in the BLS's stub process
# Test hook: the bytes available_memory reports, whatever the host has (tests only).
AVAILABLE_BYTES_VARIABLE = "SPECDEC_MEMORY_AVAILABLE_BYTES"


class MemoryRefused(RuntimeError):
    """The settings need more memory than the device has; str() is the one line to show."""


@dataclass(frozen=True)
class CheckpointShape:
    """What the byte counts need of a checkpoint beyond its LlamaConfig."""

    config: LlamaConfig
    head_size: int  # rows of the head: the vocabulary, or a draft's reduced head
    qkv_bias: bool  # q, k, v projections with biases (Qwen2)
    head_token_ids: bool = False  # the checkpoint carries draft.head_token_ids


@dataclass(frozen=True)
class EngineSpec:
    """One engine as the server will build it."""

    role: str  # "target" or "draft"
    kind: str  # ENGINES: torch, onnxruntime, tensorrt
    shape: CheckpointShape
    dtype: str  # the compute dtype's name (select.engine_dtype)
    cuda_graphs: bool = False


@dataclass(frozen=True)
class ServerSpec:
    """The engines of one server, where they live, and its largest call's width."""

    engines: tuple[EngineSpec, ...]
    device: str  # where the engines' memory is: "cpu", "cuda" or "cuda:N"
    max_width: int  # 1 + the most draft tokens a verify checks (max_num_draft_tokens)
    replicas: int = 1  # servers on this device
    engine_processes: int = ENGINE_PROCESSES


@dataclass(frozen=True)
class EngineMemory:
    role: str
    weights: int
    kv_cache: int
    graphs: int
    work: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.graphs + self.work


@dataclass(frozen=True)
class MemoryPlan:
    """What one server takes at num_slots x max_context, and what its replicas need."""

    spec: ServerSpec
    num_slots: int
    max_context: int
    engines: tuple[EngineMemory, ...]
    runtime: int

    @property
    def per_replica(self) -> int:
        return self.runtime + sum(e.total for e in self.engines)

    @property
    def needed(self) -> int:
        return self.spec.replicas * self.per_replica


# -- checkpoints: dimensions without reading a weight ---------------------------------------


def safetensors_shapes(directory: Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in a folder's *.safetensors files, from their headers
    alone (8 bytes of header length, then JSON): no weight is read."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def hf_shape(directory: Path) -> CheckpointShape:
    """A Hugging Face folder's shape: config.json and its safetensors headers."""
    config = LlamaConfig.from_hf(json.loads((directory / "config.json").read_text()))
    shapes = safetensors_shapes(directory)
    head = shapes.get("lm_head.weight")
    head_size = config.vocab_size if config.tie_word_embeddings or head is None else head[0]
    bias = "model.layers.0.self_attn.q_proj.bias" in shapes
    return CheckpointShape(config, head_size, bias, HEAD_TOKEN_IDS in shapes)


def gguf_shape(path: Path) -> CheckpointShape:
    """A .gguf file's shape from its metadata (the gguf package reads the header and the
    tensor table, no tensor data). Engines serve its dequantized Hugging Face folder, whose
    dimensions these are."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    tensors = {t.name for t in reader.tensors}
    heads = value(f"{arch}.attention.head_count")
    hidden = value(f"{arch}.embedding_length")
    hf = {
        "vocab_size": value(f"{arch}.vocab_size") or len(value("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
        "head_dim": value(f"{arch}.attention.key_length", hidden // heads),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    config = LlamaConfig.from_hf(hf)
    return CheckpointShape(config, config.vocab_size, "blk.0.attn_q.bias" in tensors)


def checkpoint_shape(path: str | Path) -> CheckpointShape:
    """The shape of a checkpoint: a Hugging Face folder or a .gguf file."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_shape(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face folder or .gguf)")
    return hf_shape(path)


# -- bytes ------------------------------------------------------------------------------------


def weight_bytes(shape: CheckpointShape, dtype: str) -> int:
    """What LlamaEngine keeps: the matrices (q, k, v, o, gate, up, down, the embedding, the
    head unless tied) and q, k, v biases in `dtype`; the norms and RoPE's inverse
    frequencies in float32; a reduced head's token ids as int64."""
    c, size = shape.config, DTYPE_BYTES[dtype]
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    matrices = (qkv_rows + c.num_heads * c.head_dim + 3 * c.intermediate_size) * c.hidden_size
    layer = (matrices + (qkv_rows if shape.qkv_bias else 0)) * size + 2 * c.hidden_size * 4
    embed = c.vocab_size * c.hidden_size * size
    head = 0 if c.tie_word_embeddings else shape.head_size * c.hidden_size * size
    extras = c.hidden_size * 4 + c.head_dim // 2 * 4  # final norm, RoPE frequencies
    extras += shape.head_size * 8 if shape.head_token_ids else 0
    return c.num_layers * layer + embed + head + extras


def cache_positions(kind: str, max_length: int) -> int:
    """Positions per slot an engine's SlotCache holds: the torch engine keeps spares."""
    return max_length + (TORCH_SPARE_POSITIONS if kind == "torch" else 0)


def kv_cache_bytes(config: LlamaConfig, num_slots: int, num_positions: int, dtype: str) -> int:
    """SlotCache's keys and values: 2 x (layers, slots, kv heads, positions, head dim)."""
    c = config
    elements = c.num_layers * num_slots * c.num_kv_heads * num_positions * c.head_dim
    return 2 * elements * DTYPE_BYTES[dtype]


def call_bytes(shape: CheckpointShape, rows: int, width: int, keys: int, dtype: str) -> int:
    """An estimate of the activations one forward call holds at its peak: `rows` rows of
    `width` new tokens attending over `keys` positions. Per token: the float32 residual
    stream and its norm, q/k/v and their rotated copy, the attention output, gate, up and
    their product (compute dtype). Attention: a float32 score per query, head and key (a
    math kernel's worst case) and the additive mask. Logits: the head's output in the
    compute dtype and in float32, and one more float32 row of the whole vocabulary (a
    reduced head spread out, or the caller's probabilities)."""
    c, size = shape.config, DTYPE_BYTES[dtype]
    tokens = rows * width
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_token = 2 * 4 * c.hidden_size + size * (2 * qkv + c.num_heads * c.head_dim)
    per_token += size * 3 * c.intermediate_size
    group = c.num_heads // c.num_kv_heads
    attention = tokens * keys * (4 * c.num_heads + size * group)
    logits = tokens * (shape.head_size * (size + 4) + 4 * c.vocab_size)
    return tokens * per_token + attention + logits


def work_bytes(engine: EngineSpec, num_slots: int, max_length: int, width: int) -> int:
    """A verify's work space: every slot's row checking width - 1 draft tokens over the
    whole context (call_bytes). The graph engines (onnxruntime, tensorrt) also gather
    every layer's past keys and values for the call: one more cache's worth at worst."""
    work = call_bytes(engine.shape, num_slots, width, max_length, engine.dtype)
    if engine.kind != "torch":
        work += kv_cache_bytes(engine.shape.config, num_slots, max_length, engine.dtype)
    return work


def graph_pool_bytes(
    shape: CheckpointShape, num_slots: int, max_length: int, max_width: int, dtype: str
) -> int:
    """An estimate of the CUDA graphs' memory pool (graph_pool_bytes_estimate in
    specdec/engines/graphs.py: the largest padded call's activations; graphs keep only
    tokens as outputs)."""
    torch_dtype = getattr(torch, dtype)
    return graph_pool_bytes_estimate(shape.config, num_slots, max_width, torch_dtype, max_length)


# -- the plan and the check ---------------------------------------------------------------------


def on_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def engine_memory(
    engine: EngineSpec, spec: ServerSpec, num_slots: int, max_context: int
) -> EngineMemory:
    positions = cache_positions(engine.kind, max_context)
    shape, dtype = engine.shape, engine.dtype
    graphs = 0
    if engine.cuda_graphs and engine.kind == "torch" and on_cuda(spec.device):
        # a padded call is as wide as its widest row: a draft row catching up takes up to
        # MAX_BATCHED_QUERY tokens
        graphs = graph_pool_bytes(shape, num_slots, max_context, MAX_BATCHED_QUERY, dtype)
    return EngineMemory(
        role=engine.role,
        weights=weight_bytes(shape, dtype),
        kv_cache=kv_cache_bytes(shape.config, num_slots, positions, dtype),
        graphs=graphs,
        work=work_bytes(engine, num_slots, max_context, spec.max_width),
    )


def plan_memory(spec: ServerSpec, num_slots: int, max_context: int) -> MemoryPlan:
    """What `spec`'s engines take at num_slots x max_context positions."""
    engines = tuple(engine_memory(e, spec, num_slots, max_context) for e in spec.engines)
    cuda = on_cuda(spec.device)
    runtime = spec.engine_processes * CUDA_CONTEXT_BYTES if cuda else CPU_RUNTIME_BYTES
    return MemoryPlan(spec, num_slots, max_context, engines, runtime)


def largest_num_slots(spec: ServerSpec, max_context: int, available: int) -> int:
    """The most slots whose plan fits `available` bytes at max_context; 0 if not even one.
    (A plan grows with the slots, so doubling, then halving the gap, finds it.)"""

    def fits(num_slots: int) -> bool:
        return plan_memory(spec, num_slots, max_context).needed <= available

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def format_bytes(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.0f} MiB"


def breakdown(plan: MemoryPlan) -> str:
    """'target: weights 15.0 GiB + KV cache 64.0 GiB + ...; draft: ...; runtime 1.0 GiB'"""
    parts = []
    for e in plan.engines:
        terms = [("weights", e.weights), ("KV cache", e.kv_cache)]
        terms += [("CUDA graphs", e.graphs)] if e.graphs else []
        terms += [("verify work space", e.work)]
        parts.append(f"{e.role}: " + " + ".join(f"{n} {format_bytes(b)}" for n, b in terms))
    return "; ".join([*parts, f"runtime {format_bytes(plan.runtime)}"])


def refusal_line(plan: MemoryPlan, available: int) -> str:
    """The one line that refuses `plan`: the settings, the bytes needed (and for what), the
    bytes available, and the largest NUM_SLOTS that fits at this MAX_CONTEXT."""
    spec, slots, context = plan.spec, plan.num_slots, plan.max_context
    needed = f"{format_bytes(plan.needed)} on {spec.device}"
    if spec.replicas > 1:
        needed += f" for {spec.replicas} replicas ({format_bytes(plan.per_replica)} each)"
    largest = largest_num_slots(spec, context, available)
    if largest:
        advice = f"the largest NUM_SLOTS that fits at MAX_CONTEXT={context} is {largest}"
    else:
        fewer = ", fewer REPLICAS" if spec.replicas > 1 else ""
        advice = (
            f"not even NUM_SLOTS=1 fits at MAX_CONTEXT={context}: lower MAX_CONTEXT{fewer}, "
            "or take a smaller DTYPE or model"
        )
    return (
        f"NUM_SLOTS={slots} MAX_CONTEXT={context}: needs {needed} ({breakdown(plan)}), "
        f"{format_bytes(available)} available; {advice}"
    )


def check_memory(plan: MemoryPlan, available: int) -> None:
    """Raises MemoryRefused (its message: refusal_line) when the plan needs more than
    `available` bytes."""
    if plan.needed > available:
        raise MemoryRefused(refusal_line(plan, available))


# -- what the device has ---------------------------------------------------------------------

# Run in a child process: the free memory of a CUDA device (argv[1]: cuda or cuda:N).
CUDA_FREE_CODE = "import sys, torch; print(torch.cuda.mem_get_info(torch.device(sys.argv[1]))[0])"


def meminfo_available(path: str | Path = "/proc/meminfo") -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable), bytes."""
    for line in Path(path).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{path} has no MemAvailable line")


def cuda_free_bytes(device: str) -> int:
    """torch.cuda.mem_get_info(device)[0]. Asked in a short child process unless this one
    already holds a CUDA context: a context costs about CUDA_CONTEXT_BYTES of the GPU for
    the life of its process, and the launcher and the gateway live as long as the server."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    command = [sys.executable, "-c", CUDA_FREE_CODE, device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"cannot read the free memory of {device}: {last}")
    return int(done.stdout)


def available_memory(device: str, env: Mapping[str, str] | None = None) -> int:
    """Bytes free for the engines on `device`: the CPU's MemAvailable, a GPU's free memory.
    AVAILABLE_BYTES_VARIABLE in `env` (default os.environ), when set, is the answer: a
    hook for tests, which must not depend on the host's free memory."""
    env = os.environ if env is None else env
    if env.get(AVAILABLE_BYTES_VARIABLE):
        return int(env[AVAILABLE_BYTES_VARIABLE])
    return cuda_free_bytes(device) if on_cuda(device) else meminfo_available()


# -- from the settings -----------------------------------------------------------------------


def memory_device(engine: str, device: str) -> str:
    """Where an engine kind keeps its memory: onnxruntime on the CPU, tensorrt on the GPU
    (its default device), torch on DEVICE."""
    return {"onnxruntime": "cpu", "tensorrt": "cuda"}.get(engine, device)


def server_spec(
    target_checkpoint: str | Path,
    draft_checkpoint: str | Path | None,
    *,
    engine: str,
    device: str,
    dtype: str,
    cuda_graphs: bool,
    max_draft_tokens: int,
    replicas: int = 1,
    engine_processes: int = ENGINE_PROCESSES,
) -> ServerSpec:
    """The ServerSpec of a server's settings (ENGINE, DEVICE, DTYPE, CUDA_GRAPHS; checkpoint
    paths absolute or relative to the current folder). draft_checkpoint None: no draft
    engine. Raises what select.engine_dtype raises for a DTYPE the engine refuses."""
    from specdec.engines.select import engine_dtype

    where = memory_device(engine, device)
    # auto on CUDA is bfloat16 or float16, two bytes either way: no need to ask the GPU.
    chosen = engine_dtype(engine, dtype, where, cuda_bf16=lambda: True)
    roles = [("target", target_checkpoint), ("draft", draft_checkpoint)]
    engines = tuple(
        EngineSpec(role, engine, checkpoint_shape(path), chosen, cuda_graphs)
        for role, path in roles
        if path is not None
    )
    return ServerSpec(engines, where, 1 + max_draft_tokens, replicas, engine_processes)


def check_engines_fit(
    target_checkpoint: str | Path,
    draft_checkpoint: str | Path | None,
    *,
    engine: str,
    device: str,
    dtype: str,
    cuda_graphs: bool,
    num_slots: int,
    max_context: int,
    max_draft_tokens: int,
    replicas: int = 1,
    engine_processes: int = ENGINE_PROCESSES,
    available: int | None = None,
) -> MemoryPlan:
    """Raises MemoryRefused (one line: refusal_line) when the engines of these settings do
    not fit the free memory of their device (`available` bytes; None: available_memory);
    returns the plan when they do. engine_processes: processes that each hold a CUDA
    context for the engines (ENGINE_PROCESSES: the BLS's stub holds both engines)."""
    spec = server_spec(
        target_checkpoint,
        draft_checkpoint,
        engine=engine,
        device=device,
        dtype=dtype,
        cuda_graphs=cuda_graphs,
        max_draft_tokens=max_draft_tokens,
        replicas=replicas,
        engine_processes=engine_processes,
    )
    plan = plan_memory(spec, num_slots, max_context)
    check_memory(plan, available_memory(spec.device) if available is None else available)
    return plan
