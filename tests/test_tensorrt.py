"""TensorRT on the CPU: optimization profiles, plan folders and their compatibility rules,
and the tensorrt engine driven through scripted fakes of TensorRT's objects (a fake
ICudaEngine / IExecutionContext that checks shapes against its profile and returns False
where TensorRT would); the float16 graph that TensorRT compiles (run by onnxruntime on the
CPU); and, with a GPU, plans and the CUDA torch engine (those skip here)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import random
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import DRAFT, TARGET
from specdec.engines.calls import run_draft, run_target
from specdec.engines.llama import LlamaConfig, LlamaEngine
from specdec.engines.onnx_engine import OnnxEngine, group_rows, manifest_config, pad_rows
from specdec.engines.onnx_export import (
    FORMAT_VERSION,
    MANIFEST,
    checkpoint_fingerprint,
    default_engine_dir,
    ensure_exported,
    input_names,
    output_names,
)
from specdec.engines.trt_engine import TrtEngine
from specdec.engines.trt_plan import (
    MAX_LOGITS,
    PLAN_FILES,
    Profile,
    build_plan,
    ensure_plan,
    optimization_profiles,
    plan_mismatch,
    select_profile,
)
from specdec.engines.wire import HINDSIGHT_TOKENS, EngineBatch
from specdec.paths import PROJECT_ROOT

ENGINES_ROOT = PROJECT_ROOT / ".run" / "engines"
HAS_GPU = torch.cuda.is_available()
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine")
needs_tensorrt = pytest.mark.skipif(
    not (HAS_GPU and HAS_TENSORRT), reason="needs a CUDA GPU and TensorRT's Python package"
)


@pytest.mark.parametrize("num_slots,max_context", [(64, 2048), (8, 512), (1, 17), (4, 8)])
def test_profile_shapes_are_ordered_and_consistent(num_slots, max_context):
    for profile in optimization_profiles(num_slots, max_context):
        shapes = profile.shapes(num_layers=3, kv_heads=2, head_dim=8)
        assert set(shapes) >= {"input_ids", "attention_mask", "past_key.2", "past_value.2"}
        for low, opt, high in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True))
        for i in range(3):  # the mask spans exactly the past and the new keys
            mask, ids, past = (
                shapes["attention_mask"][i],
                shapes["input_ids"][i],
                shapes["past_key.0"][i],
            )
            assert mask[1] == past[2] + ids[1]
        assert shapes["input_ids"][2][0] <= num_slots


def random_call(rng: random.Random, num_slots: int, max_context: int):
    """A call the BLS may send: rows on distinct slots that fit their slot."""
    rows = rng.randint(1, num_slots)
    lengths, cached, logits = [], [], []
    for _ in range(rows):
        length = rng.choice([1, 1, 2, 5, 9, 16, 17, rng.randint(1, max_context)])
        length = min(length, max_context)
        lengths.append(length)
        cached.append(rng.randint(0, max_context - length))
        logits.append(rng.randint(1, min(length, MAX_LOGITS)))  # a catch-up: guesses + 1
    return lengths, cached, logits


@pytest.mark.parametrize("num_slots,max_context", [(64, 2048), (8, 512), (2, 40)])
def test_profiles_cover_every_padded_call_the_engine_makes(num_slots, max_context):
    profiles = optimization_profiles(num_slots, max_context)
    rng = random.Random(0)
    edges = [  # a whole-context prompt, a last position, every slot verifying 9 tokens
        ([max_context], [0], [1]),
        ([max_context - 1], [0], [min(MAX_LOGITS, max_context - 1)]),  # a greedy draft prompt
        ([1], [max_context - 1], [1]),
        ([9] * num_slots, [max_context - 9] * num_slots, [9] * num_slots),
    ]
    for lengths, cached, logits in edges + [
        random_call(rng, num_slots, max_context) for _ in range(300)
    ]:
        tokens = [torch.zeros(n, dtype=torch.int64) for n in lengths]
        for rows in group_rows(lengths):
            call = pad_rows(rows, tokens, cached, logits)
            batch, new_tokens = call.input_ids.shape
            select_profile(
                profiles, batch, new_tokens, call.past_length, call.logit_positions.shape[1]
            )
    with pytest.raises(ValueError, match="no optimization profile"):
        select_profile(profiles, num_slots + 1, 1, 1, 1)


def test_float16_graph_stays_close_to_float32_torch():
    """The graph TensorRT compiles, in float16, run by onnxruntime's CPU kernels."""
    engine_dir = ensure_exported(
        DRAFT, default_engine_dir(DRAFT, ENGINES_ROOT, "float16"), "float16"
    )
    reference = LlamaEngine.from_checkpoint(DRAFT, 2, 64)
    candidate = OnnxEngine(engine_dir, 2, 64)
    assert candidate.k_cache.dtype == torch.float16
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(1))
    args = (prompt, [12, 8], [0, 1], [0, 0], [1, 1])
    worst, agree = 0.0, 0
    cached = [12, 8]
    for _ in range(17):
        expected, got = reference.forward(*args), candidate.forward(*args)
        finite = torch.isfinite(expected)
        worst = max(worst, (expected[finite] - got[finite]).abs().max().item())
        agree += int(torch.equal(expected.argmax(-1), got.argmax(-1)))
        args = (expected.argmax(-1), [1, 1], [0, 1], cached, [1, 1])
        cached = [c + 1 for c in cached]
    assert worst < 0.1, worst
    assert agree >= 16


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", [TARGET, DRAFT], ids=["target", "draft"])
def test_torch_engine_on_cuda_matches_cpu(checkpoint):
    engines = [
        LlamaEngine.from_checkpoint(checkpoint, 2, 128, device) for device in ("cpu", "cuda")
    ]
    prompt = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(2))
    args = (prompt, [20, 10], [0, 1], [0, 0], [1, 4])
    cached = [20, 10]
    for _ in range(32):
        cpu, cuda = (engine.forward(*args).cpu() for engine in engines)
        finite = torch.isfinite(cpu)
        assert (cpu[finite] - cuda[finite]).abs().max().item() < 1e-2
        tokens = cpu[[0, -1]].argmax(-1)  # each row's last position
        args = (tokens, [1, 1], [0, 1], cached, [1, 1])
        cached = [c + 1 for c in cached]


