"""Every setting of the served models, declared once (SETTINGS): its environment variable,
its config.pbtxt parameter, the models that take it, its default, its parser and what it
means.

The launcher (specdec/server_config.py, also under docker compose and Kubernetes) parses
each variable that is set through its declaration, so a bad value is refused before the
server starts, and writes every declared parameter into the rendered model repository. The
models read each parameter through it again (`Setting.read`): a missing one is its default
(a plain tritonserver on model_repository/), a bad one fails the load. Every error starts
with the setting's name. docs/operations.md's settings table is this list:
`python -m specdec.serving.settings --markdown` prints it. Pure: no Triton import.

The keys and TLS files that lock Triton's own endpoints (TRITON_INFERENCE_KEY,
TRITON_ADMIN_KEY, GRPC_SSL_CERT, GRPC_SSL_KEY) are declared here too, with no model: they
become tritonserver options, checked before it runs by the same loop as the others; an
error about a key never repeats its value.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from specdec.engines.grammar import JSON_WHITESPACES
from specdec.engines.select import DTYPES, ENGINES
from specdec.loop.config import SchedulerConfig
from specdec.loop.proposers import REGISTRY

T = TypeVar("T")

# response_thread "auto" turns the outbox's thread on from this many usable cores: on 2 cores
# the server's work on the responses competes with the engine's threads
# (docs/benchmarks-archive.md, "2026-12-02 (third run)").
RESPONSE_THREAD_MIN_CORES = 4
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def parse_bool(name: str, value: str) -> bool:
    """A true/false setting."""
    text = value.strip().lower()
    if text not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return text in TRUE_WORDS


def parse_count(name: str, value: str, minimum: int) -> int:
    """An integer setting of at least `minimum`."""
    try:
        count = int(value.strip())
    except ValueError:
        count = minimum - 1
    if count < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return count


def parse_positive(name: str, value: str) -> int:
    """An integer setting of at least 1 (num_slots)."""
    return parse_count(name, value, 1)


def parse_max_context(name: str, value: str) -> int:
    """Positions per slot: at least a prompt token and the token it makes."""
    return parse_count(name, value, 2)


def parse_max_queue(name: str, value: str) -> int:
    """Requests that may wait for a slot; 0: none wait (a request without a slot is refused)."""
    return parse_count(name, value, 0)


def parse_bytes(name: str, value: str) -> int:
    """A size in bytes, 0 or more."""
    return parse_count(name, value, 0)


def one_of(*choices: str) -> Callable[[str, str], str]:
    """A parser of a setting that takes one of `choices`."""

    def parse(name: str, value: str) -> str:
        if value.strip() not in choices:
            raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
        return value.strip()

    return parse


def parse_device(name: str, value: str) -> str:
    """The torch engine's device: cpu, cuda or cuda:N."""
    if not DEVICE_PATTERN.fullmatch(value.strip()):
        raise ValueError(f"{name}: expected cpu, cuda or cuda:N, got {value!r}")
    return value.strip()


def parse_checkpoint(name: str, value: str) -> str:
    """A checkpoint path (a folder or a .gguf file); relative paths are the project root's."""
    if not value.strip():
        raise ValueError(f"{name}: expected a checkpoint path, got {value!r}")
    return value.strip()


def parse_engine_dir(name: str, value: str) -> str:
    """An exported engine's folder; "" (the default): built on demand under .run/engines."""
    return value.strip()


def parse_default_k(name: str, value: str) -> int | None:
    """k for requests that send no num_draft_tokens: "adaptive" (None: the cost model
    chooses) or a fixed k >= 0."""
    if value.strip().lower() == "adaptive":
        return None
    try:
        return parse_count(name, value, 0)
    except ValueError:
        raise ValueError(f"{name}: expected adaptive or an integer >= 0, got {value!r}") from None


def parse_proposers(name: str, value: str) -> tuple[str, ...]:
    """Comma-separated proposer names (specdec/loop/proposers/), in order of preference;
    "": none (no speculation)."""
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [part for part in names if part not in REGISTRY]
    if unknown or len(set(names)) < len(names):
        raise ValueError(
            f"{name}: expected distinct names from {', '.join(REGISTRY)}, got {value!r}"
        )
    return names


