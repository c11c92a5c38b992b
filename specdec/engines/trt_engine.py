"""TensorRT plans of the exported decoder graph, and the `tensorrt` engine that runs them.

A plan is compiled from the ONNX that specdec/engines/onnx_export.py writes, in float16 or bfloat16
(the graph exported in that dtype, built strongly typed: RMSNorm and softmax stay float32 as
the graph says). Two optimization profiles cover what GraphEngine sends:
- `decode`: B 1..num_slots rows of T 1..16 new tokens (decode, and verify of k + 1 <= 16);
- `prefill`: one row of T 17..max_context tokens (GraphEngine runs long rows alone: prompts,
  a draft's catch-up, a verify of k + 1 > 16);
past length P from 1 (a masked position) to what the context leaves; L logits per row up to
MAX_LOGITS (a greedy draft row that catches up asks for LOOKBACK_TOKENS + 1).

A plan folder holds model.plan, engine.json (the graph's manifest, the profiles, and the
TensorRT version, GPU and compute capability that built it: a plan runs only there) and
every other file the manifest names (a draft's head_token_ids.npy); the ONNX it came from
stays in onnx/. A plan that no longer fits is rebuilt (`ensure_plan`) or refused with the
reason (`TrtEngine`), never loaded.

The engine runs the plan on a CUDA stream of its own (TensorRT's enqueueV3 pays extra
device synchronisations on the default stream), with every torch tensor of a call ordered on
that stream. It keeps one execution context per profile, so a call never switches profiles;
the contexts run one after another, so they share one user-managed activation block sized
for the largest profile. The KV cache lives in device memory (torch CUDA tensors); inputs
and outputs are bound by address, no host copies but the logits.

The pure parts (profiles, manifests, the compatibility rules, context set-up and binding
with their return values checked) take TensorRT's objects as arguments, so
tests/test_tensorrt.py runs them on the CPU with scripted fakes.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from specdec.engines.onnx_engine import MAX_BATCHED_QUERY, GraphEngine, default_engines_root
from specdec.engines.onnx_export import DTYPES, MANIFEST, input_names, read_manifest
from specdec.engines.wire import LOOKBACK_TOKENS

PLAN_FILE = "model.plan"
# Bump when a plan folder's layout or the meaning of its profiles changes: older plans are
# rebuilt. 2: profiles, TensorRT version and GPU in engine.json, head_token_ids.npy beside it.
PLAN_FORMAT_VERSION = 2
# Logits per row: a greedy draft row catching up asks for lookback + 1, the target k + 1
# (so k <= MAX_LOGITS - 1 = 32 fits a plan).
MAX_LOGITS = LOOKBACK_TOKENS + 1
PLAN_FILES = ("graph", "head_token_ids")  # manifest keys that name a file of the folder
ENVIRONMENT_KEYS = ("tensorrt_version", "gpu", "compute_capability")  # a plan runs only there

Shape = tuple[int, ...]


@dataclass(frozen=True)
class AxisRange:
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"axis range {self} is not 1 <= min <= opt <= max")

    def __add__(self, other: AxisRange) -> AxisRange:
        return AxisRange(self.min + other.min, self.opt + other.opt, self.max + other.max)

    def contains(self, other: AxisRange) -> bool:
        return self.min <= other.min and other.max <= self.max


@dataclass(frozen=True)
class Profile:
    name: str
    batch: AxisRange
    new_tokens: AxisRange
    past_length: AxisRange
    num_logits: AxisRange

    def axes(self) -> tuple[AxisRange, ...]:
        return (self.batch, self.new_tokens, self.past_length, self.num_logits)

    def shapes(self, num_layers: int, kv_heads: int, head_dim: int) -> dict[str, list[Shape]]:
        """Input name -> [min, opt, max] shapes, as IOptimizationProfile.set_shape takes them."""
        total = self.past_length + self.new_tokens  # the mask spans past and new keys

        def shape(*axes) -> list[Shape]:
            return [
                tuple(a if isinstance(a, int) else getattr(a, end) for a in axes)
                for end in ("min", "opt", "max")
            ]

        shapes = {
            "input_ids": shape(self.batch, self.new_tokens),
            "position_ids": shape(self.batch, self.new_tokens),
            "attention_mask": shape(self.batch, total),
            "logit_positions": shape(self.batch, self.num_logits),
        }
        past = shape(self.batch, kv_heads, self.past_length, head_dim)
        for name in input_names(num_layers)[4:]:
            shapes[name] = past
        return shapes

    def covers(self, batch: int, new_tokens: int, past_length: int, num_logits: int) -> bool:
        pairs = zip(self.axes(), (batch, new_tokens, past_length, num_logits), strict=True)
        return all(axis.min <= value <= axis.max for axis, value in pairs)

    def contains(self, other: Profile) -> bool:
        """Whether every call `other` covers is covered here too."""
        return all(a.contains(b) for a, b in zip(self.axes(), other.axes(), strict=True))

    def __str__(self) -> str:
        axes = zip(fields(self)[1:], self.axes(), strict=True)
        ranges = (f"{f.name} {a.min}..{a.max}" for f, a in axes)
        return f"{self.name} ({', '.join(ranges)})"

    def to_dict(self) -> dict:
        return asdict(self)  # {"name": ..., "batch": {"min": ..., "opt": ..., "max": ...}, ...}

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        return cls(data["name"], *(AxisRange(**data[f.name]) for f in fields(cls)[1:]))


def optimization_profiles(num_slots: int, max_context: int) -> list[Profile]:
    """The profiles a plan needs to serve num_slots sequences of max_context positions."""
    if num_slots < 1 or max_context < 2:
        raise ValueError("need num_slots >= 1 and max_context >= 2")
    short = min(MAX_BATCHED_QUERY, max_context)  # rows of up to this many tokens share calls
    decode_past = AxisRange(1, max(1, min(max_context // 4, max_context - short)), max_context - 1)
    profiles = [
        Profile(
            name="decode",
            batch=AxisRange(1, min(num_slots, 8), num_slots),
            new_tokens=AxisRange(1, 1, short),
            past_length=decode_past,
            num_logits=AxisRange(1, 1, min(MAX_LOGITS, short)),  # L <= T
        )
    ]
    if max_context > short:  # longer rows (prefill, catch-up, long verify) run alone
        profiles.append(
            Profile(
                name="prefill",
                batch=AxisRange(1, 1, 1),
                new_tokens=AxisRange(short + 1, min(max(short + 1, 256), max_context), max_context),
                past_length=AxisRange(1, 1, max(1, max_context - short - 1)),
                num_logits=AxisRange(1, 1, min(MAX_LOGITS, max_context)),
            )
        )
    return profiles


def select_profile(
    profiles: list[Profile], batch: int, new_tokens: int, past_length: int, num_logits: int
) -> int:
    """Index of the first profile that covers a call's sizes."""
    for index, profile in enumerate(profiles):
        if profile.covers(batch, new_tokens, past_length, num_logits):
            return index
    raise ValueError(
        f"no optimization profile covers batch {batch}, {new_tokens} new tokens, "
        f"past {past_length}, {num_logits} logits: rebuild the plan for these limits"
    )


