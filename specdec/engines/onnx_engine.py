"""Engines that run an exported decoder graph (specdec/engines/onnx_export.py) over a slot KV cache.

`GraphEngine` is an Engine (specdec/engines/engine.py), as `LlamaEngine` is, so
specdec/engines/calls.py drives any of them. It owns the cache (torch tensors, on the
CPU for onnxruntime, on the GPU for TensorRT), and per call:
1. groups the packed rows: short rows (decode, verify) share one padded call; long rows
   (prefill) run one by one, so a prompt does not pad every other row to its length;
2. pads a group's new tokens to T and gathers its slots' past keys and values padded to P
   (at least 1: a masked position, so no tensor is empty): a copy, the one cost of this
   design that in-place attention would not pay (`python -m build.graph_engine_bytes`
   counts it; docs/gpu.md);
3. runs the graph, appends the new keys and values to the slots, and returns the logits asked
   for where the graph wrote them (a view of its output when every row asks for as many; no
   copy to the host: TensorRT's logits stay on the GPU).
`OnnxEngine` runs the graph with onnxruntime (CUDA provider when present, else the CPU; its
logits come back in host memory either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.engines.engine import MAX_BATCHED_QUERY, SlotCache, check_rows, full_vocabulary
from specdec.engines.llama import LlamaConfig
from specdec.engines.onnx_export import DTYPES, input_names, read_manifest


@dataclass
class PaddedCall:
    """One graph call: `rows` of the engine call, padded (see onnx_export's interface)."""

    rows: list[int]
    input_ids: torch.Tensor  # (b, T) int64, 0 after a row's tokens
    position_ids: torch.Tensor  # (b, T) int64
    attention_mask: torch.Tensor  # (b, P + T) int64
    logit_positions: torch.Tensor  # (b, L) int64, indices into T, the last one repeated
    past_length: int  # P


def group_rows(
    input_lengths: list[int], max_batched_query: int = MAX_BATCHED_QUERY
) -> list[list[int]]:
    """Short rows in one group, each long row alone: [[rows...], ...]."""
    short = [r for r, n in enumerate(input_lengths) if n <= max_batched_query]
    groups = [[r] for r, n in enumerate(input_lengths) if n > max_batched_query]
    return ([short] if short else []) + groups


def pad_rows(rows, tokens, cache_lengths, num_logits) -> PaddedCall:
    """Pads the rows' new tokens (`tokens[r]`, a list of ids) into one PaddedCall."""
    width = max(len(tokens[r]) for r in rows)
    past_length = max(1, max(cache_lengths[r] for r in rows))
    num_logit_columns = max(num_logits[r] for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), past_length + width, dtype=torch.int64)
    logit_positions = torch.zeros(len(rows), num_logit_columns, dtype=torch.int64)
    for i, r in enumerate(rows):
        length, cached = len(tokens[r]), cache_lengths[r]
        input_ids[i, :length] = torch.as_tensor(tokens[r])
        mask[i, :cached] = 1
        mask[i, past_length : past_length + length] = 1
        wanted = torch.arange(length - num_logits[r], length)
        logit_positions[i] = wanted[-1]
        logit_positions[i, : num_logits[r]] = wanted
    cached = torch.tensor([cache_lengths[r] for r in rows])[:, None]
    return PaddedCall(
        rows=list(rows),
        input_ids=input_ids,
        position_ids=cached + torch.arange(width)[None, :],
        attention_mask=mask,
        logit_positions=logit_positions,
        past_length=past_length,
    )