@needs_tensorrt
@pytest.mark.gpu
def test_tensorrt_plan_of_the_draft_follows_torch(tmp_path):
    from specdec.engines.trt_engine import TrtEngine

    engine = TrtEngine.from_checkpoint(DRAFT, 4, 256, engine_dir=tmp_path / "plan")
    reference = LlamaEngine.from_checkpoint(DRAFT, 4, 256)
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3))
    args = (prompt, [30, 10], [0, 3], [0, 0], [1, 1])
    cached, agree = [30, 10], 0
    for _ in range(32):
        expected, on_gpu = reference.forward(*args), engine.forward(*args)
        assert on_gpu.is_cuda  # the logits stay where the plan wrote them
        got = on_gpu.cpu()
        finite = torch.isfinite(expected)
        assert (expected[finite] - got[finite]).abs().max().item() < 0.25
        agree += int(torch.equal(expected.argmax(-1), got.argmax(-1)))
        args = (expected.argmax(-1), [1, 1], [0, 3], cached, [1, 1])
        cached = [c + 1 for c in cached]
    assert agree >= 30


@pytest.mark.skipif(HAS_GPU and HAS_TENSORRT, reason="TensorRT can run here")
def test_tensorrt_engine_without_gpu_or_tensorrt_names_the_fallback():
    from specdec.engines.select import create_engine

    with pytest.raises(RuntimeError, match="ENGINE=torch DEVICE=cuda"):
        create_engine("tensorrt", DRAFT, 2, 64)
    with pytest.raises(ValueError, match="expected one of torch, onnxruntime, tensorrt"):
        create_engine("vllm", DRAFT, 2, 64)


# --- Scripted fakes of TensorRT's objects: the tensorrt module is not installed here. ---