def current_environment() -> dict[str, str]:
    """What a plan is bound to: this TensorRT and this GPU (needs both)."""
    import tensorrt as trt

    major, minor = torch.cuda.get_device_capability()
    return {
        "tensorrt_version": trt.__version__,
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
    }


def plan_manifest(
    onnx_manifest: dict, num_slots: int, max_context: int, environment: dict[str, str]
) -> dict:
    """engine.json of a plan folder: the graph's manifest, the limits and profiles it was
    built for, and the TensorRT version and GPU that built it."""
    return {
        **onnx_manifest,
        "graph": PLAN_FILE,
        "plan_format_version": PLAN_FORMAT_VERSION,
        **{key: environment[key] for key in ENVIRONMENT_KEYS},
        "num_slots": num_slots,
        "max_context": max_context,
        "profiles": [p.to_dict() for p in optimization_profiles(num_slots, max_context)],
    }


def plan_problem(manifest: dict, environment: dict[str, str]) -> str | None:
    """Why a plan of this manifest cannot run here; None when it can."""
    if manifest.get("plan_format_version") != PLAN_FORMAT_VERSION:
        found = manifest.get("plan_format_version")
        return f"plan format {found}, this code reads format {PLAN_FORMAT_VERSION}"
    for key in ENVIRONMENT_KEYS:
        if manifest.get(key) != environment[key]:
            return f"built with {key} {manifest.get(key)!r}, this host has {environment[key]!r}"
    return None


