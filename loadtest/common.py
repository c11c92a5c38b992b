"""What the load tests and benchmarks share: the modes, the workloads and their prompts (or
conversations), the order of the modes' windows, the server's loop counters, --server-env,
percentiles and the look of the plots.

The scripts in loadtest/ run as files (`python loadtest/bench.py`), so Python puts this
folder on sys.path and they import this module by its bare name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.client import scrape_metrics
from specdec.paths import PROJECT_ROOT
from specdec.serving.metric_names import LOOP_PARTS, OUTBOX_SECONDS
from specdec.text.request import OUTPUT_ONLY

if TYPE_CHECKING:
    from walks import Workload

Message = dict[str, str]  # a chat message: {"role", "content"} (as walks.Message)

# The modes: each name's request inputs. k0-again is k = 0 under a second name (the noise
# floor); k0-float32 and k0-b are k = 0 on bench's second server (--float32-concurrency,
# --env-b). suffix and adaptive-nosuffix need a server whose PROPOSERS has suffix (the
# store of earlier answers); one without refuses proposer=suffix.
MODES: dict[str, dict] = {
    "k0": {"num_draft_tokens": 0},
    "k2": {"num_draft_tokens": 2, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "k4": {"num_draft_tokens": 4, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "k8": {"num_draft_tokens": 8, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "draft": {"proposer": "draft_model"},
    "ngram": {"proposer": "ngram"},
    "adaptive": {},
    "suffix": {"proposer": "suffix"},
    "adaptive-nosuffix": {"proposer": ("draft_model", "ngram")},  # the server's choice of these
    "k0-again": {"num_draft_tokens": 0},
    "k0-float32": {"num_draft_tokens": 0},
    "k0-b": {"num_draft_tokens": 0},
}
LOADTEST = PROJECT_ROOT / "loadtest"
# The workloads of one request per prompt, by their prompt file ({"category", "prompt"} lines).
WORKLOADS = {
    "chat": LOADTEST / "prompts.jsonl",
    "grounded": LOADTEST / "prompts_grounded.jsonl",
    "rewrite": LOADTEST / "prompts_rewrite.jsonl",
    # one system text of about 1,000 tokens before each question (prefix reuse)
    "shared-prefix": LOADTEST / "prompts_shared_prefix.jsonl",
}
# A prompt file's system message, where it has one (none: the chat template's default).
SYSTEM_PROMPTS = {WORKLOADS["shared-prefix"]: LOADTEST / "shared_prefix_system.txt"}
# The workloads of conversations ({"category", "turns"} lines): a request per user turn, which
# resends the history with the answers the stream received (walks.ConversationWalk).
CONVERSATIONS = {"multi-turn": LOADTEST / "conversations_multi_turn.jsonl"}
# The workloads of requests with a guide each ({"category", "messages", "guide_type",
# "schema"} lines: loadtest/structured.py): the server's guided decoding, answers checked.
STRUCTURED = {"structured": LOADTEST / "prompts_structured.jsonl"}
# The workloads generated, not read: agentic (loadtest/agentic.py), conversations of tool
# calls without end, whose walks in different parts never send the same prompt.
GENERATED = ("agentic",)
WORKLOAD_NAMES = (*WORKLOADS, *CONVERSATIONS, *STRUCTURED, *GENERATED)


def unknown_modes(modes: list[str]) -> list[str]:
    """The names in `modes` that MODES does not define."""
    return [mode for mode in modes if mode not in MODES]


# A mode's variants (bench.py): `-sampled` samples at this temperature instead of greedy;
# `-penalized` sends presence and frequency penalties of 0.5 counted over the output, as the
# OpenAI API counts them; `-penalized-prompt` the same over the prompt and the output
# (TensorRT-LLM's default); `-controlcost` penalties too small to change a greedy answer,
# counted over both: all of the controls' work on the same text, so only their cost shows;
# `-si<N>` sets the request's stream_interval (a response each time N output tokens gathered).
SAMPLED_TEMPERATURE = 0.8
CONTROLS = {
    "-penalized": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "prompt_ignore_length": OUTPUT_ONLY,
    },
    "-penalized-prompt": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "-controlcost": {"presence_penalty": 1e-4, "frequency_penalty": 1e-4},
}
VARIANT = re.compile(
    r"(?P<base>.+?)(?P<sampled>-sampled)?(?P<controls>-penalized-prompt|-penalized|-controlcost)?"
    r"(?P<unguided>-unguided)?(?:-si(?P<interval>[1-9][0-9]*))?"
)


def unguided(name: str) -> bool:
    """Whether mode `name` sends a guided workload's prompts without their guides
    (`k0-unguided`: what the guide costs, against `k0` on the same prompts)."""
    match = VARIANT.fullmatch(name)
    return bool(match and match["unguided"])


def mode_inputs(name: str) -> dict:
    """The request inputs of a MODES name with optional variant suffixes, in this order:
    `k4-sampled-si16` is k4 at temperature 0.8 with a response every 16 output tokens;
    `adaptive-penalized` is adaptive with CONTROLS["-penalized"]; `-unguided` (see unguided)
    sends no input of its own.
    stream_interval is sent only when it is not 1 (a server without it still serves the
    rest). Raises KeyError for a name that is none of these."""
    match = VARIANT.fullmatch(name)
    if match is None or match["base"] not in MODES:
        raise KeyError(name)
    inputs = dict(MODES[match["base"]])
    if match["sampled"]:
        inputs["temperature"] = SAMPLED_TEMPERATURE
    if match["controls"]:
        inputs.update(CONTROLS[match["controls"]])
    if match["interval"] and int(match["interval"]) != 1:
        inputs["stream_interval"] = int(match["interval"])
    return inputs


def unknown_variants(modes: list[str]) -> list[str]:
    """The names in `modes` that mode_inputs refuses."""
    unknown = []
    for mode in modes:
        try:
            mode_inputs(mode)
        except KeyError:
            unknown.append(mode)
    return unknown


def read_prompts(path: Path) -> list[str]:
    """The prompts of a JSONL file of {"category", "prompt"} lines, as written."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [item["prompt"] for item in lines]


