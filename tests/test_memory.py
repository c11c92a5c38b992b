"""The memory check (specdec/engines/memory.py, specdec/serving/memory_check.py): its byte
counts against real engines' tensors, the largest NUM_SLOTS it names, and the refusal
before anything starts in the launcher, the gateway and the test harness.

The available bytes are injected (an argument, or the test hook
SPECDEC_MEMORY_AVAILABLE_BYTES), so no test depends on this host's free memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec.engines import memory
from specdec.engines.llama import HEAD_TOKEN_IDS, LlamaConfig, LlamaEngine
from specdec.engines.memory import (
    GIB,
    MIB,
    CheckpointShape,
    EngineSpec,
    MemoryRefused,
    ServerSpec,
    cache_positions,
    check_memory,
    checkpoint_shape,
    kv_cache_bytes,
    largest_num_slots,
    plan_memory,
    weight_bytes,
)
from specdec.engines.onnx_engine import GraphEngine
from specdec.gateway.config import haproxy_binary
from specdec.gateway.serve import serve
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.processes import free_port
from specdec.serving.memory_check import check_environment

TINY = {  # untied head, grouped queries (4 heads over 2 KV heads)
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}
VARIANTS = {
    "untied": (TINY, {}),
    "tied": ({**TINY, "tie_word_embeddings": True}, {}),
    "qkv-bias": ({**TINY, "model_type": "qwen2"}, {"bias": True}),
    "reduced-head": (TINY, {"head": 40}),
}
# A line of refusal_line: the settings, needed, available, the largest NUM_SLOTS that fits.
REFUSAL = re.compile(
    r"NUM_SLOTS=(\d+) MAX_CONTEXT=(\d+): needs ([\d.]+ [GM]iB) on (\S+) .*\), "
    r"([\d.]+ [GM]iB) available; the largest NUM_SLOTS that fits at MAX_CONTEXT=\2 is (\d+)$"
)


def write_checkpoint(folder: Path, hf: dict, bias: bool = False, head: int | None = None) -> Path:
    """A random Hugging Face folder of `hf`'s shape; `head`: a draft's reduced head."""
    c = LlamaConfig.from_hf(hf)
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size)}
    state["model.norm.weight"] = torch.ones(c.hidden_size)
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = rand(head or c.vocab_size, c.hidden_size)
    if head:
        state[HEAD_TOKEN_IDS] = torch.arange(head, dtype=torch.int64)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            state[p + f"self_attn.{name}_proj.weight"] = rand(rows, c.hidden_size)
            if bias:
                state[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        state[p + "self_attn.o_proj.weight"] = rand(c.hidden_size, q)
        state[p + "mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        state[p + "mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        state[p + "mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
        state[p + "input_layernorm.weight"] = torch.ones(c.hidden_size)
        state[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def held_tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in an attribute's value (tensors, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in held_tensors(item)]
    return []


def engine_weight_bytes(engine: LlamaEngine) -> int:
    """The bytes of every tensor the engine holds but its cache, each storage once (a tied
    head is the embedding)."""
    tensors = {
        t.untyped_storage().data_ptr(): t
        for name, value in vars(engine).items()
        if name not in ("k_cache", "v_cache")
        for t in held_tensors(value)
    }
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_counts_equal_a_real_engines_tensors(tmp_path, variant, dtype):
    hf, options = VARIANTS[variant]
    folder = write_checkpoint(tmp_path / variant, hf, **options)
    num_slots, max_length = 3, 17
    engine = LlamaEngine.from_checkpoint(
        folder, num_slots, max_length, "cpu", getattr(torch, dtype)
    )
    shape = checkpoint_shape(folder)
    assert shape.head_size == options.get("head", hf["vocab_size"])
    assert weight_bytes(shape, dtype) == engine_weight_bytes(engine)
    positions = cache_positions("torch", max_length)
    kv = kv_cache_bytes(shape.config, num_slots, positions, dtype)
    assert kv == engine.k_cache.nbytes + engine.v_cache.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_engines_cache_has_no_spare_position(dtype):
    config = LlamaConfig.from_hf(TINY)
    engine = GraphEngine(config, 3, 17, cache_dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    expected = kv_cache_bytes(config, 3, cache_positions("onnxruntime", 17), name)
    assert expected == engine.k_cache.nbytes + engine.v_cache.nbytes


def test_a_gguf_file_reads_as_its_dequantized_folder(target_dir):
    """The embedded default target ships as a GGUF; models/ holds it dequantized."""
    from build.checkpoint import default_gguf

    gguf, folder = checkpoint_shape(default_gguf()), checkpoint_shape(target_dir)
    for dtype in ("float32", "bfloat16"):
        assert weight_bytes(gguf, dtype) == weight_bytes(folder, dtype)
        assert kv_cache_bytes(gguf.config, 5, 7, dtype) == kv_cache_bytes(
            folder.config, 5, 7, dtype
        )
    dimensions = ("vocab_size", "intermediate_size", "num_heads", "tie_word_embeddings")
    for name in dimensions:
        assert getattr(gguf.config, name) == getattr(folder.config, name)
    assert (gguf.head_size, gguf.qkv_bias) == (folder.head_size, folder.qkv_bias)


def small_spec(replicas: int = 1) -> ServerSpec:
    shape = CheckpointShape(LlamaConfig.from_hf(TINY), TINY["vocab_size"], False)
    engines = (
        EngineSpec("target", "torch", shape, "float32"),
        EngineSpec("draft", "torch", shape, "float32"),
    )
    return ServerSpec(engines, "cpu", max_width=9, replicas=replicas)


@pytest.mark.parametrize("max_context", [2, 100, 4096])
def test_largest_num_slots_is_the_last_that_fits(max_context):
    spec = small_spec()
    for available in (memory.CPU_RUNTIME_BYTES + 64 * MIB, 2 * GIB, 3 * GIB + 12345):
        largest = largest_num_slots(spec, max_context, available)
        assert largest >= 1
        assert plan_memory(spec, largest, max_context).needed <= available
        assert plan_memory(spec, largest + 1, max_context).needed > available


def test_nothing_fits_below_the_runtime():
    spec = small_spec()
    assert largest_num_slots(spec, 100, memory.CPU_RUNTIME_BYTES) == 0
    with pytest.raises(MemoryRefused, match="not even NUM_SLOTS=1 fits at MAX_CONTEXT=100"):
        check_memory(plan_memory(spec, 8, 100), memory.CPU_RUNTIME_BYTES)


def test_the_refusal_names_settings_bytes_and_what_fits():
    spec, available = small_spec(), 2 * GIB
    largest = largest_num_slots(spec, 4096, available)
    check_memory(plan_memory(spec, largest, 4096), available)  # fits: no error
    with pytest.raises(MemoryRefused) as refused:
        check_memory(plan_memory(spec, largest + 1, 4096), available)
    line = str(refused.value)
    assert "\n" not in line
    match = REFUSAL.fullmatch(line)
    assert match, line
    assert match.groups() == (str(largest + 1), "4096", match[3], "cpu", "2.0 GiB", str(largest))
    for part in ("target: weights", "draft: weights", "KV cache", "verify work space", "runtime"):
        assert part in line


def test_the_issue_example_does_not_fit_an_h100():
    """Llama-3.1-8B and 3.2-1B in bfloat16 at 256 x 2,048 with CUDA graphs: 97 GiB of weights
    and caches alone."""
    target = LlamaConfig.from_hf(
        {**TINY, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336}
        | {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
    )
    draft = LlamaConfig.from_hf(
        {**TINY, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192}
        | {"num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8}
        | {"head_dim": 64, "tie_word_embeddings": True}
    )
    engines = tuple(
        EngineSpec(role, "torch", CheckpointShape(c, c.vocab_size, False), "bfloat16", True)
        for role, c in (("target", target), ("draft", draft))
    )
    plan = plan_memory(ServerSpec(engines, "cuda:0", max_width=9), 256, 2048)
    weights_and_caches = sum(e.weights + e.kv_cache for e in plan.engines)
    assert 96 * GIB < weights_and_caches < 98 * GIB
    h100 = 79 * GIB
    with pytest.raises(MemoryRefused, match=r"on cuda:0 .*the largest NUM_SLOTS .* is \d+$"):
        check_memory(plan, h100)


def test_available_memory_reads_meminfo_and_the_hook(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 2048 kB\n")
    assert memory.meminfo_available(meminfo) == 2048 * 1024
    assert memory.available_memory("cuda:3", {memory.AVAILABLE_BYTES_VARIABLE: "123"}) == 123
    assert memory.available_memory("cpu", {}) > 0


def test_cuda_is_asked_in_a_child_process():
    """This process gets no CUDA context from the question."""
    if torch.cuda.is_available():
        assert memory.cuda_free_bytes("cuda") > 0
    else:
        with pytest.raises(RuntimeError, match="cannot read the free memory of cuda"):
            memory.cuda_free_bytes("cuda")
    assert not torch.cuda.is_initialized()


# -- where a server starts -----------------------------------------------------------------

TOO_BIG = {"NUM_SLOTS": "1000000", "MAX_CONTEXT": "8192"}


def processes_with(marker: str) -> list[int]:
    """Processes whose environment holds `marker`."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours
            continue
    return found


