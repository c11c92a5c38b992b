"""TensorRT plans of the exported decoder graph: their optimization profiles, their folders,
building them, and the rules that say whether a plan can run here.

A plan is compiled from the ONNX that specdec/engines/onnx_export.py writes, in float16 or bfloat16
(the graph exported in that dtype, built strongly typed: RMSNorm and softmax stay float32 as
the graph says). Two optimization profiles cover what GraphEngine sends:
- `decode`: B 1..num_slots rows of T 1..16 new tokens (decode, and verify of k + 1 <= 16);
- `prefill`: one row of T 17..max_context tokens (GraphEngine runs long rows alone: prompts,
  a draft's catch-up, a verify of k + 1 > 16);
past length P from 1 (a masked position) to what the context leaves; L logits per row up to
MAX_LOGITS (a greedy draft row that catches up asks for HINDSIGHT_TOKENS + 1).

A plan folder holds model.plan, engine.json (the graph's manifest, the profiles, and the
TensorRT version, GPU and compute capability that built it: a plan runs only there) and
every other file the manifest names (a draft's head_token_ids.npy); the ONNX it came from
stays in onnx/. A plan that no longer fits is rebuilt (`ensure_plan`) or refused with the
reason (specdec/engines/trt_engine.py, which runs plans), never loaded.

TensorRT is imported only where a plan is built or the host is read, so the profiles,
manifests and compatibility rules run without it (tests/test_tensorrt.py, on the CPU).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from specdec.engines.engine import MAX_BATCHED_QUERY
from specdec.engines.onnx_export import MANIFEST, input_names, read_manifest
from specdec.engines.wire import HINDSIGHT_TOKENS

PLAN_FILE = "model.plan"
# Bump when a plan folder's layout or the meaning of its profiles changes: older plans are
# rebuilt. 2: profiles, TensorRT version and GPU in engine.json, head_token_ids.npy beside it.
PLAN_FORMAT_VERSION = 2
# Logits per row: a greedy draft row catching up asks for HINDSIGHT_TOKENS guesses + 1, the
# target k + 1 (so k <= MAX_LOGITS - 1 = 32 fits a plan).
MAX_LOGITS = HINDSIGHT_TOKENS + 1
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
