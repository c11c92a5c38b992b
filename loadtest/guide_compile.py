"""What compiling a schema not seen before adds to time to first token.

On one server (our own, or --url), for each of ROUNDS fresh JSON schemas (a field name no
earlier run used, so no cache holds it): one streamed request with the schema (the BLS
compiles it before the request is queued), then the same request again (compiled grammar
cached), then the same prompt with no guide. Time to first token of each, one request at a
time on an idle server; the median difference, new against cached, is the compile's cost.

    python loadtest/guide_compile.py [--rounds 5] [--url host:port]

prints the figures and writes results/guide-compile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.client import generate  # noqa: E402
from specdec.harness import ManagedServer  # noqa: E402
from specdec.paths import PROJECT_ROOT  # noqa: E402

PROMPT = "<|im_start|>user\nDescribe a city as JSON.<|im_end|>\n<|im_start|>assistant\n"


def fresh_schema() -> str:
    """A small schema with a field name no cache has seen."""
    name = "f" + uuid.uuid4().hex[:12]
    properties = {
        name: {"type": "string"},
        "population": {"type": "integer"},
        "country": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    }
    return json.dumps({"type": "object", "properties": properties, "required": [name]})


def first_token_s(url: str, **inputs) -> float:
    result = generate(PROMPT, url=url, max_tokens=4, stream=True, num_draft_tokens=0, **inputs)
    if result.error is not None or result.time_to_first_token is None:
        raise RuntimeError(f"request failed: {result.error}")
    return result.time_to_first_token


def measure(url: str, rounds: int) -> dict:
    first_token_s(url)  # warm: the first request of a server pays for more than this
    rows = []
    for _ in range(rounds):
        guide = dict(guided_decoding_guide_type="json_schema", guided_decoding_guide=fresh_schema())
        new = first_token_s(url, **guide)
        cached = first_token_s(url, **guide)
        plain = first_token_s(url)
        rows.append({"new_s": new, "cached_s": cached, "unguided_s": plain})
    added = [r["new_s"] - r["cached_s"] for r in rows]
    return {
        "rounds": rows,
        "median_added_ms": 1000 * statistics.median(added),
        "median_ttft_new_ms": 1000 * statistics.median(r["new_s"] for r in rows),
        "median_ttft_cached_ms": 1000 * statistics.median(r["cached_s"] for r in rows),
        "median_ttft_unguided_ms": 1000 * statistics.median(r["unguided_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--url", default=None, help="a running server's gRPC host:port")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "guide-compile.json")
    args = parser.parse_args()
    if args.url:
        figures = measure(args.url, args.rounds)
    else:
        with ManagedServer("guide-compile", {"NUM_SLOTS": "8", "MAX_CONTEXT": "512"}) as server:
            figures = measure(server.url, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