ENVIRONMENT = {
    "tensorrt_version": "10.16.1.11",
    "gpu": "NVIDIA H100 80GB HBM3",
    "compute_capability": "9.0",
}
TINY = LlamaConfig(  # a graph's shapes only: the fakes compute nothing
    vocab_size=64,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
DEFAULT_STREAM = 0  # the legacy default stream, what torch.cuda.current_stream() gives
ENGINE_STREAM = 0x5EED  # a stream of the engine's own


class FakeStream:
    def __init__(self, cuda_stream: int, events: list) -> None:
        self.cuda_stream, self.events = cuda_stream, events

    def wait_stream(self, other: FakeStream) -> None:
        self.events.append(("wait", self.cuda_stream, other.cuda_stream))


class FakeCuda:
    """torch.cuda's streams on the CPU: Stream() makes ENGINE_STREAM, current_stream() is
    the stream torch orders its work on (the default one unless inside stream(...));
    `events` lists the streams' waits and the contexts' executions in order."""

    def __init__(self) -> None:
        self.events: list = []
        self.active = [FakeStream(DEFAULT_STREAM, self.events)]

    def Stream(self, device=None, priority=0) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream(ENGINE_STREAM, self.events)

    def current_stream(self, device=None) -> FakeStream:
        return self.active[-1]

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        self.active.append(stream)
        try:
            yield
        finally:
            self.active.pop()


class FakeContext:
    """IExecutionContext: an input shape outside its profile's range returns False (as
    TensorRT's does), so do the (method, tensor) pairs the plan is told to refuse; every call
    is recorded with the stream torch was ordering work on at the time."""

    def __init__(self, plan: FakePlan, strategy) -> None:
        self.plan, self.strategy = plan, strategy
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.calls: list[tuple] = []

    def _record(self, *call) -> None:
        self.calls.append((*call, self.plan.cuda.current_stream().cuda_stream))

    def set_device_memory(self, address: int, size: int) -> None:
        self._record("set_device_memory", address, size)

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self._record("set_optimization_profile_async", index, stream)
        self.profile = index
        return ("set_optimization_profile_async", index) not in self.plan.refuse

    def set_input_shape(self, name: str, shape) -> bool:
        low, _, high = self.plan.profile_shapes[self.profile][name]
        self.shapes[name] = tuple(shape)
        inside = all(a <= n <= b for a, n, b in zip(low, shape, high, strict=True))
        return inside and ("set_input_shape", name) not in self.plan.refuse

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return address != 0 and ("set_tensor_address", name) not in self.plan.refuse

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        batch, new_tokens = self.shapes["input_ids"]
        if name == "logits":
            return (batch, self.shapes["logit_positions"][1], TINY.vocab_size)
        return (batch, TINY.num_kv_heads, new_tokens, TINY.head_dim)

    def execute_async_v3(self, stream: int) -> bool:
        self._record("execute_async_v3", stream, dict(self.shapes))
        self.plan.cuda.events.append(("execute", stream))
        logits = np.random.default_rng(len(self.calls)).standard_normal(
            self.get_tensor_shape("logits"), dtype=np.float32
        )  # random logits, written where the engine bound them (CPU memory here)
        ctypes.memmove(self.addresses["logits"], logits.ctypes.data, logits.nbytes)
        self.plan.written_logits.append((self.addresses["logits"], logits))
        return True


class FakePlan:
    """ICudaEngine of a plan built with the given profile shapes, for a TINY graph."""

    def __init__(self, profile_shapes, cuda: FakeCuda, refuse=(), memory_size=4096) -> None:
        self.profile_shapes = profile_shapes  # [{input: [min, opt, max]}] per profile
        self.cuda, self.refuse = cuda, set(refuse)
        self.device_memory_size_v2 = memory_size
        self.contexts: list[FakeContext] = []
        self.written_logits: list[tuple[int, np.ndarray]] = []  # (address, logits) per execution
        inputs, outputs = input_names(TINY.num_layers), output_names(TINY.num_layers)
        self.dtypes = {name: "int64" for name in inputs[:4]}
        self.dtypes |= {name: "float32" for name in inputs[4:] + outputs}

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profile_shapes)

    def get_tensor_profile_shape(self, name: str, index: int):
        return self.profile_shapes[index][name]

    @property
    def num_io_tensors(self) -> int:
        return len(self.dtypes)

    def get_tensor_name(self, index: int) -> str:
        return list(self.dtypes)[index]

    def get_tensor_dtype(self, name: str) -> str:
        return self.dtypes[name]

    def create_execution_context(self, strategy="static") -> FakeContext:
        context = FakeContext(self, strategy)
        self.contexts.append(context)
        return context


class FakeLogger:
    WARNING = "warning"

    def __init__(self, severity: str) -> None:
        self.severity = severity


