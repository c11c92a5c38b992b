"""The engine a draft_model / target_model instance runs, chosen by its `engine` parameter.

- `torch`: specdec/engines/llama.py on `device` ("cpu" or "cuda"): the reference, and the GPU
  fallback where TensorRT is not installed; on CUDA, `cuda_graphs` replays its calls from
  CUDA graphs (specdec/engines/graphs.py): on by default there (resolve_cuda_graphs).
- `onnxruntime`: the exported graph (specdec/engines/onnx_engine.py); exported from the checkpoint
  into `engine_dir` (default .run/engines/<checkpoint name>/onnx-float32) when missing or stale.
- `tensorrt`: a TensorRT plan of that graph (specdec/engines/trt_engine.py), GPU only; built
  (specdec/engines/trt_plan.py) into `engine_dir` (default
  .run/engines/<checkpoint name>/tensorrt-<dtype>) when missing or stale.

Precision, the `dtype` parameter (DTYPE of make serve): float32, bfloat16, float16 or auto.
`auto` picks bfloat16 on a CPU with bfloat16 instructions (avx512_bf16 or amx_bf16) and
float32 on any other CPU; on CUDA bfloat16 where the GPU has it, else float16. The torch
engine computes in any of them (float16 on CUDA only), onnxruntime in float32 only, and
tensorrt in float16 or bfloat16 only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.engines.engine import Engine

ENGINES = ("torch", "onnxruntime", "tensorrt")
DTYPES = ("float32", "bfloat16", "float16", "auto")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the CPU computes bfloat16 natively


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: no flags, so auto stays float32
        return ""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags a /proc/cpuinfo text lists on its `flags` lines."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, values = line.partition(":")
        if name.strip() == "flags":
            flags.update(values.split())
    return flags


def cpu_has_bf16(flags: set[str]) -> bool:
    """Whether a CPU's flags (cpu_flags) include one of CPU_BF16_FLAGS."""
    return bool(flags & set(CPU_BF16_FLAGS))


def cuda_has_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def check_dtype(requested: str) -> None:
    if requested not in DTYPES:
        raise ValueError(f"DTYPE {requested!r}: expected one of {', '.join(DTYPES)}")


def resolve_dtype(
    requested: str,
    device: str,
    cpuinfo: Callable[[], str] = read_cpuinfo,
    cuda_bf16: Callable[[], bool] = cuda_has_bf16,
) -> str:
    """The dtype a `device` ("cpu", "cuda", "cuda:1") computes in for DTYPE `requested`."""
    check_dtype(requested)
    on_cuda = device.split(":")[0] == "cuda"
    if requested == "auto" and on_cuda:
        return "bfloat16" if cuda_bf16() else "float16"
    if requested == "auto":
        # Without bfloat16 instructions the CPU converts every weight it reads: float32 wins.
        return "bfloat16" if cpu_has_bf16(cpu_flags(cpuinfo())) else "float32"
    if requested == "float16" and not on_cuda:
        raise RuntimeError(
            "DTYPE=float16 runs on CUDA only (ENGINE=torch DEVICE=cuda); "
            "on the CPU use DTYPE=bfloat16 or float32"
        )
    return requested


def engine_dtype(
    kind: str,
    requested: str,
    device: str = "cpu",
    cpuinfo: Callable[[], str] = read_cpuinfo,
    cuda_bf16: Callable[[], bool] = cuda_has_bf16,
) -> str:
    """The dtype engine `kind` computes in for DTYPE `requested`; refuses what it cannot."""
    check_dtype(requested)
    if kind == "onnxruntime":
        if requested not in ("float32", "auto"):
            raise RuntimeError(
                f"engine onnxruntime computes in float32 on the CPU; DTYPE={requested} "
                "needs ENGINE=torch"
            )
        return "float32"
    if kind == "tensorrt":
        if requested == "float32":
            raise RuntimeError(
                "engine tensorrt computes in float16 or bfloat16; DTYPE=float32 needs "
                "ENGINE=torch (or onnxruntime)"
            )
        return resolve_dtype(requested, "cuda", cpuinfo, cuda_bf16)  # plans run on the GPU
    return resolve_dtype(requested, device, cpuinfo, cuda_bf16)


def resolve_cuda_graphs(requested: bool | None, kind: str, device: str) -> bool:
    """Whether engine `kind` on `device` replays CUDA graphs for CUDA_GRAPHS `requested`
    (None: auto, on where the torch engine runs on CUDA; True elsewhere is refused by
    create_engine and LlamaEngine)."""
    if requested is None:
        return kind == "torch" and device.split(":")[0] == "cuda"
    return requested


def create_engine(
    kind: str,
    checkpoint: str | Path,
    num_slots: int,
    max_length: int,
    device: str = "cpu",
    engine_dir: str | Path | None = None,
    dtype: str = "float32",
    cuda_graphs: bool | None = False,
) -> Engine:
    """The engine `kind` (ENGINES) over `checkpoint`: LlamaEngine, OnnxEngine or TrtEngine.
    dtype: DTYPES; the one chosen is written to stderr (the server's log), so a user sees
    what `auto` picked. cuda_graphs: the torch engine on CUDA only (LlamaEngine); None:
    auto (resolve_cuda_graphs)."""
    if kind not in ENGINES:
        raise ValueError(f"engine {kind!r}: expected one of {', '.join(ENGINES)}")
    check_dtype(dtype)
    cuda_graphs = resolve_cuda_graphs(cuda_graphs, kind, device)
    if cuda_graphs and kind != "torch":
        raise ValueError(f"cuda_graphs applies to the torch engine on CUDA, not to {kind}")
    if kind == "tensorrt":
        require_tensorrt()  # first: without a GPU the dtype is not the problem
    chosen = engine_dtype(kind, dtype, device)
    print(
        f"specdec: {kind} engine, {Path(checkpoint).name}: computes in {chosen} (DTYPE={dtype})",
        file=sys.stderr,
        flush=True,
    )
    if kind == "torch":
        import torch

        from specdec.engines.llama import LlamaEngine

        return LlamaEngine.from_checkpoint(
            checkpoint, num_slots, max_length, device, getattr(torch, chosen), cuda_graphs
        )
    if kind == "onnxruntime":
        from specdec.engines.onnx_engine import OnnxEngine

        return OnnxEngine.from_checkpoint(checkpoint, num_slots, max_length, engine_dir)
    from specdec.engines.trt_engine import TrtEngine

    return TrtEngine.from_checkpoint(checkpoint, num_slots, max_length, engine_dir, dtype=chosen)


def require_tensorrt() -> None:
    """Fails clearly where the tensorrt engine cannot run (the fallback is torch on CUDA)."""
    import importlib.util

    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT's Python package (pip install tensorrt)")
    if missing:
        raise RuntimeError(
            f"engine tensorrt needs {' and '.join(missing)}; "
            "ENGINE=torch DEVICE=cuda runs on a GPU without TensorRT"
        )
