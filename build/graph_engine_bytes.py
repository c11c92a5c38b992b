"""Bytes the graph engines (onnxruntime, tensorrt) move per call around their graph.

    .venv/bin/python -m build.graph_engine_bytes        # results/graph_engine_bytes.{json,md}
    .venv/bin/python -m build.graph_engine_bytes --time-contexts 128,512   # + onnxruntime times

Counted, not estimated: GraphEngine's own `forward` (specdec/engines/onnx_engine.py) runs on
PyTorch's meta device (shapes, no data, no memory) under a dispatch mode that adds up the
bytes every op writes, by phase of the call:
- gather: each row's past keys and values copied out of its slot, padded to the longest row
  (P positions), and whatever else the engine does to that copy;
- append: the new keys and values scattered back into the slots;
- logits: the logits picked out of the graph's output and handed back, and any copy to the
  host (the `to host` column: the tensorrt engine's logits before they stayed on the GPU).
A copy reads as many bytes as it writes. Beside them, from the same shapes: what the graph
itself takes in and returns, its own concatenation of past and new keys (onnx_export's
DecoderGraph), and the least attention must read: each row's own cached positions, once.
Every call is the target's: 64 rows (--rows) each appending k + 1 tokens and asking for
k + 1 logits (k = 0: a plain step; k = 4: a verify), all rows at the context length
("equal") or spread evenly over 1..context ("spread": a padded call's usual case).

--time-contexts also times real onnxruntime calls of the exported target on this host (the
cache filled with zeros, not prefilled: the figures are the engine's, not the answer's),
split into the graph's run, the gather, the append, and the rest (padding the rows, picking
the logits, freeing the call's tensors), median of --repeats, on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.engines.llama import LlamaConfig
from specdec.engines.onnx_engine import GraphEngine, OnnxEngine
from specdec.engines.onnx_export import read_manifest
from specdec.paths import PROJECT_ROOT

# Ops that write nothing: views and fresh uninitialised tensors.
NO_WRITE = {"empty", "empty_strided", "new_empty", "_unsafe_view", "alias", "detach"}


@dataclass
class BytesConfig:
    checkpoint: Path = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    rows: int = 64
    ks: list[int] = field(default_factory=lambda: [0, 4])
    contexts: list[int] = field(default_factory=lambda: [128, 512, 1024, 2048])
    cache_dtypes: list[str] = field(default_factory=lambda: ["float32", "float16"])
    time_contexts: list[int] = field(default_factory=list)
    repeats: int = 3
    # Threads of torch and of onnxruntime while timing: on a busy host a second thread that
    # is not scheduled leaves the first spinning at each barrier (seen here: 60 small writes
    # took 0.96 s of CPU on 2 threads, 9 ms on 1).
    threads: int = 1
    out: Path = PROJECT_ROOT / "results" / "graph_engine_bytes.json"


class ByteMeter(TorchDispatchMode):
    """Adds up the bytes each op writes, by the phase the engine is in."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "inputs"
        self.written: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("to", "_to_copy") and kwargs.get("device") is not None:
            source, target = args[0].device.type, torch.device(kwargs["device"]).type
            if source != target:  # the engine's device is meta here; the host is the CPU
                self.written["to host" if target == "cpu" else "to device"] += nbytes(args[0])
                if target == "cpu":  # no data to copy: stand in with a meta tensor
                    return torch.empty(args[0].shape, dtype=kwargs.get("dtype"), device="meta")
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func.is_view or name in NO_WRITE:
            return out
        if name in ("index_put_", "_index_put_impl_", "index_put"):
            count = nbytes(args[2])  # the values written, not the whole destination
        elif name == "copy_":
            count = nbytes(args[1])
        else:
            outputs = out if isinstance(out, (list, tuple)) else [out]
            count = sum(nbytes(t) for t in outputs if isinstance(t, torch.Tensor))
        on_device = any(isinstance(a, torch.Tensor) and a.is_meta for a in [*args, out])
        self.written[self.phase if on_device else "host bookkeeping"] += count
        return out


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class MeteredEngine(GraphEngine):
    """GraphEngine on the meta device; the graph replaced by outputs of its shapes."""

    def __init__(self, config: LlamaConfig, rows: int, max_length: int, cache_dtype) -> None:
        super().__init__(config, rows, max_length, device="meta", cache_dtype=cache_dtype)
        self.meter = ByteMeter()
        self.graph_in = self.graph_out = 0

    def _call(self, call, slots, input_lengths, cache_lengths) -> torch.Tensor:
        self.meter.phase = "gather"
        logits = super()._call(call, slots, input_lengths, cache_lengths)
        self.meter.phase = "logits"
        return logits

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        c = self.config
        batch, new_tokens = feeds["input_ids"].shape
        num_logits = feeds["logit_positions"].shape[1]
        kv_shape = (batch, c.num_kv_heads, new_tokens, c.head_dim)
        outputs = [torch.empty(batch, num_logits, c.vocab_size, device="meta")]
        outputs += [
            torch.empty(kv_shape, dtype=self.k_cache.dtype, device="meta")
            for _ in range(2 * c.num_layers)
        ]
        self.graph_in += sum(nbytes(t) for t in feeds.values())
        self.graph_out += sum(nbytes(t) for t in outputs)
        self.meter.phase = "append"
        return outputs