class FakeTensorRT:
    """A scripted `tensorrt` module: its Builder records the profiles it is given; its
    Runtime deserializes into a FakePlan of the last build's profiles (or None)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.builds: list[list[dict]] = []  # per build: {input: [min, opt, max]} per profile
        self.plan: FakePlan | None = None
        self.deserializes = True
        self.refuse: set = set()

    def module(self) -> types.ModuleType:
        trt = types.ModuleType("tensorrt")
        trt.__version__ = ENVIRONMENT["tensorrt_version"]
        trt.Logger = FakeLogger
        trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(
            STATIC="static", ON_PROFILE_CHANGE="on_profile_change", USER_MANAGED="user_managed"
        )
        for name in ("float32", "float16", "bfloat16", "int64", "int32", "bool"):
            setattr(trt, name, name)
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)
        trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
        trt.Builder = lambda logger: FakeBuilder(self)
        trt.OnnxParser = lambda network, logger: types.SimpleNamespace(
            parse_from_file=lambda path: Path(path).is_file(), num_errors=0
        )
        trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=self.load)
        return trt

    def load(self, data: bytes) -> FakePlan | None:
        assert data == b"a serialized plan"
        if not self.deserializes:
            return None
        self.plan = FakePlan(self.builds[-1], self.cuda, self.refuse)
        return self.plan


class FakeBuilder:
    def __init__(self, trt: FakeTensorRT) -> None:
        self.trt, self.profiles = trt, []

    def create_network(self, flags: int):
        assert flags == 1 << 0  # strongly typed
        return object()

    def create_optimization_profile(self) -> dict:
        profile: dict = {}
        self.profiles.append(profile)
        return types.SimpleNamespace(set_shape=lambda name, *shapes: profile.update({name: shapes}))

    def create_builder_config(self):
        return types.SimpleNamespace(
            set_memory_pool_limit=lambda pool, size: None,
            add_optimization_profile=lambda profile: None,
        )

    def build_serialized_network(self, network, config) -> bytes:
        self.trt.builds.append([{k: list(v) for k, v in p.items()} for p in self.profiles])
        return b"a serialized plan"


@pytest.fixture
def fake_trt(monkeypatch) -> FakeTensorRT:
    """tensorrt and torch.cuda's streams faked for the engine's code, on the CPU."""
    cuda = FakeCuda()
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    trt = FakeTensorRT(cuda)
    monkeypatch.setitem(sys.modules, "tensorrt", trt.module())
    for module in ("trt_plan", "trt_engine"):  # where plans are built, and loaded
        here = f"specdec.engines.{module}.current_environment"
        monkeypatch.setattr(here, lambda: dict(ENVIRONMENT))
    return trt


def tiny_onnx_dir(root: Path, head_token_ids: np.ndarray | None = None) -> Path:
    """An export's folder as specdec/engines/onnx_export.py writes it, of a TINY graph."""
    onnx_dir = root / "onnx"
    onnx_dir.mkdir(parents=True)
    (onnx_dir / "model.onnx").write_bytes(b"graph")
    if head_token_ids is not None:
        np.save(onnx_dir / "head_token_ids.npy", head_token_ids)
    manifest = {
        "format_version": FORMAT_VERSION,
        "checkpoint": str(DRAFT),
        "fingerprint": checkpoint_fingerprint(DRAFT),
        "dtype": "float32",  # the fakes' cache: float16 indexing is slow on these CPUs
        "graph": "model.onnx",
        "head_token_ids": "head_token_ids.npy" if head_token_ids is not None else None,
        "config": dataclasses.asdict(TINY),
    }
    (onnx_dir / MANIFEST).write_text(json.dumps(manifest))
    return onnx_dir


def tiny_engine(tmp_path: Path, num_slots: int, max_context: int) -> TrtEngine:
    onnx_dir = tiny_onnx_dir(tmp_path)
    plan_dir = build_plan(onnx_dir, tmp_path / "plan", num_slots, max_context, ENVIRONMENT)
    return TrtEngine(plan_dir, num_slots, max_context, device="cpu")


def configured_max_draft_tokens() -> int:
    text = (PROJECT_ROOT / "model_repository/speculative_decoding/config.pbtxt").read_text()
    return int(re.search(r'"max_num_draft_tokens" value: \{ string_value: "(\d+)"', text)[1])


# --- Defect 1: the profiles must admit every call the engine makes. ---


