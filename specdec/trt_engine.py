"""TensorRT plans of the exported decoder graph, and the `tensorrt` engine that runs them.

A plan is compiled from the ONNX that specdec/onnx_export.py writes, in float16 or bfloat16
(the graph exported in that dtype, built strongly typed: RMSNorm and softmax stay float32 as
the graph says). Two optimization profiles cover what GraphEngine sends:
- `decode`: B 1..num_slots rows of T 1..16 new tokens (decode, verify k + 1 <= 9);
- `prefill`: one row of T 17..max_context tokens (GraphEngine runs long rows alone);
past length P from 1 (a masked position) to what the context leaves, L 1..16 logits.
`optimization_profiles` and `select_profile` are pure (tested on the CPU); building and
running need TensorRT and a GPU. The KV cache lives in device memory (torch CUDA tensors);
inputs and outputs are bound by address, no host copies but the logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.onnx_engine import MAX_BATCHED_QUERY, GraphEngine, default_engines_root
from specdec.onnx_export import DTYPES, MANIFEST, input_names

PLAN_FILE = "model.plan"
MAX_LOGITS = 16  # positions per row that need logits (k + 1 <= 9 with k <= 8)

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


@dataclass(frozen=True)
class Profile:
    name: str
    batch: AxisRange
    new_tokens: AxisRange
    past_length: AxisRange
    num_logits: AxisRange

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
        pairs = zip(
            (self.batch, self.new_tokens, self.past_length, self.num_logits),
            (batch, new_tokens, past_length, num_logits),
            strict=True,
        )
        return all(axis.min <= value <= axis.max for axis, value in pairs)


def optimization_profiles(num_slots: int, max_context: int) -> list[Profile]:
    """The profiles a plan needs to serve num_slots sequences of max_context positions."""
    if num_slots < 1 or max_context < 2:
        raise ValueError("need num_slots >= 1 and max_context >= 2")
    short = min(MAX_BATCHED_QUERY, max_context)  # rows of up to this many tokens share calls
    logits = AxisRange(1, 1, min(MAX_LOGITS, short))
    decode_past = AxisRange(1, max(1, min(max_context // 4, max_context - short)), max_context - 1)
    profiles = [
        Profile(
            name="decode",
            batch=AxisRange(1, min(num_slots, 8), num_slots),
            new_tokens=AxisRange(1, 1, short),
            past_length=decode_past,
            num_logits=logits,
        )
    ]
    if max_context > short:  # longer rows (prefill) run alone
        profiles.append(
            Profile(
                name="prefill",
                batch=AxisRange(1, 1, 1),
                new_tokens=AxisRange(short + 1, min(max(short + 1, 256), max_context), max_context),
                past_length=AxisRange(1, 1, max(1, max_context - short - 1)),
                num_logits=logits,
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


def plan_manifest(onnx_manifest: dict, num_slots: int, max_context: int) -> dict:
    """engine.json of a plan folder: the graph's manifest plus the limits it was built for."""
    return {
        **onnx_manifest,
        "graph": PLAN_FILE,
        "num_slots": num_slots,
        "max_context": max_context,
        "profiles": [p.name for p in optimization_profiles(num_slots, max_context)],
    }