def cache_lengths_of(rows: int, context: int, spread: bool) -> list[int]:
    """Each row's cached positions: all at `context`, or spread evenly over 1..context."""
    if not spread:
        return [context] * rows
    return [max(1, round(context * (r + 1) / rows)) for r in range(rows)]


def count_call(config: LlamaConfig, rows: int, k: int, context: int, spread: bool, dtype) -> dict:
    """One target call of `rows` rows, k + 1 new tokens and k + 1 logits each."""
    new_tokens = k + 1
    engine = MeteredEngine(config, rows, context + new_tokens, getattr(torch, dtype))
    cached = cache_lengths_of(rows, context, spread)
    with engine.meter:
        engine.forward(
            torch.zeros(rows * new_tokens, dtype=torch.int64),
            [new_tokens] * rows,
            list(range(rows)),
            cached,
            [new_tokens] * rows,
        )
    c, element = config, torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * element  # keys + values
    written = dict(engine.meter.written)
    return {
        "k": k,
        "context": context,
        "rows": "spread" if spread else "equal",
        "cache_dtype": dtype,
        "gather": written.get("gather", 0),
        "append": written.get("append", 0),
        "logits": written.get("logits", 0),
        "to_host": written.get("to host", 0),
        "to_device": written.get("to device", 0),
        "graph_in": engine.graph_in,
        "graph_out": engine.graph_out,
        "graph_concat": rows * (max(cached) + new_tokens) * per_position,
        "in_place_read": sum(cached) * per_position,
    }


def count_all(config: BytesConfig) -> list[dict]:
    llama = LlamaConfig.from_hf(json.loads((config.checkpoint / "config.json").read_text()))
    return [
        count_call(llama, config.rows, k, context, spread, dtype)
        for dtype in config.cache_dtypes
        for k in config.ks
        for spread in (False, True)
        for context in config.contexts
    ]


# Wall-clock time, and this process's CPU time (all threads): on a shared host the first
# grows with the others' load, the second much less.
CLOCKS = {"ms": time.perf_counter, "cpu_ms": time.process_time}