def scheduler_batch(rng: random.Random, role: str, num_slots: int, max_context: int, max_k: int):
    """A batch the scheduler may send: rows on distinct slots, greedy or sampled, each a new
    prompt (up to the whole context), a draft's catch-up of many tokens (hindsight), or a
    decode / verify step of pending tokens + k proposals, some at the end of the context."""
    num_rows = rng.randint(1, num_slots)
    lengths, cached, steps = [], [], []
    for row in range(num_rows):
        long_rows = ["prompt", "catch_up"] if row < 3 else []  # each runs alone: a few
        kind = rng.choice([*long_rows, "step", "step", "last"])
        k = rng.randint(0, max_k)
        base = {
            "prompt": rng.randint(1, max_context - 1),
            "catch_up": rng.randint(3, min(200, max_context - 1)),
        }.get(kind, rng.randint(1, 2))
        length = base + k if role == "target" else base  # the target verifies the proposals
        k = max(0, min(k, max_context - length - 1))  # the scheduler leaves room
        length = base + k if role == "target" else min(base, max_context - 1)
        room = max_context - length - (k if role == "draft" else 0)
        cache = room if kind == "last" else rng.randint(0, room)
        if kind == "prompt":
            cache = 0
        lengths.append(length)
        cached.append(cache)
        steps.append(k + 1 if role == "target" else k)
    rows = len(lengths)
    return EngineBatch(
        input_ids=np.array([rng.randrange(TINY.vocab_size) for _ in range(sum(lengths))]),
        input_lengths=np.array(lengths, dtype=np.int32),
        slot_ids=np.array(rng.sample(range(num_slots), rows), dtype=np.int32),
        cache_lengths=np.array(cached, dtype=np.int32),
        num_steps=np.array(steps, dtype=np.int32),
        temperature=np.array([rng.choice([0.0, 0.0, 0.8]) for _ in range(rows)], np.float32),
        top_k=np.zeros(rows, dtype=np.int32),
        top_p=np.ones(rows, dtype=np.float32),
        end_ids=np.full(rows, -1, dtype=np.int32),
        min_tokens_left=np.zeros(rows, dtype=np.int32),
        seeds=np.arange(rows, dtype=np.int64),
    )


def test_configured_k_fits_the_plans():
    assert configured_max_draft_tokens() + 1 <= MAX_LOGITS
    assert MAX_LOGITS >= HINDSIGHT_TOKENS + 1  # a greedy draft row catching up


def test_issue_example_a_greedy_draft_prompt_finds_a_profile():
    profiles = optimization_profiles(64, 2048)
    assert profiles[select_profile(profiles, 1, 40, 1, HINDSIGHT_TOKENS + 1)].name == "prefill"


@pytest.mark.parametrize("num_slots,max_context", [(64, 2048), (4, 40)])
def test_every_batch_the_scheduler_sends_fits_a_profile(fake_trt, tmp_path, num_slots, max_context):
    """Property: draft and target calls of random scheduler batches (the target's k up to
    the most a plan serves, above the configured maximum) go through the real engine code;
    the fake context refuses any input shape outside the chosen profile's range, as
    TensorRT does, and the engine then raises."""
    engine = tiny_engine(tmp_path, num_slots, max_context)
    rng = random.Random(16)
    draft_k = configured_max_draft_tokens()  # k one-token steps: their shapes repeat
    for _ in range(12):
        run_draft(engine, scheduler_batch(rng, "draft", num_slots, max_context, draft_k))
        run_target(engine, scheduler_batch(rng, "target", num_slots, max_context, MAX_LOGITS - 1))
    executed = [
        c for ctx in fake_trt.plan.contexts for c in ctx.calls if c[0] == "execute_async_v3"
    ]
    widest = max(shapes["logit_positions"][1] for _, _, shapes, _ in executed)
    assert widest > 16  # the test reached what the old profiles refused
    used = {ctx.profile for ctx in fake_trt.plan.contexts if len(ctx.calls) > 2}
    assert used == set(range(len(engine.profiles)))


# --- Defect 2: a plan folder holds every file its manifest names. ---


def test_plan_folder_of_the_draft_resolves_every_file_its_manifest_names(fake_trt, tmp_path):
    """The build step (TensorRT faked) on the real draft's float16 export: its reduced head
    must load from the plan folder alone, as TrtEngine loads it."""
    onnx_dir = ensure_exported(DRAFT, default_engine_dir(DRAFT, ENGINES_ROOT, "float16"), "float16")
    plan_dir = build_plan(onnx_dir, tmp_path / "plan", 4, 256, ENVIRONMENT)
    manifest = json.loads((plan_dir / MANIFEST).read_text())
    assert manifest["head_token_ids"], "the committed draft has a reduced head"
    for key in PLAN_FILES:
        assert (plan_dir / manifest[key]).is_file(), key
    for key, value in manifest.items():  # anything else the export named, too
        if isinstance(value, str) and (onnx_dir / value).is_file():
            assert (plan_dir / value).is_file(), key
    _, config, head = manifest_config(plan_dir)
    _, _, onnx_head = manifest_config(onnx_dir)
    assert torch.equal(head, onnx_head) and config.vocab_size == 49152


# --- Defect 3: a plan of another TensorRT, GPU, format or profiles is rebuilt or refused. ---


def tiny_plan(tmp_path: Path, num_slots: int = 4, max_context: int = 64) -> Path:
    """A plan folder as ensure_plan leaves it (the export faked: a TINY graph's folder)."""
    onnx_dir = tiny_onnx_dir(tmp_path)
    return build_plan(onnx_dir, tmp_path / "plan", num_slots, max_context, ENVIRONMENT)