def parse_match_lengths(name: str, value: str) -> tuple[int, ...]:
    """Prompt lookup's match lengths (specdec/loop/proposers/ngram.py): positive integers,
    longest first ("3,2,1")."""
    try:
        lengths = tuple(int(part) for part in value.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1 or list(lengths) != sorted(set(lengths), reverse=True):
        raise ValueError(
            f"{name}: expected positive integers, longest first (as 3,2,1), got {value!r}"
        )
    return lengths


def parse_stream_interval(name: str, value: str) -> int:
    """The server's default stream_interval: output tokens a streamed sequence gathers
    between two responses (1: one response per iteration that added text)."""
    return parse_count(name, value, 1)


def parse_calibration_seconds(name: str, value: str) -> float:
    """The start-up cost measurement's budget in seconds (specdec/loop/calibration.py);
    0 turns it off."""
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ValueError(f"{name}: expected seconds >= 0, got {value!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{name}: expected seconds >= 0, got {value!r}")
    return seconds


def parse_prefix_cache(name: str, value: str) -> bool:
    """prefix_cache: on (the default) or off: whether prompts reuse cached or running
    sequences' caches (specdec/loop/prefix_cache.py)."""
    text = value.strip().lower()
    if text not in ("on", "off") + TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"{name}: expected on or off, got {value!r}")
    return text == "on" or text in TRUE_WORDS


def parse_prefix_min_tokens(name: str, value: str) -> int:
    """The shortest prefix worth reusing, in tokens."""
    return parse_count(name, value, 1)


def parse_prefill_chunk(name: str, value: str) -> int | None:
    """Prompt tokens prefilled per step for prompts that join in chunks; 0: none do (every
    prompt prefills whole in its first step)."""
    return parse_count(name, value, 0) or None


def parse_auto_bool(name: str, value: str) -> bool | None:
    """true, false, or auto (None: decided where the setting is used: RESPONSE_THREAD by the
    usable cores, CUDA_GRAPHS by specdec/engines/select.py resolve_cuda_graphs)."""
    if value.strip().lower() == "auto":
        return None
    try:
        return parse_bool(name, value)
    except ValueError:
        raise ValueError(f"{name}: expected auto, true or false, got {value!r}") from None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def decide_response_thread(setting: bool | None, cores: int) -> tuple[bool, str]:
    """Whether the outbox sends on its own thread, and why (for the start-up log)."""
    if setting is not None:
        return setting, f"response_thread {str(setting).lower()} (set)"
    threaded = cores >= RESPONSE_THREAD_MIN_CORES
    comparison = ">=" if threaded else "<"
    return threaded, (
        f"response_thread auto: {'on' if threaded else 'off'} "
        f"({cores} usable cores {comparison} {RESPONSE_THREAD_MIN_CORES})"
    )


# -- access: the keys and TLS files of Triton's own endpoints (docs/operations.md, Security) --

# The value a committed example Secret carries (deploy/kubernetes/base/secret.yaml): refused,
# so a deployment that was not given a key of its own does not start with a public one.
EXAMPLE_KEY = "replace-with-a-random-key"
PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n(.*?)-----END \1-----", re.DOTALL)
PRIVATE_KEY_LABELS = (b"PRIVATE KEY", b"RSA PRIVATE KEY", b"EC PRIVATE KEY")


def parse_header_key(name: str, value: str) -> str:
    """A key Triton compares with a request header (`inference-key`, `admin-key`): printable
    ASCII without spaces, as HTTP and gRPC headers carry it. Errors never repeat the value."""
    if not all("!" <= c <= "~" for c in value) or not value:
        raise ValueError(f"{name}: expected printable ASCII without spaces (value not shown)")
    if value == EXAMPLE_KEY:
        raise ValueError(f"{name}: still the committed example value; set a random key")
    return value


