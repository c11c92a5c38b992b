"""Compiles the exported graph of checkpoints into TensorRT plans (GPU, TensorRT installed).

    python -m build.build_trt models/smollm2-135m-instruct models/smollm2-135m-draft \
        --num-slots 64 --max-context 2048 --dtype auto
    python -m build.build_trt CHECKPOINT --print-profiles   # the profiles only (no GPU)

Each checkpoint's graph is exported in --dtype (float16, bfloat16, or auto: bfloat16 where
the GPU has it, as the server's DTYPE=auto picks; specdec/engines/select.py) into <plan
folder>/onnx, then built strongly typed with optimization profiles for --num-slots sequences
of --max-context positions (specdec/engines/trt_plan.py: optimization_profiles). Plans go
to .run/engines/<checkpoint folder name>/tensorrt-<dtype>, where the tensorrt engine looks
for them (or --out, one checkpoint). A plan that already serves the limits on this TensorRT
and GPU is kept; any other is rebuilt, and the reason printed
(specdec/engines/trt_plan.py: plan_mismatch). """

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from build.export_onnx import hf_directory
from specdec.engines.select import DTYPES, engine_dtype
from specdec.engines.trt_plan import default_plan_dir, ensure_plan, optimization_profiles
from specdec.paths import PROJECT_ROOT
from specdec.serving.settings import DTYPE, MAX_CONTEXT, NUM_SLOTS


@dataclass
class TrtBuildConfig:
    checkpoints: list[Path]
    out: Path | None
    engines_root: Path
    dtype: str
    num_slots: int
    max_context: int
    print_profiles: bool


def profiles_table(config: TrtBuildConfig, num_layers: int, kv_heads: int, head_dim: int):
    """{profile name: {input: "min / opt / max"}} for the first input of each kind."""
    shown = ("input_ids", "attention_mask", "logit_positions", "past_key.0")
    return {
        profile.name: {
            name: " / ".join("x".join(map(str, shape)) for shape in shapes)
            for name, shapes in profile.shapes(num_layers, kv_heads, head_dim).items()
            if name in shown
        }
        for profile in optimization_profiles(config.num_slots, config.max_context)
    }


def run(config: TrtBuildConfig) -> list[Path]:
    if config.out is not None and len(config.checkpoints) != 1:
        raise ValueError("--out names the folder of one checkpoint")
    written = []
    for checkpoint in config.checkpoints:
        source = hf_directory(checkpoint, PROJECT_ROOT / ".run" / "checkpoints")
        if config.print_profiles:
            hf = json.loads((source / "config.json").read_text())
            from specdec.engines.llama import LlamaConfig

            c = LlamaConfig.from_hf(hf)
            table = profiles_table(config, c.num_layers, c.num_kv_heads, c.head_dim)
            print(json.dumps({str(checkpoint): table}, indent=1))
            continue
        plan_dir = config.out or default_plan_dir(source, config.engines_root, config.dtype)
        start = time.time()
        ensure_plan(source, plan_dir, config.num_slots, config.max_context, config.dtype)
        print(f"{checkpoint} -> {plan_dir} ({time.time() - start:.0f} s)", flush=True)
        written.append(plan_dir)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", type=Path, help="HF directories or .gguf")
    parser.add_argument("--out", type=Path, help="plan folder (one checkpoint only)")
    parser.add_argument("--engines-root", type=Path, default=PROJECT_ROOT / ".run" / "engines")
    # DTYPES: float32 too, so that it is refused with the reason (and the alternative)
    # The server's settings on a GPU host (specdec/serving/settings.py), so that by default
    # the plans serve what the server asks for.
    parser.add_argument("--dtype", choices=DTYPES, default=DTYPE.deployed_default)
    parser.add_argument("--num-slots", type=int, default=int(NUM_SLOTS.deployed_default))
    parser.add_argument("--max-context", type=int, default=int(MAX_CONTEXT.deployed_default))
    parser.add_argument("--print-profiles", action="store_true")
    args = parser.parse_args()
    run(
        TrtBuildConfig(
            checkpoints=args.checkpoints,
            out=args.out,
            engines_root=args.engines_root,
            dtype=engine_dtype("tensorrt", args.dtype),
            num_slots=args.num_slots,
            max_context=args.max_context,
            print_profiles=args.print_profiles,
        )
    )


if __name__ == "__main__":
    main()