def plan_mismatch(
    plan_dir: Path,
    checkpoint: Path,
    num_slots: int,
    max_context: int,
    dtype: str,
    environment: dict[str, str],
) -> str | None:
    """Why plan_dir cannot serve this checkpoint for these limits here; None when it can."""
    from specdec.engines.onnx_export import checkpoint_fingerprint

    try:
        manifest = read_manifest(plan_dir)
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    problem = plan_problem(manifest, environment)
    if problem:
        return problem
    missing = [name for name in plan_files(manifest) if not (plan_dir / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    if manifest.get("dtype") != dtype:
        return f"built in {manifest.get('dtype')}, asked for {dtype}"
    if manifest.get("fingerprint") != checkpoint_fingerprint(checkpoint):
        return "the checkpoint changed since the build"
    try:
        built = [Profile.from_dict(p) for p in manifest["profiles"]]
    except (KeyError, TypeError, ValueError) as error:
        return f"unreadable profiles ({type(error).__name__}: {error})"
    needed = optimization_profiles(num_slots, max_context)
    uncovered = [p.name for p in needed if not any(b.contains(p) for b in built)]
    if uncovered:
        return f"its profiles do not cover {', '.join(uncovered)} for {num_slots} x {max_context}"
    return None


def plan_files(manifest: dict) -> list[str]:
    """The files of a plan folder that its manifest names."""
    return [manifest[key] for key in PLAN_FILES if manifest.get(key)]


def write_plan_dir(onnx_dir: Path, plan_dir: Path, serialized: bytes, manifest: dict) -> Path:
    """plan_dir/model.plan, the files the manifest names (copied from onnx_dir), and
    engine.json last, so that an interrupted write leaves no manifest (and is rebuilt)."""
    plan_dir.mkdir(parents=True, exist_ok=True)
    (plan_dir / MANIFEST).unlink(missing_ok=True)
    (plan_dir / PLAN_FILE).write_bytes(serialized)
    for name in plan_files(manifest):
        if name != PLAN_FILE:
            shutil.copyfile(onnx_dir / name, plan_dir / name)
    (plan_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return plan_dir


def build_plan(
    onnx_dir: Path,
    plan_dir: Path,
    num_slots: int,
    max_context: int,
    environment: dict[str, str] | None = None,
    workspace_gib: float = 8.0,
) -> Path:
    """Compiles onnx_dir's graph into a plan folder with the TensorRT Python API."""
    import tensorrt as trt

    onnx_manifest = read_manifest(onnx_dir)
    manifest = plan_manifest(
        onnx_manifest, num_slots, max_context, environment or current_environment()
    )
    c = onnx_manifest["config"]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_dir / onnx_manifest["graph"])):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError("TensorRT could not parse the graph: " + "; ".join(errors))
    build_config = builder.create_builder_config()
    build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    for profile in map(Profile.from_dict, manifest["profiles"]):
        trt_profile = builder.create_optimization_profile()
        shapes = profile.shapes(c["num_layers"], c["num_kv_heads"], c["head_dim"])
        for name, (low, opt, high) in shapes.items():
            trt_profile.set_shape(name, low, opt, high)
        build_config.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, build_config)
    if serialized is None:
        raise RuntimeError("TensorRT build failed (see the log above)")
    return write_plan_dir(onnx_dir, plan_dir, bytes(serialized), manifest)