def test_launch_refuses_before_anything_starts(tmp_path, target_dir):
    marker = f"SPECDEC_TEST_MARKER={uuid.uuid4().hex}"
    ports = {k: str(free_port()) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT")}
    env = {**os.environ, **TOO_BIG, **ports, "RUN_DIR": str(tmp_path), marker.split("=")[0]: marker}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "specdec.launch", "--openai"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROJECT_ROOT,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSAL.search(lines[0]), done.stderr
    assert "NUM_SLOTS=1000000 MAX_CONTEXT=8192" in lines[0]
    assert done.stdout == ""  # no "tritonserver on ..." line: the server was never started
    assert not (tmp_path / "model_repository").exists()  # nor its repository rendered
    assert elapsed < 20  # a server takes longer than this to load its models
    assert processes_with(marker) == []  # no OpenAI API, no tritonserver, no check left


@pytest.mark.skipif(haproxy_binary() is None, reason="needs HAProxy: apt-get install haproxy")
def test_gateway_counts_every_replica(tmp_path, target_dir, capfd):
    """serve checks the gateway's own settings first, HAProxy among them."""

    settings = {"NUM_SLOTS": "16", "MAX_CONTEXT": "1024", "DTYPE": "float32"}
    one = check_environment(settings, available=10**15)  # fits anywhere: its plan
    available = str(one.per_replica * 3 // 2)  # one replica fits, two do not
    check_environment(settings, replicas=1, available=int(available))
    env = {**os.environ, **settings, "RUN_DIR": str(tmp_path)}
    env[memory.AVAILABLE_BYTES_VARIABLE] = available
    assert serve(2, env) == 2
    line = capfd.readouterr().err.strip()
    assert REFUSAL.search(line) and "for 2 replicas" in line, line
    assert list(tmp_path.iterdir()) == []  # no replica, no gateway started


def test_the_harness_refuses_a_server_that_does_not_fit(target_dir):
    name = f"test-memory-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with pytest.raises(MemoryRefused) as refused:
        ManagedServer(name, {**TOO_BIG, memory.AVAILABLE_BYTES_VARIABLE: str(20 * GIB)})
    assert time.monotonic() - started < 10
    assert REFUSAL.fullmatch(str(refused.value)), refused.value
    assert not (PROJECT_ROOT / ".run" / name).exists()


def test_the_compose_entrypoint_refuses_before_rendering(tmp_path, target_dir):
    """docker/triton_entrypoint.py, the container's command on GPU hosts: without the check,
    compose restarted an out-of-memory server in a loop with no word of NUM_SLOTS."""
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(tmp_path), **TOO_BIG}
    env[memory.AVAILABLE_BYTES_VARIABLE] = str(20 * GIB)
    env["PYTHONPATH"] = str(PROJECT_ROOT)  # this tree's specdec, as the image's /opt/specdec
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "docker" / "triton_entrypoint.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert REFUSAL.search(done.stderr.strip()), done.stderr
    assert not (tmp_path / "model_repository").exists()  # nothing rendered, nothing started