def plan_covers(plan_dir: Path, checkpoint: Path, num_slots: int, max_context: int, dtype: str):
    """Whether plan_dir holds a plan of this checkpoint for at least these limits."""
    from specdec.onnx_export import checkpoint_fingerprint

    try:
        manifest = json.loads((plan_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        (plan_dir / PLAN_FILE).exists()
        and manifest.get("dtype") == dtype
        and manifest.get("fingerprint") == checkpoint_fingerprint(checkpoint)
        and manifest.get("num_slots", 0) >= num_slots
        and manifest.get("max_context", 0) >= max_context
    )


def build_plan(
    onnx_dir: Path, plan_dir: Path, num_slots: int, max_context: int, workspace_gib: float = 8.0
) -> Path:
    """Compiles onnx_dir/model.onnx into plan_dir/model.plan with the TensorRT Python API."""
    import tensorrt as trt

    onnx_manifest = json.loads((onnx_dir / MANIFEST).read_text())
    config = onnx_manifest["config"]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_dir / onnx_manifest["graph"])):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError("TensorRT could not parse the graph: " + "; ".join(errors))
    build_config = builder.create_builder_config()
    build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    for profile in optimization_profiles(num_slots, max_context):
        trt_profile = builder.create_optimization_profile()
        shapes = profile.shapes(config["num_layers"], config["num_kv_heads"], config["head_dim"])
        for name, (low, opt, high) in shapes.items():
            trt_profile.set_shape(name, low, opt, high)
        build_config.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, build_config)
    if serialized is None:
        raise RuntimeError("TensorRT build failed (see the log above)")
    plan_dir.mkdir(parents=True, exist_ok=True)
    (plan_dir / PLAN_FILE).write_bytes(bytes(serialized))
    manifest = plan_manifest(onnx_manifest, num_slots, max_context)
    (plan_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return plan_dir


def ensure_plan(
    checkpoint: Path, plan_dir: Path, num_slots: int, max_context: int, dtype: str = "float16"
) -> Path:
    """Exports the graph in `dtype` (into plan_dir/onnx) and builds the plan, unless plan_dir
    already covers these limits; one builder at a time per folder (a file lock)."""
    import fcntl

    from specdec.onnx_export import ensure_exported

    plan_dir.mkdir(parents=True, exist_ok=True)
    with open(plan_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not plan_covers(plan_dir, checkpoint, num_slots, max_context, dtype):
            onnx_dir = ensure_exported(checkpoint, plan_dir / "onnx", dtype)
            build_plan(onnx_dir, plan_dir, num_slots, max_context)
    return plan_dir


def default_plan_dir(checkpoint: Path, root: Path, dtype: str = "float16") -> Path:
    return root / checkpoint.resolve().name / f"tensorrt-{dtype}"


class TrtEngine(GraphEngine):
    """A TensorRT plan on the GPU; the KV cache in device memory, in the plan's dtype."""

    def __init__(self, plan_dir: str | Path, num_slots: int, max_length: int) -> None:
        import tensorrt as trt

        from specdec.onnx_engine import manifest_config

        plan_dir = Path(plan_dir)
        manifest, config, head = manifest_config(plan_dir)
        dtype = DTYPES[manifest["dtype"]]
        super().__init__(config, num_slots, max_length, head, "cuda", cache_dtype=dtype)
        self.profiles = optimization_profiles(manifest["num_slots"], manifest["max_context"])
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.plan = self.runtime.deserialize_cuda_engine((plan_dir / PLAN_FILE).read_bytes())
        self.stream = torch.cuda.current_stream(self.device)
        self.contexts = []  # one execution context per profile: no switching per call
        for index in range(len(self.profiles)):
            context = self.plan.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        self.output_dtypes = {
            name: _torch_dtype(self.plan.get_tensor_dtype(name))
            for name in (self.plan.get_tensor_name(i) for i in range(self.plan.num_io_tensors))
        }

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        num_slots: int,
        max_length: int,
        engine_dir: str | Path | None = None,
        dtype: str | None = None,
    ) -> TrtEngine:
        """Builds the plan into engine_dir (default .run/engines/...) unless it covers these.
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

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        batch, new_tokens = feeds["input_ids"].shape
        past_length = feeds["past_key.0"].shape[2]
        num_logits = feeds["logit_positions"].shape[1]
        index = select_profile(self.profiles, batch, new_tokens, past_length, num_logits)
        context = self.contexts[index]
        for name, tensor in feeds.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in ["logits", *(n.replace("past_", "new_") for n in self.names[4:])]:
            shape = tuple(context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=self.output_dtypes[name], device=self.device)
            context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
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
