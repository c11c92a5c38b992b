"""Planted bugs the loop's tests must catch.

Each mutant is one edit to a copy of the project (specdec/, build/, tests/,
model_repository/, loadtest/, pyproject.toml; the models are linked); the tests named for it
then run on the copy and must fail. A mutant whose tests pass is a bug the suite would let through.

    .venv/bin/python tests/mutations/run.py              # every mutant (make mutations)
    .venv/bin/python tests/mutations/run.py --list
    .venv/bin/python tests/mutations/run.py bonus-position target-cache-length
    .venv/bin/python tests/mutations/run.py --all-tests  # run every named test, not -x

It first runs the tests on an unchanged copy: a failure there makes every verdict void.
Exit status: 0 when every mutant was caught.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# The tests that guard the loop, fastest first (-x stops at the first failure).
UNIT = ("tests/test_verify.py", "tests/test_scheduler.py")
PREFIX = ("tests/test_prefix_cache.py",)
REAL = ("tests/test_loop_engines.py",)
ECONOMICS = ("tests/test_economics.py", "tests/test_calibration.py")
TOOL_CALLS = "tests/test_tool_calls.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...] = (*UNIT, *REAL)


MUTANTS = [
    Mutant(
        "accepted-count",
        "verification keeps the first proposed token that differs from the target's",
        "specdec/loop/verify.py",
        "emitted = list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]]",
        "emitted = list(draft_token_ids[: num_accepted + 1]) + [target_token_ids[num_accepted]]",
    ),
    Mutant(
        "bonus-position",
        "the bonus token taken from the last proposal's position",
        "specdec/loop/verify.py",
        "emitted = list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]]",
        "emitted = list(draft_token_ids[:num_accepted]) + "
        "[target_token_ids[min(num_accepted, max(len(draft_token_ids) - 1, 0))]]",
    ),
    Mutant(
        "target-noise-position",
        "the target keys a token's noise by the position before it (the draft does not)",
        "specdec/engines/calls.py",
        "positions = fed[rows] + steps + 1",
        "positions = fed[rows] + steps",
        tests=(*REAL,),
    ),
    Mutant(
        "sequence-seed",
        "a row's noise seed changes with its output length",
        "specdec/loop/sequence.py",
        "seeds=np.array([s.seed for s in rows], dtype=np.int64)",
        "seeds=np.array([s.seed + s.num_output_tokens for s in rows], dtype=np.int64)",
    ),
    Mutant(
        "target-cache-length",
        "the target cache is taken to hold the newest token, which was never fed",
        "specdec/loop/sequence.py",
        "self.target_cache_length = len(self.token_ids) - 1",
        "self.target_cache_length = len(self.token_ids)",
    ),
    Mutant(
        "target-cache-rollback",
        "rejected draft tokens stay in the target cache (no rollback)",
        "specdec/loop/scheduler.py",
        "        sequence.committed()\n",
        # every position fed stays valid: the tokens before the step, and all k proposals
        "        sequence.committed()\n"
        "        sequence.target_cache_length += k - verdict.num_accepted\n",
    ),
    Mutant(
        "draft-cache-length",
        "the draft cache is taken to hold its last proposal, which was never fed",
        "specdec/loop/sequence.py",
        "self.draft_cache_length = len(self.token_ids) + max(num_proposed - 1, 0)",
        "self.draft_cache_length = len(self.token_ids) + num_proposed",
    ),
    Mutant(
        "end-token-missed",
        "the end token is seen only as the last token of a verdict",
        "specdec/loop/scheduler.py",
        "if token == request.end_id:",
        "if token == request.end_id and position == len(verdict.token_ids) - 1:",
    ),
    Mutant(
        "hindsight-dropped",
        "a probe's hindsight verdicts never reach the draft's acceptance",
        "specdec/loop/scheduler.py",
        "self.economics.observe_hindsight(_caller(plan, row), *proposal.hindsight)",
        "pass",
        tests=UNIT,
    ),
    Mutant(
        "prefill-booked-as-steady",
        "a step that admits a prompt is booked as what a decode step costs",
        "specdec/loop/scheduler.py",
        "steady = not admitted and not chunks",
        "steady = not chunks",
        tests=UNIT,
    ),
    Mutant(
        "shape-without-draft-steps",
        "a drafting step is booked as an iteration without a model call",
        "specdec/loop/scheduler.py",
        "model_steps=max(model_ks) if model_ks else None,",
        "model_steps=None,",
        tests=UNIT,
    ),
    Mutant(
        "idle-gap-booked",
        "the loop's wait for the next request is booked as the last step's cost",
        "specdec/loop/timing.py",
        "if last is not None and start - last.start < IDLE_GAP * last.busy:",
        "if last is not None:",
        tests=UNIT,
    ),
    Mutant(
        "lookup-verdict-key",
        "a lookup's verdict counts under every match length's window alike",
        "specdec/loop/economics.py",
        "self.window(ledger.key).observe(k, num_accepted)",
        "self.window(None).observe(k, num_accepted)",
        tests=ECONOMICS,
    ),
    Mutant(
        "lookup-priced-point-by-point",
        "a lookup's verify is priced by whole iterations as measured, though start-up has "
        "measured the target (their many-token points go stale as contexts grow)",
        "specdec/loop/economics.py",
        "if self.target.calibrated:",
        "if False:",
        tests=ECONOMICS,
    ),
    Mutant(
        "host-work-unpriced",
        "a lookup's verify is priced by the target call alone, without the loop's own work",
        "specdec/loop/economics.py",
        "return None if seconds is None else seconds + host(batch_size, num_tokens)",
        "return seconds",
        tests=ECONOMICS,
    ),
    Mutant(
        "ragged-call-raises-level",
        "a ragged verify's widths are booked into the target's level as well as priced apart",
        "specdec/loop/economics.py",
        "seconds = call.seconds - self.costs.widths(call.num_rows, call.num_widths)",
        "seconds = call.seconds",
        tests=ECONOMICS,
    ),
    Mutant(
        "cold-prior-weight",
        "the draft's cold prior weighs one verdict instead of half a probe's",
        "specdec/loop/economics.py",
        "AcceptanceWindow(max_k, cold_weight=COLD_PROBES * verdicts_per_probe)",
        "AcceptanceWindow(max_k, cold_weight=COLD_PROBES)",
        tests=ECONOMICS,
    ),
    Mutant(
        "probe-budget-ignored",
        "probes come every PROBE_EVERY iterations however dear they are",
        "specdec/loop/economics.py",
        "return max(PROBE_EVERY, math.ceil(extra / (PROBE_BUDGET * plain)))",
        "return PROBE_EVERY",
        tests=ECONOMICS,
    ),
    Mutant(
        "request-outcome-order",
        "a request with one answer cut at max_tokens counts as ended by its end token",
        "specdec/serving/metric_names.py",
        "return next(outcome for outcome in NORMAL_ENDS if outcome in reasons)",
        "return next(outcome for outcome in reversed(NORMAL_ENDS) if outcome in reasons)",
        # the rule alone: the copy has no docs/ for the file's other tests
        tests=(
            "tests/test_metric_names.py::test_a_finished_request_counts_under_its_most_truncating_reason",
        ),
    ),
    Mutant(
        "setting-not-passed",
        "the BLS reads NGRAM_MATCH_LENGTHS but leaves the loop its own default",
        "specdec/serving/bls_model.py",
        "ngram_match_lengths=settings.NGRAM_MATCH_LENGTHS.read(params),",
        "ngram_match_lengths=SchedulerConfig.ngram_match_lengths,",
        tests=("tests/test_settings.py::test_the_bls_builds_its_loop_from_its_settings",),
    ),
    Mutant(
        "suffix-store-ignores-salt",
        "the suffix store proposes to a row from every salt's text",
        "specdec/loop/suffix_store.py",
        "index = self.indexes.get(salt)",
        "index = next(iter(self.indexes.values()), None)",
        tests=("tests/test_suffix.py",),
    ),
    Mutant(
        "suffix-eviction-keeps-counts",
        "evicting a document from the suffix store leaves its counts in the tables",
        "specdec/loop/suffix_store.py",
        "                index.remove(text, end)",
        "                pass",
        tests=("tests/test_suffix.py",),
    ),
    Mutant(
        "control-misses-proposals",
        "a penalty at a verified position counts the row's cache and pending token but not the"
        " proposals before that position",
        "specdec/engines/controls.py",
        "written(row)[: position - cache_length]",
        "written(row)[: min(position - cache_length, 1)]",
        tests=("tests/test_controls.py",),
    ),
    Mutant(
        "control-counts-own-token",
        "a penalty at a verified position counts the token at that position too",
        "specdec/engines/controls.py",
        "written(row)[: position - cache_length]",
        "written(row)[: position - cache_length + 1]",
        tests=("tests/test_controls.py",),
    ),
    Mutant(
        "guide-misses-first-output-token",
        "a guided row's grammar reads its output from the second token on",
        "specdec/engines/controls.py",
        "output = tokens[max(start - first, 0) :].tolist()",
        "output = tokens[max(start - first + 1, 0) :].tolist()",
        tests=("tests/test_guided.py",),
    ),
    Mutant(
        "grammar-proposes-a-choice",
        "the grammar proposer proposes the first allowed token where the grammar allows several",
        "specdec/engines/grammar.py",
        "if len(nonzero) != 1 or words[nonzero[0]] & (words[nonzero[0]] - np.uint32(1)):",
        "if len(nonzero) == 0:",
        tests=("tests/test_guided.py",),
    ),
    Mutant(
        "stop-word-lookback-short",
        "stop words look back len(word) - 2 characters: a word whose last character alone is new"
        " goes unseen",
        "specdec/text/detokenizer.py",
        "tail_start = len(self.text) - max(len(w) for w in self.stop_words)",
        "tail_start = len(self.text) - (max(len(w) for w in self.stop_words) - 2)",
        tests=("tests/test_detokenizer.py",),
    ),
    Mutant(
        "padding-writes-real-positions",
        "a padded call's padding tokens write the first positions of their slots",
        "specdec/engines/graphs.py",
        "return torch.where(real, own, self.engine.max_length + steps).reshape(-1)",
        "return torch.where(real, own, steps).reshape(-1)",
        tests=("tests/test_call_graphs.py",),
    ),
    Mutant(
        "draft-steps-past-num-steps",
        "a padded draft call feeds rows past their num_steps at real positions",
        "specdec/engines/graphs.py",
        "at = torch.where(active, base + step - 1, engine.max_length)",
        "at = base + step - 1",
        tests=("tests/test_call_graphs.py",),
    ),
    Mutant(
        "cache-spare-uncounted",
        "the torch engine keeps one more spare position per slot than the memory check counts",
        "specdec/engines/llama.py",
        "super().__init__(config, num_slots, max_length + SPARE_POSITIONS, dtype, self.device)",
        "super().__init__(config, num_slots, max_length + SPARE_POSITIONS + 1, dtype, self.device)",
        tests=("tests/test_memory.py::test_counts_equal_a_real_engines_tensors",),
    ),
    Mutant(
        "llmapi-stop-word-kept",
        "an LLM-API answer ended by a stop string keeps it",
        "specdec/text/llmapi.py",
        "    return text[:start], word\n",
        "    return text, word\n",
        tests=("tests/test_llmapi_schema.py",),
    ),
    Mutant(
        "llmapi-field-unrenamed",
        "a refusal of an LLM-API request names the ensemble's field (max_tokens)",
        "specdec/text/llmapi.py",
        '        return f"{ENSEMBLE_TO_LLMAPI[field]}: {rest}"\n',
        "        return message\n",
        tests=("tests/test_llmapi_schema.py",),
    ),
    Mutant(
        "stop-request-key-ignored",
        "a stop_request_key finds the open request but the loop never ends it",
        "specdec/serving/bls_model.py",
        "            self.stopped += found\n",
        "",
        tests=("tests/test_llmapi.py::test_stop_ends_the_running_request_of_its_id",),
    ),
    Mutant(
        "prefix-key-unsalted",
        "a cached prefix is indexed by its tokens alone: another tenant's request adopts it",
        "specdec/loop/prefix_cache.py",
        "return salt, tuple(token_ids[: self.min_tokens])",
        'return "", tuple(token_ids[: self.min_tokens])',
        tests=PREFIX,
    ),
    Mutant(
        "prefix-running-unsalted",
        "a lookup copies from a running sequence whatever the salt of its request",
        "specdec/loop/prefix_cache.py",
        "            if sequence.request.cache_salt != salt:\n                continue\n",
        "",
        tests=PREFIX,
    ),
    Mutant(
        "openai-body-salt-raw",
        "with API keys, a request's own cache_salt goes to Triton: any tenant may name another's",
        "specdec/openai_api/app.py",
        "cache_salt = backend.config.keys.cache_salt(key_digest, body.cache_salt)",
        "cache_salt = body.cache_salt",
        tests=("tests/test_openai_auth.py::test_each_key_reaches_triton_with_its_own_cache_salt",),
    ),
    Mutant(
        "tool-call-no-hold-back",
        "streamed text that may begin a <tool_call> block goes out as content at once",
        "specdec/openai_api/tool_calls.py",
        "held = overlap_with_start(self._pending, CALL_OPEN)",
        "held = 0",
        tests=(TOOL_CALLS,),
    ),
    Mutant(
        "tool-call-braces-in-strings",
        "a brace inside a JSON string of a call's arguments counts as nesting",
        "specdec/openai_api/tool_calls.py",
        "            elif char == '\"':\n                self.in_string = True\n",
        "",
        tests=(TOOL_CALLS,),
    ),
    Mutant(
        "tool-choice-required-free-text",
        'tool_choice "required" lets the model answer in text (at_least_one left out)',
        "specdec/openai_api/structured.py",
        'calls["at_least_one"] = True',
        "pass",
        tests=("tests/test_structured_output.py::test_tool_guides_compile_and_constrain",),
    ),
    Mutant(
        "finish-reason-cut-call",
        'finish_reason "tool_calls" for an answer whose last call was cut',
        "specdec/openai_api/tool_calls.py",
        "return bool(self.calls) and all(call.complete for call in self.calls)",
        "return bool(self.calls)",
        tests=("tests/test_structured_output.py::test_a_cut_call_says_why_it_ended",),
    ),
    Mutant(
        "agentic-modes-share-tasks",
        "bench's modes walk the agentic tasks without parts of their own: a prompt sent twice",
        "loadtest/bench.py",
        "self.concurrency, self.render, self.part_of)",
        "self.concurrency, self.render)",
        tests=("tests/test_agentic.py::test_no_prompt_is_sent_twice_in_a_bench_run_of_agentic",),
    ),
    Mutant(
        "agentic-warm-up-repeats",
        "bench's warm-up sends the first task of part 0, which the first mode then sends again",
        "loadtest/bench.py",
        "warm_up = render(workload.first_request(next(parts)))\n        generate(warm_up, url,",
        "warm_up = render(workload.first_request())\n        generate(warm_up, url,",
        tests=("tests/test_agentic.py::test_no_prompt_is_sent_twice_in_a_bench_run_of_agentic",),
    ),
    Mutant(
        "itl-once-per-commit",
        "the inter-token histogram observes a commit of n tokens once, not once per token",
        "specdec/serving/histograms.py",
        "itl.observe(gap / num_emitted, num_emitted)",
        "itl.observe(gap / num_emitted)",
        tests=("tests/test_histograms.py",),
    ),
    Mutant(
        "ttft-from-the-slot",
        "time to first token counted from the slot, not from the arrival",
        "specdec/serving/histograms.py",
        "observe((times.first_token_ns - times.arrival_ns) * NS)",
        "observe((times.first_token_ns - times.first_scheduled_ns) * NS)",
        tests=("tests/test_histograms.py",),
    ),
    Mutant(
        "bucket-le-exclusive",
        "a value equal to a bucket's bound counted in the bucket above (le is value <= bound)",
        "specdec/serving/histograms.py",
        "self._counts[bisect_left(self.bounds, value)] += times",
        "self._counts[bisect_left(self.bounds, value) + (value in self.bounds)] += times",
        tests=("tests/test_histograms.py",),
    ),
]


def copy_project(into: Path) -> None:
    # tests import build/ and loadtest/
    for name in ("specdec", "build", "tests", "model_repository", "loadtest"):
        shutil.copytree(
            PROJECT_ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(PROJECT_ROOT / "pyproject.toml", into / "pyproject.toml")
    (into / "models").symlink_to(PROJECT_ROOT / "models")


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    found = text.count(mutant.old)
    if found != 1:
        raise SystemExit(f"{mutant.name}: expected its text once in {mutant.path}, found {found}")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(root: Path, tests: tuple[str, ...], stop_first: bool) -> tuple[int, list[str], float]:
    """pytest on the copy (its specdec/ first on the path); the exit code, the failed
    tests and the seconds it took."""
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    if stop_first:
        command.insert(3, "-x")
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.monotonic()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.MULTILINE)
    return done.returncode, failed, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--all-tests", action="store_true", help="run every test, not -x")
    args = parser.parse_args()
    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:24} {mutant.path}: {mutant.what}")
        return 0
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        baseline = Path(scratch) / "baseline"
        copy_project(baseline)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, failed, seconds = run_tests(baseline, tests, stop_first=False)
        if code != 0:
            print(f"the unchanged copy fails ({code}): {failed}; no verdict", file=sys.stderr)
            return 2
        print(f"unchanged: {len(tests)} test files pass ({seconds:.0f} s)", flush=True)
        survived = []
        for mutant in chosen:
            root = Path(scratch) / mutant.name
            copy_project(root)
            apply(mutant, root)
            code, failed, seconds = run_tests(root, mutant.tests, not args.all_tests)
            if code == 1 and failed:
                verdict = f"caught by {', '.join(failed)}"
            elif code == 0:
                verdict, survived = "SURVIVED: every test passed", survived + [mutant.name]
            else:
                verdict, survived = f"void: pytest exited {code}", survived + [mutant.name]
            print(f"{mutant.name:24} {seconds:5.0f} s  {verdict}", flush=True)
            shutil.rmtree(root)
    if survived:
        print(f"not caught: {', '.join(survived)}", file=sys.stderr)
        return 1
    print(f"all {len(chosen)} mutants caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
