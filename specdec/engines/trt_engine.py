"""The `tensorrt` engine: a TensorRT plan (specdec/engines/trt_plan.py) run over a slot KV cache.

The engine runs the plan on a CUDA stream of its own (TensorRT's enqueueV3 pays extra
device synchronisations on the default stream), with every torch tensor of a call ordered on
that stream. It keeps one execution context per profile, so a call never switches profiles;
the contexts run one after another, so they share one user-managed activation block sized
for the largest profile. The KV cache lives in device memory (torch CUDA tensors); inputs
and outputs are bound by address, and `forward` returns the logits in the CUDA tensor the
plan wrote them to (no host copy: the caller reduces them on the GPU). Work on the caller's
stream is ordered around the engine's: the engine's stream waits for the caller's before a
call (inputs the caller made on the GPU), the caller's waits for the engine's after it
(the logits), and the logits' memory is marked as used on the caller's stream, so the
allocator does not hand it out again while the caller still reads it. A plan built by
another TensorRT or GPU, or whose profiles are not its manifest's, is refused with the
reason.

The helpers (deserializing, the profile check, context set-up and binding, with TensorRT's
return values checked) take TensorRT's objects as arguments, so tests/test_tensorrt.py runs
them and the engine on the CPU with scripted fakes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.engines.onnx_engine import GraphEngine, default_engines_root
from specdec.engines.onnx_export import DTYPES, MANIFEST
from specdec.engines.trt_plan import (
    PLAN_FILE,
    Profile,
    current_environment,
    default_plan_dir,
    ensure_plan,
    plan_problem,
    select_profile,
)


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

    def forward(
        self,
        input_ids: torch.Tensor,
        input_lengths: list[int],
        slot_ids: list[int],
        cache_lengths: list[int],
        num_logits: list[int],
    ) -> torch.Tensor:
        """GraphEngine.forward on the engine's stream; (sum(num_logits), V) float32 logits on
        the GPU, ready on the caller's stream."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):  # gathers, the plan, appends, the logits picked
            logits = super().forward(input_ids, input_lengths, slot_ids, cache_lengths, num_logits)
        caller.wait_stream(self.stream)
        if logits.is_cuda:  # (the tests' scripted TensorRT runs on the CPU)
            logits.record_stream(caller)
        return logits

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
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
