"""A near-zero Llama checkpoint: the target's vocabulary and tokenizer, random weights.

    .venv/bin/python -m build.tiny_checkpoint --out .run/tiny-llama

One layer of width 64 (2 query heads x 32, 1 KV head, MLP 128), the target's 49,152-token
vocabulary, its tokenizer files copied from `--tokenizer-from` (models/smollm2-135m-instruct,
which `make models` prepares). Served as both target and draft (`make bench-overhead`), it
takes the model's cost out of an iteration: what remains is the loop's host work, with the
same vocabulary-sized logits, probability rows and detokenizing as the real pair. Same seed,
same weights: the draft's greedy proposals are always accepted.

The head is its own matrix: tied to the embedding, a random layer's output stays close to
its input token's embedding, and greedy decoding repeats the last prompt token forever (any
draft would then agree). Untied, the next token is a random function of the context, and a
draft of another seed is rejected. The end token's head row is zero, so its logit is exactly
0 while the other 49,151 are spread around 0: greedy never ends a request early, and
sampling rarely does (about 1 token in 49,152), so requests run to max_tokens as the bench
assumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from build.checkpoint import TOKENIZER_FILES
from specdec.paths import PROJECT_ROOT

DEFAULT_TOKENIZER = PROJECT_ROOT / "models" / "smollm2-135m-instruct"


@dataclass(frozen=True)
class TinyConfig:
    out: Path
    tokenizer_from: Path = DEFAULT_TOKENIZER
    vocab_size: int = 49152
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 1
    num_layers: int = 1
    seed: int = 0
    init_std: float = 0.02  # HF's initializer_range: logits of std ~0.16, near-uniform rows


def hf_config(config: TinyConfig, end_id: int) -> dict:
    """config.json: a LlamaForCausalLM that transformers and specdec's engines both load."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.hidden_size // config.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": end_id,
        "pad_token_id": end_id,
        "torch_dtype": "float32",
    }


def random_weights(config: TinyConfig, end_id: int) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names, float32, from `config.seed`."""
    generator = torch.Generator().manual_seed(config.seed)
    h, m = config.hidden_size, config.intermediate_size
    head_dim = h // config.num_heads
    q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * config.init_std

    head = normal(config.vocab_size, h)  # (V, H)
    head[end_id] = 0.0  # its logit is 0: never the argmax (module docstring)
    weights = {
        "model.embed_tokens.weight": normal(config.vocab_size, h),
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(h),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(m, h),
            p + "mlp.up_proj.weight": normal(m, h),
            p + "mlp.down_proj.weight": normal(h, m),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    return weights


def shaped_like(config: TinyConfig, checkpoint: Path) -> TinyConfig:
    """`config` with the layer count and sizes of `checkpoint`'s config.json."""
    source = json.loads((checkpoint / "config.json").read_text())
    return dataclasses.replace(
        config,
        vocab_size=source["vocab_size"],
        hidden_size=source["hidden_size"],
        intermediate_size=source["intermediate_size"],
        num_heads=source["num_attention_heads"],
        num_kv_heads=source.get("num_key_value_heads", source["num_attention_heads"]),
        num_layers=source["num_hidden_layers"],
    )


def end_token_id(tokenizer_dir: Path) -> int:
    """The id the server ends requests on: the tokenizer's eos (the target's config says it)."""
    return int(json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"])


def run(config: TinyConfig) -> Path:
    """Writes the checkpoint directory `config.out` (overwriting its files); returns it."""
    from safetensors.torch import save_file

    source = config.tokenizer_from
    if not (source / "tokenizer.json").exists():
        raise FileNotFoundError(f"{source}/tokenizer.json: run `make models` first")
    end_id = end_token_id(source)
    config.out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, end_id)
    save_file(weights, str(config.out / "model.safetensors"), metadata={"format": "pt"})
    (config.out / "config.json").write_text(json.dumps(hf_config(config, end_id), indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            (config.out / name).write_bytes((source / name).read_bytes())
    return config.out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument("--tokenizer-from", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape-of",
        type=Path,
        help="random weights in this checkpoint's shape instead (its config.json: layers, "
        "width, heads, MLP, vocabulary), e.g. to time the real target's shape on a GPU "
        "without carrying its weights",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    config = TinyConfig(out=args.out, tokenizer_from=args.tokenizer_from, seed=args.seed)
    if args.shape_of:
        config = shaped_like(config, args.shape_of)
    out = run(config)
    print(f"tiny checkpoint: {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