def read_system(path: Path) -> str | None:
    """The system message of a prompt file's requests; None: the template's default."""
    system = SYSTEM_PROMPTS.get(path)
    return None if system is None else system.read_text()


def prompt_messages(path: Path) -> list[list[Message]]:
    """Each prompt of a prompt file as a request's chat messages: its system message (where
    the file has one), then the prompt as the user's."""
    system = read_system(path)
    head = [] if system is None else [{"role": "system", "content": system}]
    return [[*head, {"role": "user", "content": prompt}] for prompt in read_prompts(path)]


def read_conversations(path: Path) -> list[list[str]]:
    """The user turns of each conversation of a JSONL file of {"category", "turns"} lines."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [item["turns"] for item in lines]


def read_workload(name: str) -> Workload:
    """A workload of WORKLOAD_NAMES, as chat messages (unrendered)."""
    from walks import Workload  # loadtest/ on sys.path: the scripts, the locustfile, tests

    if name == "agentic":
        import agentic

        return Workload(name, conversations=agentic.TASKS, head=agentic.HEAD, unique=True)
    if name in CONVERSATIONS:
        return Workload(name, conversations=read_conversations(CONVERSATIONS[name]))
    if name in STRUCTURED:
        from structured import MAX_TOKENS, read_structured

        requests, guides = read_structured(STRUCTURED[name])
        return Workload(name, requests=requests, guides=guides, min_max_tokens=MAX_TOKENS)
    return Workload(name, requests=prompt_messages(WORKLOADS[name]))


def chat_template() -> Callable[[list[Message]], str]:
    """The target model's chat template: messages to a prompt that opens the answer."""
    from specdec.text.tokenizer import load_tokenizer

    return load_tokenizer(
        str(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    ).apply_chat_template


def load_prompts(path: Path) -> list[str]:
    """Chat-formatted prompts from a JSONL file of {"category", "prompt"} lines (with the
    file's system message, if it has one)."""
    render = chat_template()
    return [render(messages) for messages in prompt_messages(path)]


def mirrored_order(modes: list[str], index: int) -> list[str]:
    """Each mode twice, in mirrored order (A B C C B A), the order itself reversed at every
    other `index` (level, stage or round): drift that is linear over it hits every mode
    alike."""
    order = modes if index % 2 == 0 else modes[::-1]
    return order + order[::-1]


# The loop's parts, and the outbox's time (inline: within respond; threaded: beside the loop).
TIMED_PARTS = (*LOOP_PARTS, "outbox")
# The engine calls the loop makes, whose count and returned bytes the server counts
# (specdec_engine_calls_total, specdec_engine_result_bytes_total; absent on older servers).
ENGINE_CALL_KINDS = ("draft", "target")
# specdec_proposer_*_tokens_total's labels (a server without suffix or grammar: its counters
# read 0; grammar proposes the tokens a guided request's grammar forces)
PROPOSER_NAMES = ("draft_model", "ngram", "suffix", "grammar")


def loop_counters(values: dict[str, float]) -> dict[str, float]:
    """Emitted tokens, iterations and loop seconds by part, from a scrape_metrics result."""
    counters = {
        "tokens": values.get("specdec_emitted_tokens_total", 0.0),
        "iterations": values.get("specdec_iterations_total", 0.0),
    }
    for part in LOOP_PARTS:
        counters[part] = values.get(f'specdec_loop_seconds_total{{part="{part}"}}', 0.0)
    counters["outbox"] = values.get(OUTBOX_SECONDS, 0.0)
    return counters | engine_counters(values)


def engine_counters(values: dict[str, float]) -> dict[str, float]:
    """Calls and returned bytes per engine call kind, from a scrape_metrics result: only
    the kinds whose two counters the server has."""
    counters = {}
    for call in ENGINE_CALL_KINDS:
        calls = f'specdec_engine_calls_total{{call="{call}"}}'
        result_bytes = f'specdec_engine_result_bytes_total{{call="{call}"}}'
        if calls in values and result_bytes in values:
            counters[f"{call}_calls"] = values[calls]
            counters[f"{call}_result_bytes"] = values[result_bytes]
    return counters


def per_call(counted: dict[str, float]) -> dict[str, float | None]:
    """Engine calls per iteration and bytes returned per call, by kind, from deltas of
    loop_counters; None where the server does not count them (or, for bytes per call,
    made no such call)."""
    iterations = counted.get("iterations", 0.0)
    report: dict[str, float | None] = {}
    for call in ENGINE_CALL_KINDS:
        calls = counted.get(f"{call}_calls")
        result_bytes = counted.get(f"{call}_result_bytes")
        counts = calls is not None and result_bytes is not None
        report[f"{call}_calls_per_iteration"] = (
            calls / iterations if counts and iterations else None
        )
        report[f"{call}_bytes_per_call"] = result_bytes / calls if counts and calls else None
    return report


def server_counters(metrics_url: str | None) -> dict[str, float]:
    """The server's emitted tokens, iterations, loop seconds by part and each proposer's
    draft and accepted tokens; {} without metrics."""
    if metrics_url is None:
        return {}
    values = scrape_metrics(metrics_url)
    return loop_counters(values) | proposer_counters(values)


def proposer_counters(values: dict[str, float]) -> dict[str, float]:
    """Each proposer's draft tokens and accepted ones (`<name>_draft_tokens`,
    `<name>_accepted`), from a scrape_metrics result."""
    counters = {}
    for name in PROPOSER_NAMES:
        label = f'{{proposer="{name}"}}'
        counters[f"{name}_draft_tokens"] = values.get(
            f"specdec_proposer_draft_tokens_total{label}", 0.0
        )
        counters[f"{name}_accepted"] = values.get(
            f"specdec_proposer_accepted_draft_tokens_total{label}", 0.0
        )
    return counters


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before, by name: what loop_counters counted between two readings (a counter
    the server created in between counted from 0)."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


def per_iteration(counted: dict[str, float]) -> dict[str, float]:
    """Tokens per iteration and ms per iteration by loop part, from loop_counters' deltas."""
    iterations = counted["iterations"]
    report = {"tokens_per_iteration": counted["tokens"] / iterations if iterations else 0.0}
    for part in TIMED_PARTS:
        ms = 1000 * counted[part] / iterations if iterations else 0.0
        report[f"{part}_ms_per_iteration"] = ms
    return report


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the server did between two scrapes: the loop figures bench reports, and each proposer's
    draft and accepted tokens."""
    counted = deltas(loop_counters(before), loop_counters(after))
    report = {"iterations": counted["iterations"], "emitted_tokens": counted["tokens"]}
    report.update(per_iteration(counted))
    report.update(deltas(proposer_counters(before), proposer_counters(after)))
    return report


def accepted_of_drafted(
    counted: dict[str, float], names: tuple[str, ...] = PROPOSER_NAMES
) -> list[str]:
    """ "name accepted/drafted" for each proposer of `names`, from counter_deltas' figures."""
    return [f"{n} {counted[f'{n}_accepted']:.0f}/{counted[f'{n}_draft_tokens']:.0f}" for n in names]


SETTING_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_env(text: str) -> dict[str, str]:
    """A --server-env value, NAME=VALUE,... ("" = none), as a dict. A value may hold commas
    (PROPOSERS=draft_model,ngram,suffix): a piece without "=" continues the value before it,
    unless it reads as a setting's name (upper case), which lost its value."""
    env: dict[str, str] = {}
    name = None
    for piece in (item for item in text.split(",") if item):
        if "=" in piece and not piece.startswith("="):
            name, value = piece.split("=", 1)
            env[name] = value
        elif name is not None and "=" not in piece and not SETTING_NAME.fullmatch(piece):
            env[name] += f",{piece}"
        else:
            raise ValueError(f"expected NAME=VALUE,... got {text!r}")
    return env


def target_passes(answer: list[int], propose: Callable[[int], list[int]]) -> int:
    """Target passes to write `answer` where each pass, at position p, verifies the proposal
    `propose(p)` (the tokens guessed after answer[:p]): it emits the proposal's tokens up to
    the first wrong one, and one token of the target's own. Offline analyses' tokens per
    pass."""
    position = passes = 0
    while position < len(answer):
        accepted = 0
        for proposed, actual in zip(propose(position), answer[position:], strict=False):
            if proposed != actual:
                break
            accepted += 1
        position += accepted + 1
        passes += 1
    return passes


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def finish_axes(axes_and_titles, xlabel: str) -> None:
    """Log2 x axis, title, grid and legend on each (axis, title)."""
    for axis, title in axes_and_titles:
        axis.set_xscale("log", base=2)
        axis.set_xlabel(xlabel)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
