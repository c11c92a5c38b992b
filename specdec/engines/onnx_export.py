"""ONNX export of a Llama-family decoder with a KV-cache interface the graph engines drive.

The graph takes the new tokens of B rows padded to T, each row's past keys and values
padded to P, and returns the logits of the positions asked for and the new tokens' keys and
values (the caller appends them to its own cache: the graph never copies the past back):

    input_ids        (B, T)              int64
    position_ids     (B, T)              int64   position of each new token
    attention_mask   (B, P + T)          int64   1 = a real key (past or new), 0 = padding
    logit_positions  (B, L)              int64   indices into T whose logits are returned
    past_key.{i}     (B, kv_heads, P, head_dim)  (and past_value.{i}), i < num_layers
 -> logits           (B, L, head size)   float32 (head size = V, or a draft's reduced head)
    new_key.{i}      (B, kv_heads, T, head_dim)  (and new_value.{i}), after RoPE

B, T, P and L are dynamic axes. New tokens attend causally among themselves and to every
past key the mask allows. The module reuses specdec/engines/llama.py's pieces, so in float32
the graph is the torch engine's arithmetic. In float16 or bfloat16 (TensorRT's plans) it
differs: the residual stream and the head compute in that dtype like the matrices, and no
top logits are recomputed in float32; RMSNorm and the attention's scores and softmax run in
float32.
A draft's `draft.head_token_ids` goes to engine.json beside the graph (the engine spreads
the head's logits over the vocabulary, -inf elsewhere).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shutil
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specdec.engines.llama import (
    HEAD_TOKEN_IDS,
    LlamaConfig,
    load_hf_checkpoint,
    rms_norm,
    rope_inv_freq,
    rotate_half,
)

FORMAT_VERSION = 2  # bump when the graph's interface or arithmetic changes: caches re-export
MANIFEST = "engine.json"
GRAPH_FILE = "model.onnx"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def input_names(num_layers: int) -> list[str]:
    past = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "position_ids", "attention_mask", "logit_positions", *past]


def output_names(num_layers: int) -> list[str]:
    new = [f"new_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    return ["logits", *new]


def dynamic_axes(num_layers: int) -> dict[str, dict[int, str]]:
    axes = {
        "input_ids": {0: "batch", 1: "new_tokens"},
        "position_ids": {0: "batch", 1: "new_tokens"},
        "attention_mask": {0: "batch", 1: "total_length"},
        "logit_positions": {0: "batch", 1: "num_logits"},
        "logits": {0: "batch", 1: "num_logits"},
    }
    for i in range(num_layers):
        for kind in ("key", "value"):
            axes[f"past_{kind}.{i}"] = {0: "batch", 2: "past_length"}
            axes[f"new_{kind}.{i}"] = {0: "batch", 2: "new_tokens"}
    return axes


class DecoderGraph(nn.Module):
    """The decoder as one traceable function of padded rows (see the module docstring)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        w = {k: v.to(dtype) for k, v in weights.items() if v.is_floating_point()}
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = nn.Parameter(head, requires_grad=False)
        self.final_norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            _Layer(w, f"model.layers.{i}.") for i in range(config.num_layers)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, input_ids, position_ids, attention_mask, logit_positions, *past):
        c = self.config
        batch, new_tokens = input_ids.shape
        freqs = position_ids.float()[..., None] * self.inv_freq  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        allowed = _allowed_keys(attention_mask, new_tokens)  # (B, 1, 1, T, P + T)
        x = F.embedding(input_ids, self.embed)  # (B, T, H)
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(cast(Iterable[_Layer], self.layers)):  # ModuleList is untyped
            h = _norm(x, layer.attn_norm, c.rms_norm_eps)
            q, k, v = _project_qkv(layer, h, c)  # (B, nh | kvh, T, hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            # static kv_heads and head_dim in the graph's output shapes (rotate_half hides them)
            k = k.reshape(batch, c.num_kv_heads, new_tokens, c.head_dim)
            new_kv.extend((k, v))
            keys = torch.cat((past[2 * i], k), dim=2)  # (B, kvh, P + T, hd)
            values = torch.cat((past[2 * i + 1], v), dim=2)
            attn = _attention(q, keys, values, allowed, c)  # (B, T, nh * hd)
            x = x + F.linear(attn, layer.o)
            h = _norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        index = logit_positions[..., None].expand(batch, logit_positions.shape[1], c.hidden_size)
        h = _norm(torch.gather(x, 1, index), self.final_norm, c.rms_norm_eps)  # (B, L, H)
        logits = F.linear(h, self.lm_head).float()  # (B, L, head size)
        return (logits, *new_kv)