class TimedOnnxEngine(OnnxEngine):
    """OnnxEngine with the time of each part of a call added up, on both CLOCKS, its
    onnxruntime session on THREADS threads."""

    threads = 1

    def __init__(self, engine_dir, num_slots: int, max_length: int) -> None:
        import onnxruntime as ort

        super().__init__(engine_dir, num_slots, max_length)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = options.inter_op_num_threads = self.threads
        graph = str(Path(engine_dir) / read_manifest(Path(engine_dir))["graph"])
        self.session = ort.InferenceSession(graph, options, providers=self.session.get_providers())
        self.spent: dict[tuple[str, str], float] = defaultdict(float)  # (part, clock) -> s

    def timed(self, part: str, action):
        start = {clock: read() for clock, read in CLOCKS.items()}
        result = action()
        for clock, read in CLOCKS.items():
            self.spent[part, clock] += read() - start[clock]
        return result

    def _call(self, *args) -> torch.Tensor:
        return self.timed("call", lambda: OnnxEngine._call(self, *args))

    def _run(self, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.timed("graph", lambda: OnnxEngine._run(self, feeds))

    def _append(self, *args) -> None:
        self.timed("append", lambda: OnnxEngine._append(self, *args))


def time_calls(config: BytesConfig) -> list[dict]:
    """Median ms of onnxruntime calls, whole and by part, at each --time-contexts length."""
    results = []
    torch.set_num_threads(config.threads)
    TimedOnnxEngine.threads = config.threads
    for context in config.time_contexts:
        new_tokens = max(config.ks) + 1
        engine = TimedOnnxEngine.from_checkpoint(
            config.checkpoint, config.rows, context + new_tokens
        )
        engine.k_cache[:, :, :, :context].zero_()  # finite: the slots hold `context` positions
        engine.v_cache[:, :, :, :context].zero_()
        for k in config.ks:
            results.append(time_one(engine, config, context, k))
        del engine
    return results


def time_one(engine: TimedOnnxEngine, config: BytesConfig, context: int, k: int) -> dict:
    rows, new_tokens = config.rows, k + 1
    args = (
        torch.zeros(rows * new_tokens, dtype=torch.int64),
        [new_tokens] * rows,
        list(range(rows)),
        [context] * rows,
        [new_tokens] * rows,
    )
    parts: dict[str, list[float]] = defaultdict(list)
    for repeat in range(config.repeats + 1):  # the first call warms up
        engine.spent.clear()
        engine.timed("total", lambda: engine.forward(*args))
        if repeat == 0:
            continue
        for clock in CLOCKS:
            spent = {
                part: engine.spent[part, clock] for part in ("total", "call", "graph", "append")
            }
            parts[f"total_{clock}"].append(spent["total"])
            parts[f"graph_{clock}"].append(spent["graph"])
            parts[f"gather_{clock}"].append(spent["call"] - spent["graph"] - spent["append"])
            parts[f"append_{clock}"].append(spent["append"])
            parts[f"rest_{clock}"].append(spent["total"] - spent["call"])
    medians = {name: round(1000 * statistics.median(v), 1) for name, v in parts.items()}
    return {"k": k, "context": context, **medians}


def markdown(counted: list[dict], timed: list[dict], rows: int, threads: int = 1) -> str:
    """One line per cache dtype, k and context: the engine's copies with every row at the
    context length, and what attention in place would read then and with rows spread."""
    mb = 1e6
    spread = {(r["cache_dtype"], r["k"], r["context"]): r for r in counted if r["rows"] == "spread"}
    lines = [
        f"Bytes per target call, {rows} rows (MB written; each copy reads as many):",
        "",
        "| cache | k | context | gather | append | logits | to host | graph concat | graph out "
        "| in-place read | in-place read, spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in counted:
        if r["rows"] != "equal":
            continue
        keys = ("gather", "append", "logits", "to_host", "graph_concat", "graph_out")
        cells = [r["cache_dtype"], r["k"], r["context"], *(f"{r[x] / mb:,.1f}" for x in keys)]
        cells.append(f"{r['in_place_read'] / mb:,.1f}")
        other = spread.get((r["cache_dtype"], r["k"], r["context"]))
        cells.append(f"{other['in_place_read'] / mb:,.1f}" if other else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if timed:
        parts = ("total", "graph", "gather", "append", "rest")
        lines += [
            "",
            f"onnxruntime on this host ({os.cpu_count()} CPUs, {threads} thread(s), load average "
            f"{os.getloadavg()[0]:.1f}), ms per call, median: wall clock / this process's CPU",
            "",
            "| k | context | " + " | ".join(parts) + " |",
            "|---|---|" + "---|" * len(parts),
        ]
        for t in timed:
            cells = [t["k"], t["context"], *(f"{t[p + '_ms']} / {t[p + '_cpu_ms']}" for p in parts)]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run(config: BytesConfig) -> dict:
    counted = count_all(config)
    load_before = os.getloadavg()[0]
    timed = time_calls(config) if config.time_contexts else []
    report = {"config": {k: str(v) for k, v in asdict(config).items()}}
    report |= {"counted": counted, "timed": timed}
    # Timings on a shared host: the 1-minute load average before and after, beside them.
    report["load_average"] = [load_before, os.getloadavg()[0]] if timed else None
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    config.out.with_suffix(".md").write_text(markdown(counted, timed, config.rows, config.threads))
    return report


def int_list(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def parse_args(argv: list[str] | None = None) -> BytesConfig:
    defaults = BytesConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=defaults.checkpoint)
    parser.add_argument("--rows", type=int, default=defaults.rows)
    parser.add_argument("--ks", type=int_list, default=defaults.ks, help="e.g. 0,4")
    parser.add_argument("--contexts", type=int_list, default=defaults.contexts)
    parser.add_argument(
        "--cache-dtypes", type=lambda s: s.split(","), default=defaults.cache_dtypes
    )
    parser.add_argument("--time-contexts", type=int_list, default=[], help="e.g. 128,512")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="while timing")
    parser.add_argument("--out", type=Path, default=defaults.out)
    return BytesConfig(**vars(parser.parse_args(argv)))


def main() -> None:
    config = parse_args()
    report = run(config)
    print(config.out.with_suffix(".md").read_text(), end="")
    print(f"written: {config.out} (load average {report['load_average']})")


if __name__ == "__main__":
    main()