def pem_labels(name: str, path: str) -> list[bytes]:
    """The labels of the PEM blocks in a file (CERTIFICATE, PRIVATE KEY, ...), each block's
    base64 body checked; an unreadable file or one without a PEM block names the setting."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{name}: cannot read {path}: {error.strerror or error}") from None
    labels = []
    for label, body in PEM_BLOCK.findall(data):
        try:
            base64.b64decode(b"".join(body.split()), validate=True)
        except binascii.Error:
            message = f"{name}: {path}: a {label.decode()} block that is not base64"
            raise ValueError(message) from None
        labels.append(label)
    if not labels:
        raise ValueError(f"{name}: {path} is not a PEM file")
    return labels


def parse_certificate_file(name: str, value: str) -> Path:
    """A PEM file with a certificate (Triton's gRPC certificate and its chain)."""
    if b"CERTIFICATE" not in pem_labels(name, value):
        raise ValueError(f"{name}: {value} holds no PEM certificate")
    return Path(value)


def parse_private_key_file(name: str, value: str) -> Path:
    """A PEM file with an unencrypted private key (tritonserver takes no passphrase)."""
    labels = pem_labels(name, value)
    if b"ENCRYPTED PRIVATE KEY" in labels:
        raise ValueError(f"{name}: {value} is encrypted; tritonserver needs it unencrypted")
    if not any(label in PRIVATE_KEY_LABELS for label in labels):
        raise ValueError(f"{name}: {value} holds no PEM private key")
    return Path(value)


# -- the declarations ------------------------------------------------------------------------

BLS_MODEL, PREPROCESSING = "speculative_decoding", "preprocessing"
# Not a model setting: the launcher tells the BLS's process how long running streams may
# finish once the server stops (ServerConfig.drain_s); unset, DRAIN_S of bls_model.py.
DRAIN_VARIABLE = "SPECDEC_DRAIN_S"
# The engines live in the BLS's process (one process, one CUDA context): their settings are
# its parameters. draft_model and target_model only forward calls to it.


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting. `default` is its value as config.pbtxt text; `gpu_default` the value
    docker-compose.yml and deploy/kubernetes/ give it on GPU hosts, where that differs. The
    access settings have no parameter and no model (key "", default "": unset)."""

    variable: str  # the environment variable
    key: str  # the config.pbtxt parameter
    models: tuple[str, ...]  # the models whose config.pbtxt takes it
    default: str
    parse: Callable[[str, str], T]  # (name, text) -> value; ValueError "name: ..."
    doc: str  # one line: what it means
    gpu_default: str | None = None
    empty_is_value: bool = False  # "" is a value (no proposers), not "unset"

    def read(self, parameters: Mapping[str, str]) -> T:
        """Its value among a model's config.pbtxt parameters, the default where missing;
        a bad one raises ValueError naming the parameter and the variable."""
        if not self.models:
            raise TypeError(f"{self.variable} is no model parameter")
        return self.parse(f"{self.key} ({self.variable})", parameters.get(self.key, self.default))

    def from_env(self, env: Mapping[str, str]) -> str | None:
        """The variable's text, checked, when it is set (not empty, unless "" is a value)."""
        text = env.get(self.variable)
        if text is None or (text == "" and not self.empty_is_value):
            return None
        self.parse(self.variable, text)
        return text

    @property
    def deployed_default(self) -> str:
        """What docker-compose.yml and deploy/kubernetes/ should set it to."""
        return self.default if self.gpu_default is None else self.gpu_default


def loop_default(field_name: str) -> str:
    """SchedulerConfig's default of a field, as config.pbtxt text: the loop owns these."""
    value = getattr(SchedulerConfig, field_name)
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


TARGET_CHECKPOINT = Setting(
    "TARGET_CHECKPOINT",
    "checkpoint",
    (PREPROCESSING, BLS_MODEL),
    "models/smollm2-135m-instruct",
    parse_checkpoint,
    "the target: a Hugging Face Llama-family folder or a .gguf file (relative: to the "
    "project root); the BLS runs it, and preprocessing takes its tokenizer",
)
DRAFT_CHECKPOINT = Setting(
    "DRAFT_CHECKPOINT",
    "draft_checkpoint",
    (BLS_MODEL,),
    "models/smollm2-135m-draft",
    parse_checkpoint,
    "the draft, with the target's tokenizer",
)
ENGINE = Setting(
    "ENGINE",
    "engine",
    (BLS_MODEL,),
    "torch",
    one_of(*ENGINES),
    "`torch`, `onnxruntime` or `tensorrt` (GPU) (`specdec/engines/select.py`)",
)
DEVICE = Setting(
    "DEVICE",
    "device",
    (BLS_MODEL,),
    "cpu",
    parse_device,
    "the torch engine's device: `cpu`, `cuda` or `cuda:N`",
    gpu_default="cuda",
)
DTYPE = Setting(
    "DTYPE",
    "dtype",
    (BLS_MODEL,),
    "float32",
    one_of(*DTYPES),
    "`float32`, `bfloat16`, `float16` (CUDA) or `auto`: bfloat16 where the CPU or GPU has "
    "it, else float32 (CPU) or float16 (GPU); `make serve` sets `auto`",
    gpu_default="auto",
)
CUDA_GRAPHS = Setting(
    "CUDA_GRAPHS",
    "cuda_graphs",
    (BLS_MODEL,),
    "auto",
    parse_auto_bool,
    "`true`: the torch engine on CUDA replays its calls as CUDA graphs; `auto`: on where "
    "the torch engine runs on CUDA",
)
DRAFT_ENGINE_DIR = Setting(
    "DRAFT_ENGINE_DIR",
    "draft_engine_dir",
    (BLS_MODEL,),
    "",
    parse_engine_dir,
    "onnxruntime, tensorrt: the draft's exported graph or plan; empty: built on demand "
    "under `.run/engines/<checkpoint folder>/` (`make engines` builds them ahead)",
)
TARGET_ENGINE_DIR = Setting(
    "TARGET_ENGINE_DIR",
    "target_engine_dir",
    (BLS_MODEL,),
    "",
    parse_engine_dir,
    "the same for the target",
)
NUM_SLOTS = Setting(
    "NUM_SLOTS",
    "num_slots",
    (BLS_MODEL,),
    "64",
    parse_positive,
    "KV-cache slots of each engine: the most sequences running at once",
)
MAX_CONTEXT = Setting(
    "MAX_CONTEXT",
    "max_context",
    (BLS_MODEL,),
    "2048",
    parse_max_context,
    "positions per slot (prompt + output)",
)
PROPOSERS = Setting(
    "PROPOSERS",
    "proposers",
    (BLS_MODEL,),
    loop_default("proposer_names"),
    parse_proposers,
    "where draft tokens come from, in order of preference: `draft_model` (the draft model), "
    "`ngram` (prompt lookup, no model call), `suffix` (earlier requests' text and the row's "
    "own, no model call), `grammar` (what a guided row's grammar writes itself, then prompt "
    'lookup; no model call); `""`: no speculation',
    empty_is_value=True,
)
GUIDED_JSON_WHITESPACE = Setting(
    "GUIDED_JSON_WHITESPACE",
    "guided_json_whitespace",
    (BLS_MODEL,),
    "compact",
    one_of(*JSON_WHITESPACES),
    "whitespace in guided JSON (`json`, `json_schema`, OpenAI `response_format`): `compact` "
    '(`{"a": 1, "b": [2]}`: the grammar writes keys and punctuation itself, the grammar '
    "proposer offers them) or `any` (any spaces and newlines between JSON tokens)",
)
DEFAULT_NUM_DRAFT_TOKENS = Setting(
    "DEFAULT_NUM_DRAFT_TOKENS",
    "default_num_draft_tokens",
    (BLS_MODEL,),
    "adaptive",
    parse_default_k,
    "k for requests that send no `num_draft_tokens`: `adaptive` (the cost model chooses) or "
    "a fixed number",
)
NGRAM_MATCH_LENGTHS = Setting(
    "NGRAM_MATCH_LENGTHS",
    "ngram_match_lengths",
    (BLS_MODEL,),
    loop_default("ngram_match_lengths"),
    parse_match_lengths,
    "prompt lookup's suffix lengths, tried longest first (a longer match is a surer guess)",
)
SUFFIX_STORE_BYTES = Setting(
    "SUFFIX_STORE_BYTES",
    "suffix_store_bytes",
    (BLS_MODEL,),
    loop_default("suffix_store_bytes"),
    parse_bytes,
    "the suffix proposer's store of earlier requests' text, in bytes; the oldest text is "
    "evicted first",
)
MAX_QUEUE = Setting(
    "MAX_QUEUE",
    "max_queue",
    (BLS_MODEL,),
    loop_default("max_queue"),
    parse_max_queue,
    "requests waiting for a slot; beyond it a request is refused at once (UNAVAILABLE)",
)
PREFIX_CACHE = Setting(
    "PREFIX_CACHE",
    "prefix_cache",
    (BLS_MODEL,),
    "on",
    parse_prefix_cache,
    "`on`: a prompt starts from a cached or running sequence's caches where it shares their "
    "first tokens; `off`: every prompt is prefilled whole",
)
PREFIX_MIN_TOKENS = Setting(
    "PREFIX_MIN_TOKENS",
    "prefix_min_tokens",
    (BLS_MODEL,),
    loop_default("prefix_min_tokens"),
    parse_prefix_min_tokens,
    "the shortest prefix reused, in tokens",
)
PREFILL_CHUNK = Setting(
    "PREFILL_CHUNK",
    "prefill_chunk",
    (BLS_MODEL,),
    loop_default("prefill_chunk"),
    parse_prefill_chunk,
    "prompt tokens prefilled per step for prompts longer than this, which join in chunks "
    "beside the running rows; 0: every prompt prefills whole",
)
STREAM_INTERVAL = Setting(
    "STREAM_INTERVAL",
    "stream_interval",
    (BLS_MODEL,),
    "1",
    parse_stream_interval,
    "output tokens a streamed sequence gathers between responses (its first and final "
    "ones go at once); a request's `stream_interval` input overrides it",
)
RESPONSE_THREAD = Setting(
    "RESPONSE_THREAD",
    "response_thread",
    (BLS_MODEL,),
    "auto",
    parse_auto_bool,
    "`true`: responses go out on a thread beside the loop; `false`: the loop sends them; "
    f"`auto`: on with {RESPONSE_THREAD_MIN_CORES} or more usable cores",
)
CALIBRATION_SECONDS = Setting(
    "CALIBRATION_SECONDS",
    "calibration_seconds",
    (BLS_MODEL,),
    "5",
    parse_calibration_seconds,
    "seconds spent measuring the engines' costs before the first request; 0: none",
)
TRITON_INFERENCE_KEY = Setting(
    "TRITON_INFERENCE_KEY",
    "",
    (),
    "",
    parse_header_key,
    "inference, metadata, model-config and statistics need the header `inference-key` "
    "(Security, below)",
)
TRITON_ADMIN_KEY = Setting(
    "TRITON_ADMIN_KEY",
    "",
    (),
    "",
    parse_header_key,
    "the model-repository, shared-memory, trace and logging APIs need the header `admin-key`",
)
GRPC_SSL_CERT = Setting(
    "GRPC_SSL_CERT",
    "",
    (),
    "",
    parse_certificate_file,
    "with `GRPC_SSL_KEY`: gRPC over TLS; a PEM certificate (and its chain)",
)
GRPC_SSL_KEY = Setting(
    "GRPC_SSL_KEY",
    "",
    (),
    "",
    parse_private_key_file,
    "the certificate's PEM private key, unencrypted",
)
SETTINGS: tuple[Setting, ...] = (
    TARGET_CHECKPOINT,
    DRAFT_CHECKPOINT,
    ENGINE,
    DEVICE,
    DTYPE,
    CUDA_GRAPHS,
    DRAFT_ENGINE_DIR,
    TARGET_ENGINE_DIR,
    NUM_SLOTS,
    MAX_CONTEXT,
    PROPOSERS,
    GUIDED_JSON_WHITESPACE,
    DEFAULT_NUM_DRAFT_TOKENS,
    NGRAM_MATCH_LENGTHS,
    SUFFIX_STORE_BYTES,
    MAX_QUEUE,
    PREFIX_CACHE,
    PREFIX_MIN_TOKENS,
    PREFILL_CHUNK,
    STREAM_INTERVAL,
    RESPONSE_THREAD,
    CALIBRATION_SECONDS,
    TRITON_INFERENCE_KEY,
    TRITON_ADMIN_KEY,
    GRPC_SSL_CERT,
    GRPC_SSL_KEY,
)
BY_VARIABLE = {setting.variable: setting for setting in SETTINGS}


def model_settings(model: str) -> list[Setting]:
    """The settings a model's config.pbtxt takes."""
    return [setting for setting in SETTINGS if model in setting.models]


def markdown_table() -> str:
    """SETTINGS as docs/operations.md's table."""

    def code(text: str) -> str:
        return f"`{text}`" if text else '`""`'

    lines = [
        "| variable | config.pbtxt parameter: models | default | GPU hosts | meaning |",
        "|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        where, default = "none: a tritonserver option", "unset"
        if setting.models:
            where = f"{code(setting.key)}: {', '.join(setting.models)}"
            default = code(setting.default)
        gpu = "" if setting.gpu_default is None else code(setting.gpu_default)
        lines.append(f"| {code(setting.variable)} | {where} | {default} | {gpu} | {setting.doc} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="The served models' settings.")
    parser.add_argument("--markdown", action="store_true", help="print docs/operations.md's table")
    args = parser.parse_args()
    if not args.markdown:
        parser.error("say what to print: --markdown")
    print(markdown_table(), end="")


if __name__ == "__main__":
    main()