class _Layer(nn.Module):
    """Decoder layer `p`'s weights, frozen: q, k, v as one matrix, gate and up as one."""

    def __init__(self, w: dict[str, torch.Tensor], p: str) -> None:
        super().__init__()

        def frozen(*names: str) -> nn.Parameter:
            tensors = [w[p + name] for name in names]
            joined = torch.cat(tensors, 0) if len(tensors) > 1 else tensors[0]
            return nn.Parameter(joined, requires_grad=False)

        self.qkv = frozen(*(f"self_attn.{n}_proj.weight" for n in "qkv"))
        self.o = frozen("self_attn.o_proj.weight")
        self.gate_up = frozen("mlp.gate_proj.weight", "mlp.up_proj.weight")
        self.down = frozen("mlp.down_proj.weight")
        self.attn_norm = frozen("input_layernorm.weight")
        self.mlp_norm = frozen("post_attention_layernorm.weight")
        self.qkv_bias: nn.Parameter | None = None
        if p + "self_attn.q_proj.bias" in w:  # Qwen2
            self.qkv_bias = frozen(*(f"self_attn.{n}_proj.bias" for n in "qkv"))


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 whatever the graph's dtype (fp16 squares overflow)."""
    return rms_norm(x.float(), weight.float(), eps).to(x.dtype)