def edit_manifest(plan_dir: Path, **changes) -> None:
    manifest = json.loads((plan_dir / MANIFEST).read_text())
    (plan_dir / MANIFEST).write_text(json.dumps({**manifest, **changes}))


def old_profiles(plan_dir: Path) -> list[dict]:
    """The plan's profiles as the old code built them: at most 16 logits per row."""
    profiles = json.loads((plan_dir / MANIFEST).read_text())["profiles"]
    for profile in profiles:
        profile["num_logits"]["max"] = min(profile["num_logits"]["max"], 16)
    return profiles


STALE = {  # what differs -> (manifest edits, environment edits, words of the reason)
    "tensorrt": ({}, {"tensorrt_version": "10.17.0.1"}, "tensorrt_version"),
    "gpu": ({}, {"gpu": "NVIDIA L4"}, "gpu"),
    "compute capability": ({}, {"compute_capability": "8.9"}, "compute_capability"),
    "format": ({"plan_format_version": 1}, {}, "plan format 1"),
    "profiles": ("old", {}, "profiles do not cover prefill"),
    "dtype": ({"dtype": "bfloat16"}, {}, "built in bfloat16"),
    "head file": ("no head", {}, "missing head_token_ids.npy"),
}


@pytest.mark.parametrize("case", list(STALE))
def test_a_stale_or_foreign_plan_is_rebuilt_with_the_reason(
    fake_trt, tmp_path, monkeypatch, capsys, case
):
    onnx_dir = tiny_onnx_dir(tmp_path, head_token_ids=np.arange(10))
    monkeypatch.setattr("specdec.engines.onnx_export.ensure_exported", lambda *args: onnx_dir)
    plan_dir = tmp_path / "plan"
    ensure_plan(DRAFT, plan_dir, 4, 64, "float16" if case == "dtype" else "float32")
    assert len(fake_trt.builds) == 1
    edits, environment, reason = STALE[case]
    if edits == "old":
        edits = {"profiles": old_profiles(plan_dir)}
    elif edits == "no head":
        edits, _ = {}, (plan_dir / "head_token_ids.npy").unlink()
    edit_manifest(plan_dir, **edits)
    here, dtype = {**ENVIRONMENT, **environment}, "float32"
    capsys.readouterr()
    ensure_plan(DRAFT, plan_dir, 4, 64, dtype, here)
    assert len(fake_trt.builds) == 2, "not rebuilt"
    assert reason in capsys.readouterr().err  # the log says why
    assert plan_mismatch(plan_dir, DRAFT, 4, 64, dtype, here) is None
    ensure_plan(DRAFT, plan_dir, 4, 64, dtype, here)  # now current: kept
    assert len(fake_trt.builds) == 2


def test_a_current_plan_covers_smaller_limits_not_larger(fake_trt, tmp_path):
    plan_dir = tiny_plan(tmp_path, num_slots=4, max_context=64)
    assert plan_mismatch(plan_dir, DRAFT, 4, 64, "float32", ENVIRONMENT) is None
    assert plan_mismatch(plan_dir, DRAFT, 2, 32, "float32", ENVIRONMENT) is None
    assert "do not cover decode" in plan_mismatch(plan_dir, DRAFT, 8, 64, "float32", ENVIRONMENT)
    assert "do not cover" in plan_mismatch(plan_dir, DRAFT, 4, 128, "float32", ENVIRONMENT)


@pytest.mark.parametrize("key", ["tensorrt_version", "gpu", "compute_capability"])
def test_engine_refuses_a_plan_of_another_tensorrt_or_gpu(fake_trt, tmp_path, key):
    plan_dir = tiny_plan(tmp_path)
    here = {**ENVIRONMENT, key: "something else"}
    with pytest.raises(RuntimeError, match=f"cannot run here: built with {key}"):
        TrtEngine(plan_dir, 4, 64, device="cpu", environment=here)
    assert fake_trt.plan is None  # never deserialized


def test_engine_refuses_a_plan_whose_profiles_are_not_its_manifests(fake_trt, tmp_path):
    plan_dir = tiny_plan(tmp_path)
    edit_manifest(plan_dir, profiles=old_profiles(plan_dir))  # an old plan's
    with pytest.raises(RuntimeError, match=r"plan profile 1 \(prefill\) has logit_positions"):
        TrtEngine(plan_dir, 4, 64, device="cpu")


def test_engine_refuses_a_plan_tensorrt_cannot_deserialize(fake_trt, tmp_path):
    plan_dir = tiny_plan(tmp_path)
    fake_trt.deserializes = False
    with pytest.raises(RuntimeError, match="could not deserialize .*model.plan.*rebuild"):
        TrtEngine(plan_dir, 4, 64, device="cpu")