def ensure_plan(
    checkpoint: Path,
    plan_dir: Path,
    num_slots: int,
    max_context: int,
    dtype: str = "float16",
    environment: dict[str, str] | None = None,
) -> Path:
    """Exports the graph in `dtype` (into plan_dir/onnx) and builds the plan, unless plan_dir
    already serves these limits here (plan_mismatch; the reason to build goes to stderr);
    one builder at a time per folder (a file lock)."""
    import fcntl

    from specdec.engines.onnx_export import ensure_exported

    environment = environment or current_environment()
    plan_dir.mkdir(parents=True, exist_ok=True)
    with open(plan_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reason = plan_mismatch(plan_dir, checkpoint, num_slots, max_context, dtype, environment)
        if reason is not None:
            print(f"specdec: building TensorRT plan {plan_dir}: {reason}", file=sys.stderr)
            onnx_dir = ensure_exported(checkpoint, plan_dir / "onnx", dtype)
            build_plan(onnx_dir, plan_dir, num_slots, max_context, environment)
    return plan_dir


def default_plan_dir(checkpoint: Path, root: Path, dtype: str = "float16") -> Path:
    return root / checkpoint.resolve().name / f"tensorrt-{dtype}"


def deserialize_plan(runtime, path: Path):
    """The ICudaEngine of a plan file; a clear error where TensorRT returns None."""
    plan = runtime.deserialize_cuda_engine(path.read_bytes())
    if plan is None:
        raise RuntimeError(
            f"TensorRT could not deserialize {path} (its log above says why): a plan runs "
            "only with the TensorRT version and GPU that built it; rebuild it with "
            "`python -m build.build_trt`, or delete its folder and the server rebuilds it"
        )
    return plan


def check_plan_profiles(plan, profiles: list[Profile], config) -> None:
    """The plan's own profiles must be its manifest's: the engine selects by the manifest."""
    if plan.num_optimization_profiles != len(profiles):
        raise RuntimeError(
            f"the plan has {plan.num_optimization_profiles} optimization profiles, its "
            f"manifest {len(profiles)}: rebuild it"
        )
    for index, profile in enumerate(profiles):
        shapes = profile.shapes(config.num_layers, config.num_kv_heads, config.head_dim)
        for name, expected in shapes.items():
            actual = [tuple(dims) for dims in plan.get_tensor_profile_shape(name, index)]
            if actual != expected:
                raise RuntimeError(
                    f"plan profile {index} ({profile.name}) has {name} {actual}, its manifest "
                    f"{expected}: rebuild it"
                )


def activation_size(plan) -> int:
    """Bytes of activation memory the largest profile needs (TensorRT 10.1+: _v2)."""
    size = getattr(plan, "device_memory_size_v2", None)
    return int(plan.device_memory_size if size is None else size)


def create_contexts(
    trt, plan, num_profiles: int, stream_handle: int, allocate: Callable[[int], torch.Tensor]
) -> tuple[torch.Tensor, list]:
    """One execution context per profile, each on that profile, all sharing one activation
    block from `allocate(bytes)`: the contexts run one after another on one stream, so one
    block of the largest profile's size serves them all (TensorRT's default gives each
    context its own). Returns the block (keep it alive) and the contexts."""
    size = activation_size(plan)
    block = allocate(max(size, 1))
    contexts = []
    for index in range(num_profiles):
        context = plan.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise RuntimeError(
                f"TensorRT could not create an execution context for profile {index}"
            )
        if hasattr(context, "set_device_memory"):  # TensorRT 10.1+
            context.set_device_memory(block.data_ptr(), size)
        else:
            context.device_memory = block.data_ptr()
        select_context_profile(context, index, stream_handle)
        contexts.append(context)
    return block, contexts


def select_context_profile(context, index: int, stream_handle: int) -> None:
    """set_optimization_profile_async: older bindings return False, newer ones raise."""
    try:
        ok = context.set_optimization_profile_async(index, stream_handle)
    except RuntimeError as error:
        raise RuntimeError(f"TensorRT refused optimization profile {index}: {error}") from error
    if not ok:
        raise RuntimeError(f"TensorRT refused optimization profile {index}")


def bind_tensor(context, name: str, tensor: torch.Tensor, profile: Profile, is_input: bool):
    """Sets an input's shape and any tensor's address, failing with the tensor's name and
    shape where TensorRT returns False (a shape outside the profile, a bad address)."""
    shape = tuple(tensor.shape)
    if not tensor.is_contiguous():
        raise ValueError(f"tensor {name} {shape} is not contiguous")
    if is_input and not context.set_input_shape(name, shape):
        raise RuntimeError(f"TensorRT refused input {name} of shape {shape} in profile {profile}")
    if not context.set_tensor_address(name, tensor.data_ptr()):
        raise RuntimeError(f"TensorRT refused the address of {name} (shape {shape})")


class TrtEngine(GraphEngine):
    """A TensorRT plan on the GPU; the KV cache in device memory, in the plan's dtype."""

    def __init__(
        self,
        plan_dir: str | Path,
        num_slots: int,
        max_length: int,
        device: str = "cuda",
        environment: dict[str, str] | None = None,
    ) -> None:
        import tensorrt as trt

        from specdec.engines.onnx_engine import manifest_config

        plan_dir = Path(plan_dir)
        manifest, config, head = manifest_config(plan_dir)
        problem = plan_problem(manifest, environment or current_environment())
        if problem:
            raise RuntimeError(
                f"TensorRT plan {plan_dir} cannot run here: {problem}; rebuild it with "
                "`python -m build.build_trt`, or delete it and the server rebuilds it"
            )
        self.profiles = [Profile.from_dict(p) for p in manifest["profiles"]]
        self.stream = torch.cuda.Stream(device=device)  # not the default stream
        with torch.cuda.stream(self.stream):  # the cache and the activations ordered on it
            dtype = DTYPES[manifest["dtype"]]
            super().__init__(config, num_slots, max_length, head, device, cache_dtype=dtype)
            self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self.plan = deserialize_plan(self.runtime, plan_dir / PLAN_FILE)
            check_plan_profiles(self.plan, self.profiles, config)
            self.activations, self.contexts = create_contexts(
                trt, self.plan, len(self.profiles), self.stream.cuda_stream, self._allocate
            )
        self.output_names = ["logits", *(n.replace("past_", "new_") for n in self.names[4:])]
        self.output_dtypes = {
            name: _torch_dtype(self.plan.get_tensor_dtype(name))
            for name in (self.plan.get_tensor_name(i) for i in range(self.plan.num_io_tensors))
        }

    def _allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        num_slots: int,
        max_length: int,
        engine_dir: str | Path | None = None,
        dtype: str | None = None,
    ) -> TrtEngine:
        """Builds the plan into engine_dir (default .run/engines/...) unless it serves these.
        dtype: float16 or bfloat16; default the existing plan's, else float16."""
        path = Path(path)
        if engine_dir is None:
            engine_dir = default_plan_dir(path, default_engines_root(), dtype or "float16")
        if dtype is None:
            try:
                dtype = json.loads((Path(engine_dir) / MANIFEST).read_text())["dtype"]
            except (OSError, ValueError, KeyError):
                dtype = "float16"
        plan_dir = ensure_plan(path, Path(engine_dir), num_slots, max_length, dtype)
        return cls(plan_dir, num_slots, max_length)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        with torch.cuda.stream(self.stream):  # gathers, the plan, appends and the logits copy
            return super().forward(*args, **kwargs)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        with torch.cuda.stream(self.stream):
            super().copy_slot(src, dst, length)

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        batch, new_tokens = feeds["input_ids"].shape
        past_length = feeds["past_key.0"].shape[2]
        num_logits = feeds["logit_positions"].shape[1]
        index = select_profile(self.profiles, batch, new_tokens, past_length, num_logits)
        context, profile = self.contexts[index], self.profiles[index]
        for name, tensor in feeds.items():
            bind_tensor(context, name, tensor, profile, is_input=True)
        outputs = []
        for name in self.output_names:
            shape = tuple(context.get_tensor_shape(name))
            if any(size < 0 for size in shape):
                raise RuntimeError(f"TensorRT could not infer the shape of {name}: {shape}")
            out = torch.empty(shape, dtype=self.output_dtypes[name], device=self.device)
            bind_tensor(context, name, out, profile, is_input=False)
            outputs.append(out)
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT execution failed (profile {profile.name})")
        return outputs


def _torch_dtype(trt_dtype) -> torch.dtype:
    import tensorrt as trt

    return {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.bool: torch.bool,
    }[trt_dtype]