def _project_qkv(layer: _Layer, h: torch.Tensor, c: LlamaConfig):
    batch, new_tokens, _ = h.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # (B, T, q + 2 kv)
    q = qkv[..., :q_size].reshape(batch, new_tokens, c.num_heads, c.head_dim)
    k = qkv[..., q_size : q_size + kv_size].reshape(batch, new_tokens, c.num_kv_heads, c.head_dim)
    v = qkv[..., q_size + kv_size :].reshape(batch, new_tokens, c.num_kv_heads, c.head_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _allowed_keys(attention_mask: torch.Tensor, new_tokens) -> torch.Tensor:
    """(B, 1, 1, T, P + T) bool: real keys at or before each new token's place."""
    total = attention_mask.shape[1]
    past = total - new_tokens
    key_index = torch.arange(total, device=attention_mask.device)  # (P + T,)
    query_index = torch.arange(new_tokens, device=attention_mask.device) + past  # (T,)
    causal = key_index[None, :] <= query_index[:, None]  # (T, P + T)
    return (causal[None] & (attention_mask[:, None, :] != 0))[:, None, None]


def _attention(q, keys, values, allowed, c: LlamaConfig) -> torch.Tensor:
    """Grouped-query attention without repeating keys: a kv head's query heads share it."""
    batch, _, new_tokens, _ = q.shape
    group = c.num_heads // c.num_kv_heads
    queries = q.reshape(batch, c.num_kv_heads, group, new_tokens, c.head_dim)
    scores = torch.matmul(queries.float(), keys[:, :, None].transpose(-1, -2).float())
    scores = scores * (c.head_dim**-0.5)  # (B, kvh, group, T, P + T)
    scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(weights, values[:, :, None])  # (B, kvh, group, T, hd)
    out = out.reshape(batch, c.num_heads, new_tokens, c.head_dim).transpose(1, 2)
    return out.reshape(batch, new_tokens, c.num_heads * c.head_dim)


def example_inputs(config: LlamaConfig, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """Small inputs with distinct sizes (B 2, T 3, P 5, L 2), so no axis is specialised."""
    batch, new_tokens, past_length = 2, 3, 5
    shape = (batch, config.num_kv_heads, past_length, config.head_dim)
    past = [torch.randn(shape, dtype=dtype) for _ in range(2 * config.num_layers)]
    return (
        torch.randint(0, config.vocab_size, (batch, new_tokens)),
        torch.arange(past_length, past_length + new_tokens).repeat(batch, 1),
        torch.ones(batch, past_length + new_tokens, dtype=torch.int64),
        torch.tensor([[1, 2], [0, 2]]),
        *past,
    )


def checkpoint_fingerprint(checkpoint: Path) -> dict:
    """What identifies a checkpoint's weights cheaply: config and weight files' sizes, times."""
    files = sorted(checkpoint.glob("*.safetensors")) + [checkpoint / "config.json"]
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def export_onnx(checkpoint: Path, out_dir: Path, dtype: str = "float32", opset: int = 18) -> Path:
    """Writes out_dir/model.onnx (+ external weights) and out_dir/engine.json; returns out_dir."""
    config, weights = load_hf_checkpoint(checkpoint, DTYPES[dtype])  # one copy in memory
    graph = DecoderGraph(config, weights, DTYPES[dtype]).eval()
    work = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start = time.time()
    # The TorchScript exporter (dynamo=False): no onnxscript to install, named dynamic axes.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            graph,
            example_inputs(config, DTYPES[dtype]),
            str(work / GRAPH_FILE),
            input_names=input_names(config.num_layers),
            output_names=output_names(config.num_layers),
            dynamic_axes=dynamic_axes(config.num_layers),
            opset_version=opset,
            dynamo=False,
        )
    _write_manifest(work, checkpoint, config, weights, dtype, time.time() - start)
    shutil.rmtree(out_dir, ignore_errors=True)
    work.rename(out_dir)
    return out_dir


def _write_manifest(work, checkpoint, config, weights, dtype, seconds) -> None:
    head = weights.get(HEAD_TOKEN_IDS)
    if head is not None:
        np.save(work / "head_token_ids.npy", head.long().numpy())
    manifest = {
        "format_version": FORMAT_VERSION,
        "checkpoint": str(checkpoint.resolve()),
        "fingerprint": checkpoint_fingerprint(checkpoint),
        "dtype": dtype,
        "graph": GRAPH_FILE,
        "head_token_ids": "head_token_ids.npy" if head is not None else None,
        "config": dataclasses.asdict(config),
        "export_seconds": round(seconds, 1),
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(engine_dir: Path) -> dict:
    return json.loads((engine_dir / MANIFEST).read_text())


def is_current(engine_dir: Path, checkpoint: Path, dtype: str = "float32") -> bool:
    """Whether engine_dir holds an export of this checkpoint's present weights."""
    try:
        manifest = read_manifest(engine_dir)
    except (OSError, ValueError):
        return False
    return (
        manifest.get("format_version") == FORMAT_VERSION
        and manifest.get("dtype") == dtype
        and manifest.get("fingerprint") == checkpoint_fingerprint(checkpoint)
        and (engine_dir / manifest["graph"]).exists()
    )


def default_engine_dir(checkpoint: Path, root: Path, dtype: str = "float32") -> Path:
    """root/<checkpoint folder name>/onnx-<dtype>: .run/engines/smollm2-135m-draft/onnx-float32."""
    return root / checkpoint.resolve().name / f"onnx-{dtype}"


def ensure_exported(checkpoint: Path, engine_dir: Path, dtype: str = "float32") -> Path:
    """Exports unless engine_dir is current; one exporter at a time per folder (a file lock)."""
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(engine_dir.with_name(engine_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(engine_dir, checkpoint, dtype):
            export_onnx(checkpoint, engine_dir, dtype)
    return engine_dir