def test_plan_manifest_records_tensorrt_gpu_format_and_profiles(fake_trt, tmp_path):
    manifest = json.loads((tiny_plan(tmp_path) / MANIFEST).read_text())
    assert {k: manifest[k] for k in ENVIRONMENT} == ENVIRONMENT
    assert manifest["plan_format_version"] >= 2
    profiles = [Profile.from_dict(p) for p in manifest["profiles"]]
    assert profiles == optimization_profiles(4, 64)
    built = fake_trt.builds[-1]  # what the builder got is what the manifest says
    assert built == [p.shapes(TINY.num_layers, 1, TINY.head_dim) for p in profiles]


def test_the_image_pins_tensorrt_and_the_readme_names_the_pair():
    dockerfile = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    version = re.search(r"^ARG TENSORRT_VERSION=(\S+)$", dockerfile, re.M)[1]
    image = re.search(r"^ARG TRITON_IMAGE=(\S+)$", dockerfile, re.M)[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", version)
    assert 'pip install "${TENSORRT_PACKAGE}==${TENSORRT_VERSION}"' in dockerfile
    readme = " ".join((PROJECT_ROOT / "README.md").read_text().split())
    assert f"`{image}` (CUDA 13) with TensorRT {version}" in readme


# --- Defects 4, 5, 6: return values, the engine's own stream, one activation block. ---


def one_call(engine: TrtEngine, input_length: int = 3, num_logits: int = 1) -> torch.Tensor:
    tokens = torch.arange(input_length)
    return engine.forward(tokens, [input_length], [0], [0], [num_logits])


@pytest.mark.parametrize(
    "refused,message",
    [
        (("set_input_shape", "past_key.1"), r"refused input past_key.1 of shape \(1, 1, 1, 4\)"),
        (("set_tensor_address", "attention_mask"), r"address of attention_mask \(shape \(1, 4\)"),
        (("set_tensor_address", "new_value.0"), r"address of new_value.0 \(shape \(1, 1, 3, 4\)"),
    ],
)
def test_a_refused_shape_or_address_fails_with_the_tensor_and_shape(
    fake_trt, tmp_path, refused, message
):
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    fake_trt.plan.refuse.add(refused)
    with pytest.raises(RuntimeError, match=message):
        one_call(engine)
    assert not any(c[0] == "execute_async_v3" for ctx in fake_trt.plan.contexts for c in ctx.calls)


def test_a_shape_outside_the_profile_fails_before_execution(fake_trt, tmp_path):
    """Where TensorRT's profile is narrower than the engine believes, set_input_shape
    returns False: the call fails there, naming the input, not later in execute."""
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    one_call(engine, input_length=3, num_logits=3)
    fake_trt.plan.profile_shapes[0]["logit_positions"][2] = (4, 2)  # TensorRT's max: 2
    with pytest.raises(RuntimeError, match=r"refused input logit_positions of shape \(1, 3\)"):
        one_call(engine, input_length=3, num_logits=3)
    executed = [
        c for ctx in fake_trt.plan.contexts for c in ctx.calls if c[0] == "execute_async_v3"
    ]
    assert len(executed) == 1


def test_a_refused_optimization_profile_fails_at_load(fake_trt, tmp_path):
    fake_trt.refuse.add(("set_optimization_profile_async", 1))
    with pytest.raises(RuntimeError, match="refused optimization profile 1"):
        TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")


def test_tensorrt_runs_on_a_stream_of_the_engines_own(fake_trt, tmp_path):
    """Not torch's default stream; and torch's work of the call (gathers, appends, the
    logits picked) is ordered on that same stream: TensorRT is called inside it."""
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    one_call(engine, input_length=20, num_logits=1)  # prefill
    one_call(engine, input_length=2, num_logits=2)  # decode
    calls = [c for ctx in fake_trt.plan.contexts for c in ctx.calls if c[0] != "set_device_memory"]
    assert {c[0] for c in calls} == {"set_optimization_profile_async", "execute_async_v3"}
    for call in calls:  # (name, [profile index,] stream handle, ..., torch's stream)
        given = call[2] if call[0] == "set_optimization_profile_async" else call[1]
        ordered_on = call[-1]
        assert given == ENGINE_STREAM != DEFAULT_STREAM
        assert ordered_on == ENGINE_STREAM, call[0]
    assert len([c for c in calls if c[0] == "execute_async_v3"]) == 2


def test_the_callers_stream_and_the_engines_wait_for_each_other(fake_trt, tmp_path):
    """The logits stay on the GPU, so nothing synchronises the host: before a call the
    engine's stream waits for the caller's (inputs made there), after it the caller's waits
    for the engine's (the logits it reads); a slot copy waits for the caller's too."""
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    events = fake_trt.cuda.events
    events.clear()
    one_call(engine, input_length=20, num_logits=1)  # prefill
    one_call(engine, input_length=2, num_logits=2)  # decode
    engine_waits = ("wait", ENGINE_STREAM, DEFAULT_STREAM)  # (waiting, waited for)
    caller_waits = ("wait", DEFAULT_STREAM, ENGINE_STREAM)
    executed = ("execute", ENGINE_STREAM)
    assert events == [engine_waits, executed, caller_waits] * 2
    events.clear()
    engine.copy_slot(0, 1, 5)
    assert events == [engine_waits]


def test_the_logits_are_where_the_plan_wrote_them(fake_trt, tmp_path):
    """No copy of a decode or verify call's logits (every row asks for all L columns): the
    engine returns the tensor the plan wrote, in row order. Where rows ask for fewer, or a
    prompt runs in a call of its own, the rows asked for come back in the caller's order."""
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    written = fake_trt.plan.written_logits
    logits = engine.forward(torch.arange(6), [3, 3], [0, 2], [0, 0], [3, 3])
    address, plan_logits = written[-1]
    assert logits.data_ptr() == address and logits.dtype == torch.float32
    assert torch.equal(logits, torch.from_numpy(plan_logits).reshape(6, TINY.vocab_size))
    written.clear()
    logits = engine.forward(torch.arange(25), [20, 3, 2], [1, 0, 3], [0, 3, 2], [1, 3, 1])
    (_, short), (_, prompt) = written  # short rows first (one call), then the prompt alone
    expected = [prompt[0, :1], short[0, :3], short[1, :1]]
    assert torch.equal(logits, torch.from_numpy(np.concatenate(expected)))


def test_contexts_share_one_user_managed_activation_block(fake_trt, tmp_path):
    engine = TrtEngine(tiny_plan(tmp_path), 4, 64, device="cpu")
    contexts = fake_trt.plan.contexts
    assert len(contexts) == len(engine.profiles) == 2
    assert all(c.strategy == "user_managed" for c in contexts)
    blocks = {c.calls[0][:3] for c in contexts}  # (set_device_memory, address, size)
    assert blocks == {("set_device_memory", engine.activations.data_ptr(), 4096)}
    assert engine.activations.numel() == 4096  # one block, of the largest profile's size
    assert [c.profile for c in contexts] == [0, 1]


def test_tensorrt_10_0_sizes_and_sets_the_block_without_the_v2_calls(fake_trt, tmp_path):
    from specdec.engines.trt_engine import create_contexts

    plan = FakePlan([{}, {}], fake_trt.cuda, memory_size=0)
    del plan.device_memory_size_v2
    plan.device_memory_size = 2048
    set_by_property = []

    class OldContext(FakeContext):  # TensorRT 10.0: a writable device_memory, no setter
        set_device_memory = property()

        @property
        def device_memory(self):
            raise AttributeError("write-only")

        @device_memory.setter
        def device_memory(self, address):
            set_by_property.append(address)

    plan.create_execution_context = lambda strategy: OldContext(plan, strategy)
    trt = sys.modules["tensorrt"]
    block, contexts = create_contexts(trt, plan, 2, ENGINE_STREAM, lambda n: torch.empty(n))
    assert block.numel() == 2048 and set_by_property == [block.data_ptr()] * 2


# --- Defect 7: the server's DTYPE reaches the tensorrt engine. ---


@pytest.mark.parametrize(
    "requested,gpu_has_bf16,chosen",
    [
        ("bfloat16", True, "bfloat16"),
        ("float16", True, "float16"),
        ("auto", True, "bfloat16"),
        ("auto", False, "float16"),
    ],
)
def test_create_engine_passes_the_dtype_to_the_tensorrt_engine(
    monkeypatch, requested, gpu_has_bf16, chosen
):
    import specdec.engines.select as engines

    asked = {}
    monkeypatch.setattr(engines, "require_tensorrt", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: gpu_has_bf16)
    monkeypatch.setattr(
        TrtEngine, "from_checkpoint", classmethod(lambda cls, *args, **kwargs: asked.update(kwargs))
    )
    engines.create_engine("tensorrt", DRAFT, 2, 64, device="cuda", dtype=requested)
    assert asked["dtype"] == chosen
