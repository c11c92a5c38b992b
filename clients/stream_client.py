"""Streams one generation from the server over gRPC and prints a summary.

    .venv/bin/python clients/stream_client.py --chat "Explain KV caches briefly." \
        --max-tokens 128 --num-draft-tokens 4

Text is printed as it arrives; then output tokens, tokens/s, time to first token and the
acceptance rate. --model speculative_decoding calls the BLS straight (cancellable streams).
--num-return-sequences N (with --temperature > 0) prints N independent sequences, each after
it ends; --log-probs adds the target's log-probability of the output (cum_log_probs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.client import StreamingClient

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"


@dataclass
class ClientConfig:
    prompt: str
    url: str
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    num_draft_tokens: int | None
    chat: bool
    tokenizer: Path
    num_return_sequences: int = 1
    log_probs: bool = False


def run(config: ClientConfig) -> int:
    prompt = config.prompt
    if config.chat:
        from specdec.text.tokenizer import TextTokenizer

        prompt = TextTokenizer(config.tokenizer).apply_chat_template(prompt)
    params = dict(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=config.seed,
        num_draft_tokens=config.num_draft_tokens,
        return_perf_metrics=True,
        return_num_output_tokens=True,
        return_log_probs=config.log_probs or None,
    )
    with StreamingClient(config.url, config.model) as client:
        if config.num_return_sequences > 1:
            return print_sequences(client, prompt, config.num_return_sequences, params)
        result = client.generate(
            prompt,
            stream=True,
            on_chunk=lambda chunk: print(chunk, end="", flush=True),
            **params,
        )
    print()
    if result.error is not None:
        print(f"error: {result.error.message()}", file=sys.stderr)
        return 1
    metrics = result.metrics
    num_tokens = int(metrics.get("num_output_tokens", 0))
    decode_time = result.elapsed
    print(
        f"--- {num_tokens} output tokens in {decode_time:.2f} s: "
        f"{num_tokens / decode_time:.1f} tokens/s, "
        f"time to first token {1000 * (result.time_to_first_token or 0):.0f} ms, "
        f"acceptance rate {metrics.get('acceptance_rate', 0):.2f} "
        f"({int(metrics.get('total_accepted_draft_tokens', 0))}"
        f"/{int(metrics.get('total_draft_tokens', 0))} draft tokens)",
        file=sys.stderr,
    )
    if "cum_log_probs" in metrics:
        print(f"--- cum_log_probs {metrics['cum_log_probs']:.3f}", file=sys.stderr)
    return 0


def print_sequences(client: StreamingClient, prompt: str, count: int, params: dict) -> int:
    """One request for `count` sequences (num_return_sequences), printed by sequence_index."""
    results = client.generate_all(
        prompt, num_return_sequences=count, exclude_input_in_output=True, **params
    )
    for (_, index), result in sorted(results.items()):
        if result.error is not None:
            print(f"error: {result.error.message()}", file=sys.stderr)
            return 1
        summary = f"{int(result.metrics.get('num_output_tokens', 0))} tokens"
        if "cum_log_probs" in result.metrics:
            summary += f", cum_log_probs {result.metrics['cum_log_probs']:.3f}"
        print(f"--- sequence {index} ({summary})\n{result.text}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    parser.add_argument(
        "--model",
        default="ensemble",
        help="ensemble, or speculative_decoding to call the BLS directly",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="k; leave out for the server's choice, 0 for no speculation",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="checkpoint folder whose chat template --chat applies",
    )
    parser.add_argument(
        "--num-return-sequences",
        type=int,
        default=1,
        help="independent sequences from one prompt (sampled: set --temperature)",
    )
    parser.add_argument(
        "--log-probs", action="store_true", help="report the output's cum_log_probs"
    )
    args = parser.parse_args()
    sys.exit(run(ClientConfig(**vars(args))))


if __name__ == "__main__":
    main()
