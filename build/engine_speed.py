"""The torch engine's forward in this process, by precision, rows and tokens per row.

    .venv/bin/python -m build.engine_speed [--checkpoint models/smollm2-135m-instruct]
        [--dtypes bfloat16,float32] [--shapes 1x1,1x8,16x1,32x1] [--cached 200]
    .venv/bin/python -m build.engine_speed --shapes 16x1,16x1@20,16x1@32,16x1@64

What a verify costs against a plain step, and what bfloat16 buys over float32, on this
host, without a server: every slot is filled with `--cached` positions, then each shape
(ROWSxTOKENS: that many rows each appending that many tokens and asking for their logits;
ROWSxTOKENS@SPAN: the rows' slots spread evenly over SPAN slots, as rows lie once requests
have joined and left, instead of adjacent) runs `--repeats` times; the median is reported.
Hosts differ most in what bfloat16 buys (those measured: docs/benchmarks-archive.md). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.engines.select import create_engine
from specdec.paths import PROJECT_ROOT


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """(rows, tokens, span) of each ROWSxTOKENS[@SPAN]; span defaults to rows."""
    shapes = []
    for item in text.split(","):
        shape, _, span = item.partition("@")
        rows, _, tokens = shape.partition("x")
        span = span or rows
        numbers = [int(x) if x.isdigit() else 0 for x in (rows, tokens, span)]
        if min(numbers) < 1 or numbers[2] < numbers[0]:
            raise ValueError(
                f"--shapes: {item!r} is not ROWSxTOKENS or ROWSxTOKENS@SPAN with SPAN >= ROWS "
                "(e.g. 16x1 or 16x1@32)"
            )
        shapes.append((numbers[0], numbers[1], numbers[2]))
    return shapes


def spread_slots(rows: int, span: int) -> list[int]:
    """`rows` distinct slots spread evenly over slots 0 .. span - 1, the first and last
    included."""
    if rows == 1:
        return [0]
    return [i * (span - 1) // (rows - 1) for i in range(rows)]


def time_shapes(
    engine, shapes: list[tuple[int, int, int]], cached: int, repeats: int
) -> list[dict]:
    vocab = engine.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for slot in range(max(span for *_, span in shapes)):
        ids = torch.randint(0, vocab, (cached,), generator=generator)
        engine.forward(ids, [cached], [slot], [0], [1])
    results = []
    for rows, tokens, span in shapes:
        slots = spread_slots(rows, span)
        seconds = []
        for _ in range(repeats):
            ids = torch.randint(0, vocab, (rows * tokens,), generator=generator)
            start = time.perf_counter()
            engine.forward(ids, [tokens] * rows, slots, [cached] * rows, [tokens] * rows)
            seconds.append(time.perf_counter() - start)
        results.append(
            {
                "rows": rows,
                "tokens": tokens,
                "span": span,
                "median_ms": 1000 * statistics.median(seconds),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", default=str(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    )
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--shapes", default="1x1,1x8,16x1,32x1")
    parser.add_argument("--cached", type=int, default=200, help="positions in each slot")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "engine_speed.json")
    args = parser.parse_args()
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    max_tokens = max(tokens for _, tokens, _ in shapes)
    num_slots = max(span for *_, span in shapes)
    report = {
        "checkpoint": args.checkpoint,
        "cached": args.cached,
        "threads": args.threads,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dtypes": {},
    }
    for dtype in args.dtypes.split(","):
        engine = create_engine(
            "torch", args.checkpoint, num_slots, args.cached + max_tokens, dtype=dtype
        )
        results = time_shapes(engine, shapes, args.cached, args.repeats)
        report["dtypes"][dtype] = results
        for r in results:
            print(
                f"{dtype:<9} {r['rows']:>3} rows x {r['tokens']} tokens in {r['span']} slots: "
                f"{r['median_ms']:.1f} ms",
                flush=True,
            )
        del engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