class GraphEngine(SlotCache):
    """The slot cache and the padding around a graph; subclasses provide `_run`."""

    def __init__(
        self,
        config: LlamaConfig,
        num_slots: int,
        max_length: int,
        head_token_ids: torch.Tensor | None = None,
        device: str = "cpu",
        cache_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.num_slots = num_slots
        self.max_length = max_length
        self.device = torch.device(device)
        self.head_token_ids = None if head_token_ids is None else head_token_ids.to(self.device)
        # Zeroed: a gathered position the call masks (past a short row) is finite.
        super().__init__(config, num_slots, max_length, cache_dtype, self.device)
        self.names = input_names(config.num_layers)

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Runs the graph: [logits (b, L, head), new_key.0, new_value.0, ...]."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) new tokens of all rows, packed
        input_lengths: list[int],  # (B,) new tokens per row, sum N
        slot_ids: list[int],  # (B,)
        cache_lengths: list[int],  # (B,) valid positions already in each slot
        num_logits: list[int],  # (B,) trailing positions per row that need logits
    ) -> torch.Tensor:
        """Appends the rows' tokens to their slots; returns (sum(num_logits), V) float32 logits
        on the engine's device (the graph's output where it can: see picked_logits)."""
        check_rows(input_lengths, cache_lengths, num_logits, self.max_length)
        tokens = torch.split(input_ids.cpu(), input_lengths)
        groups = group_rows(input_lengths)
        per_row: dict[int, torch.Tensor] = {}  # row -> its (num_logits[row], head) logits
        for rows in groups:
            call = pad_rows(rows, tokens, cache_lengths, num_logits)
            logits = self._call(call, [slot_ids[r] for r in rows], input_lengths, cache_lengths)
            asked = [num_logits[r] for r in rows]
            if len(groups) == 1:  # rows 0..B-1 in order: no reordering, no second copy
                return self._full_vocabulary(picked_logits(logits, asked).float())
            per_row.update(zip(rows, picked_logits(logits, asked).split(asked), strict=True))
        ordered = [per_row[r] for r in range(len(input_lengths))]  # every row is in one call
        return self._full_vocabulary(torch.cat(ordered).float())

    def _call(self, call: PaddedCall, slots, input_lengths, cache_lengths) -> torch.Tensor:
        """One graph call: gather the past, run, write the new keys and values back."""
        slot_index = torch.tensor(slots, device=self.device)
        feeds = {
            "input_ids": call.input_ids,
            "position_ids": call.position_ids,
            "attention_mask": call.attention_mask,
            "logit_positions": call.logit_positions,
        }
        feeds = {name: tensor.to(self.device) for name, tensor in feeds.items()}
        for li in range(self.config.num_layers):
            for kind, cache in (("key", self.k_cache), ("value", self.v_cache)):
                # (b, kvh, P, hd), a copy; positions the mask hides are finite (zeroed cache)
                feeds[f"past_{kind}.{li}"] = cache[li][slot_index, :, : call.past_length]
        outputs = self._run(feeds)
        self._append(outputs[1:], call, slot_index, input_lengths, cache_lengths)
        return outputs[0]

    def _append(self, new_kv, call: PaddedCall, slot_index, input_lengths, cache_lengths):
        lengths = [input_lengths[r] for r in call.rows]
        batch_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        batch_index = batch_index.to(self.device)
        token_index = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        positions = torch.cat(
            [torch.arange(cache_lengths[r], cache_lengths[r] + input_lengths[r]) for r in call.rows]
        ).to(self.device)
        token_slots = slot_index[batch_index]
        for li in range(self.config.num_layers):
            for j, cache in enumerate((self.k_cache, self.v_cache)):
                new = new_kv[2 * li + j].to(self.device)  # (b, kvh, T, hd)
                packed = new[batch_index, :, token_index]  # (N, kvh, hd)
                cache[li][token_slots, :, positions] = packed.to(cache.dtype)

    def _full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """(sum(num_logits), V): a reduced head's logits spread over the vocabulary."""
        return full_vocabulary(logits, self.head_token_ids, self.config.vocab_size)


def picked_logits(logits: torch.Tensor, num_logits: list[int]) -> torch.Tensor:
    """The logits asked for out of a call's (b, L, head) output: row i's first num_logits[i]
    columns, rows in order, as (sum(num_logits), head). Where every row asks for all L (a
    decode or verify step) that is a view of the output itself; else one copy."""
    batch, width, head = logits.shape
    flat = logits.reshape(batch * width, head)  # a view: the graph's output is contiguous
    if all(n == width for n in num_logits):
        return flat
    # Indices made on the host: a boolean mask on the GPU would wait for the device.
    index = torch.cat([torch.arange(n) + i * width for i, n in enumerate(num_logits)])
    return flat.index_select(0, index.to(logits.device))


def manifest_config(engine_dir: Path) -> tuple[dict, LlamaConfig, torch.Tensor | None]:
    """The manifest, config and reduced-head token ids of an exported engine folder."""
    manifest = read_manifest(engine_dir)
    config = LlamaConfig(**manifest["config"])
    head = None
    if manifest.get("head_token_ids"):
        head = torch.from_numpy(np.load(engine_dir / manifest["head_token_ids"])).long()
    return manifest, config, head


class OnnxEngine(GraphEngine):
    """The exported graph on onnxruntime; the KV cache in CPU memory."""

    def __init__(self, engine_dir: str | Path, num_slots: int, max_length: int) -> None:
        import onnxruntime as ort

        engine_dir = Path(engine_dir)
        manifest, config, head = manifest_config(engine_dir)
        dtype = DTYPES[manifest["dtype"]]  # the cache holds what the graph takes
        super().__init__(config, num_slots, max_length, head, cache_dtype=dtype)
        providers = [
            p
            for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
            if p in ort.get_available_providers()
        ]
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        graph = str(engine_dir / manifest["graph"])
        self.session = ort.InferenceSession(graph, options, providers=providers)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        num_slots: int,
        max_length: int,
        engine_dir: str | Path | None = None,
    ) -> OnnxEngine:
        """Exports the checkpoint into engine_dir (default .run/engines/...) unless current."""
        from specdec.engines.onnx_export import default_engine_dir, ensure_exported

        path = Path(path)
        if engine_dir is None:
            engine_dir = default_engine_dir(path, default_engines_root())
        return cls(ensure_exported(path, Path(engine_dir)), num_slots, max_length)

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        arrays = {name: tensor.numpy() for name, tensor in feeds.items()}
        return [torch.from_numpy(out) for out in self.session.run(None, arrays)]


def default_engines_root() -> Path:
    """SPECDEC_HOME/.run/engines (the project's .run/engines when unset)."""
    import os

    home = os.environ.get("SPECDEC_HOME") or Path(__file__).resolve().parents[2]
    return Path(home) / ".run" / "engines"
