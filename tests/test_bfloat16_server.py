"""The bfloat16 contract, through the real server: speculative output equals plain decoding
up to the first position where plain decoding's top-2 logits lie within TIE_MARGIN.

A verify of k + 1 tokens and k + 1 one-token steps round differently in bfloat16, so where
the two best tokens are nearly tied the paths may pick differently; anywhere else a
divergence is a bug. The plain path's logits come from the same engine in this process,
decoding one token at a time (what the server's k = 0 does), so the gap at a divergence is
the plain path's own. Every divergence is printed (pytest -s, or -rA shows it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.client import generate
from specdec.engines.greedy_parity import TIE_MARGIN, find_divergences, greedy_path
from specdec.engines.llama import LlamaEngine
from specdec.harness import ManagedServer
from specdec.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.server

NUM_TOKENS = 128
PROMPTS = [
    "<|im_start|>user\nList three uses of copper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nFix the spelling: Teh quick brwon fox jumpd over the lazzy dog and "
    "ran into the forrest.<|im_end|>\n<|im_start|>assistant\n",
    '<|im_start|>user\nConvert to YAML: {"name": "web", "port": 8080, "replicas": 3, '
    '"env": {"DEBUG": "false", "REGION": "eu-west"}}<|im_end|>\n<|im_start|>assistant\n',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a village at the edge of the forest,",
    "<|im_start|>user\nRepeat this list, numbered: apples, pears, plums, cherries, grapes, "
    "figs.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders",
]


@pytest.fixture(scope="module")
def bfloat16_server(target_dir):
    running = ManagedServer(
        "test-bfloat16", {"DTYPE": "bfloat16", "NUM_SLOTS": "8", "MAX_CONTEXT": "512"}
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_path(target_dir):
    """Per prompt: the plain path's greedy token ids and each one's top-2 logit gap."""
    tokenizer = load_tokenizer(str(target_dir))
    engine = LlamaEngine.from_checkpoint(target_dir, 1, 512, dtype=torch.bfloat16)
    eos = tokenizer.eos_token_id
    paths = [greedy_path(engine, tokenizer.encode(p), NUM_TOKENS, eos) for p in PROMPTS]
    return tokenizer, paths


def check(label: str, texts: list[str], plain_path) -> list[str]:
    """Each served text against the plain path: a report line per divergence; fails on one
    outside the margin."""
    tokenizer, paths = plain_path
    report, outside = [], []
    for d in find_divergences(tokenizer.decode, paths, texts, tokenizer.eos_token_id):
        line = f"{label}: {PROMPTS[d.prompt][:40]!r} diverges at token {d.token}, gap {d.gap:.4f}"
        report.append(line)
        if not d.near_tie():
            outside.append(line)
    print("\n".join(report) or f"{label}: no divergence")
    assert not outside, outside
    return report


def served(url: str, jobs: list[dict], concurrently: bool) -> list[str]:
    def one(job):
        prompt, params = job
        result = generate(
            prompt, url=url, max_tokens=NUM_TOKENS, exclude_input_in_output=True, **params
        )
        assert result.error is None, result.error
        return result.text

    if not concurrently:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_bfloat16_speculation_diverges_only_at_near_ties(bfloat16_server, plain_path):
    url = bfloat16_server.url
    plain = served(url, [(p, {"num_draft_tokens": 0}) for p in PROMPTS], concurrently=False)
    drafted = {"num_draft_tokens": 4, "fixed_num_draft_tokens": True, "proposer": "draft_model"}
    looked_up = {"num_draft_tokens": 8, "fixed_num_draft_tokens": True, "proposer": "ngram"}
    alone = served(url, [(p, drafted) for p in PROMPTS], concurrently=False)
    batch = served(
        url,
        [(p, drafted if i % 2 else looked_up) for i, p in enumerate(PROMPTS)],
        concurrently=True,
    )
    # The served plain path is this one, exactly: the gaps are the server's own.
    assert check("plain (k = 0) on the server", plain, plain_path) == []
    check("draft model k = 4, alone", alone, plain_path)
    check("batch of 8, draft k = 4 and lookup k = 8", batch, plain_path)


def test_the_check_fails_on_a_divergence_away_from_a_tie(plain_path):
    """Not vacuous: a text that leaves plain decoding where its top two are far apart."""
    tokenizer, paths = plain_path
    ids, gaps = paths[0]
    far = next(i for i, gap in enumerate(gaps) if gap >= TIE_MARGIN)
    texts = [tokenizer.decode(path_ids) for path_ids, _ in paths]
    texts[0] = tokenizer.decode(ids[:far]) + " something else entirely"
    with pytest.raises(AssertionError):
        check("a scripted divergence", texts, plain_path)
