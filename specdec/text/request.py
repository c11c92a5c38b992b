"""A generation request: the public inputs, parsed and validated, with no Triton types.

Input names follow TensorRT-LLM's ensemble so existing clients and genai-perf work
unchanged. Every error names the field it is about.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class InvalidInput(ValueError):
    """A request input is missing or out of range; the message starts with the field name."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


# TensorRT-LLM inputs we accept only at their neutral value: name -> neutral value.
# (length_penalty scores beams: beam search is not served.)
NEUTRAL_INPUTS: dict[str, float] = {"length_penalty": 1.0}
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_BIASES = 1024  # token biases per request (logit_bias, embedding_bias_words)
MAX_BAD_WORDS = 256
MAX_CACHE_SALT = 256  # characters of a cache_salt
# A prompt_ignore_length past any prompt: presence and frequency count the output only (the
# OpenAI API's counting).
OUTPUT_ONLY = 2**31 - 1
# Inputs whose feature is not implemented: they must be false or absent.
UNSUPPORTED_FLAGS = (
    "return_context_logits",
    "return_generation_logits",
    "use_draft_logits",
)


GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
GUIDE_TYPE_FIELD = "guided_decoding_guide_type"
GUIDE_FIELD = "guided_decoding_guide"
MAX_GUIDE_CHARS = 1 << 16  # a schema, regex or grammar of at most 64 Ki characters


@dataclass(frozen=True)
class Guide:
    """What a request's output must follow (specdec/engines/grammar.py): one of GUIDE_TYPES
    and its text (a JSON schema, a regex, an EBNF grammar, a structural tag; "" for json)."""

    type: str
    text: str = ""

    @property
    def pair(self) -> tuple[str, str]:
        """(type, text): the guide as the engines take it (specdec/engines/grammar.py)."""
        return self.type, self.text


@dataclass
class GenerationRequest:
    prompt: str | None  # text_input; None when the client sent input_ids
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    end_id: int = -1
    stop_words: list[str] = field(default_factory=list)
    # Logit controls (specdec/engines/controls.py; docs/api.md says what each counts).
    repetition_penalty: float = 1.0  # over the prompt and the output
    presence_penalty: float = 0.0  # over the tokens after the first prompt_ignore_length
    frequency_penalty: float = 0.0
    prompt_ignore_length: int = 0  # prompt tokens presence and frequency do not count
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never produced
    guide: Guide | None = None  # what the output must follow (guided decoding)
    num_draft_tokens: int | None = None  # the most draft tokens per step; None: the server's
    fixed_num_draft_tokens: bool = False  # True: exactly num_draft_tokens (benchmarks, tests)
    # The proposers it may use, of the server's (specdec/loop/proposers/); (): all of them.
    proposers: tuple[str, ...] = ()
    # Text stored or cached under one salt is never proposed to, or reused by, a request
    # with another (the suffix store, the prefix cache); "" is a salt like any other.
    cache_salt: str = ""
    stream: bool = False
    stream_interval: int = 1  # streamed: output tokens gathered between responses
    exclude_input_in_output: bool = False
    num_return_sequences: int = 1  # independent sequences from this prompt
    batch_index: int = 0  # the prompt's row in its Triton request
    return_log_probs: bool = False
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def occurrence_start(self) -> int:
        """The first sequence position presence and frequency count."""
        return min(self.prompt_ignore_length, len(self.prompt_ids))

    @property
    def has_logit_controls(self) -> bool:
        """Whether its logits are processed beyond temperature, top-k and top-p."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_p > 0.0
            or bool(self.logit_bias)
            or bool(self.bad_words_ids)
            or self.guide is not None
        )


def _scalar(inputs: dict[str, np.ndarray], name: str, kind: type, default=None):
    if name not in inputs:
        return default
    array = np.asarray(inputs[name])
    if array.size != 1:
        raise InvalidInput(name, f"expected one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if kind is bool:
        if array.dtype != np.bool_:
            raise InvalidInput(name, f"expected BOOL, got {array.dtype}")
        return bool(value)
    if kind is int:
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidInput(name, f"expected an integer tensor, got {array.dtype}")
        return int(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise InvalidInput(name, f"expected a float tensor, got {array.dtype}")
    return float(value)


def _strings(inputs: dict[str, np.ndarray], name: str) -> list[str]:
    if name not in inputs:
        return []
    array = np.asarray(inputs[name])
    if array.dtype != np.object_:
        raise InvalidInput(name, f"expected BYTES, got {array.dtype}")
    if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise InvalidInput(name, f"expected shape [1, n], got {list(array.shape)}")
    words = []
    for item in array.reshape(-1):
        try:
            word = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError as error:
            raise InvalidInput(name, "not valid UTF-8") from error
        if word:
            words.append(word)
    return words


def _array(inputs: dict[str, np.ndarray], name: str, kind: type) -> np.ndarray:
    """A [1, n] (or [n]) numeric input as a flat array; empty when absent."""
    if name not in inputs:
        return np.zeros(0, dtype=np.float64)
    array = np.asarray(inputs[name])
    wanted = np.integer if kind is int else np.floating
    if not np.issubdtype(array.dtype, wanted):
        expected = "an integer" if kind is int else "a float"
        raise InvalidInput(name, f"expected {expected} tensor, got {array.dtype}")
    if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise InvalidInput(name, f"expected shape [1, n], got {list(array.shape)}")
    return array.reshape(-1)


def _first_of(inputs: dict[str, np.ndarray], names: tuple[str, ...], kind: type, default):
    for name in names:
        if name in inputs:
            return name, _scalar(inputs, name, kind)
    return names[0], default


def parse_request(
    inputs: dict[str, np.ndarray],
    tokenize,
    max_context: int,
    max_draft_tokens: int,
    default_end_id: int,
    proposers: tuple[str, ...] = (),
    max_return_sequences: int = 64,
    default_stream_interval: int = 1,
    vocab_size: int | None = None,
    check_guide: Callable[[Guide], object] | None = None,
) -> GenerationRequest:
    """Builds a request from the input tensors of one prompt; raises InvalidInput naming
    the bad field.

    `tokenize(text) -> list[int]` is used when the client sends text_input without input_ids;
    `proposers` are the ones this server runs (specdec/loop/proposers/): a request may pick
    one of them; `default_stream_interval` is the server's for requests that send none;
    `vocab_size`, the target's, bounds the token ids a bias or a bad word may name;
    `check_guide` compiles a guide, raising ValueError where it is not valid (None: a
    guided request is refused).
    """
    prompt = None
    if "input_ids" in inputs:
        ids = np.asarray(inputs["input_ids"])
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidInput("input_ids", f"expected INT32, got {ids.dtype}")
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise InvalidInput("input_ids", f"one sequence per request, got {ids.shape[0]}")
        prompt_ids = ids.reshape(-1).tolist()
    if "text_input" in inputs:
        texts = np.asarray(inputs["text_input"])
        if texts.dtype != np.object_:
            raise InvalidInput("text_input", f"expected BYTES, got {texts.dtype}")
        if texts.size != 1:
            raise InvalidInput(
                "text_input", f"one prompt per request, got shape {list(texts.shape)}"
            )
        raw = texts.reshape(-1)[0]
        try:
            prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError as error:
            raise InvalidInput("text_input", "not valid UTF-8") from error
        if "input_ids" not in inputs:
            prompt_ids = tokenize(prompt)
    elif "input_ids" not in inputs:
        raise InvalidInput("text_input", "required")
    if not prompt_ids:
        raise InvalidInput("text_input", "empty prompt")
    if len(prompt_ids) > max_context:
        raise InvalidInput(
            "text_input", f"prompt of {len(prompt_ids)} tokens exceeds the context of {max_context}"
        )

    max_tokens = _scalar(inputs, "max_tokens", int)
    if max_tokens is None:
        raise InvalidInput("max_tokens", "required")
    if max_tokens <= 0:
        raise InvalidInput("max_tokens", f"must be > 0, got {max_tokens}")
    if max_tokens > max_context:  # more can never fit in a slot
        raise InvalidInput(
            "max_tokens", f"must be <= the context of {max_context}, got {max_tokens}"
        )

    temperature = _scalar(inputs, "temperature", float, 0.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidInput("temperature", f"must be a finite number >= 0, got {temperature}")
    top_p = _scalar(inputs, "top_p", float, 1.0)
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidInput("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _scalar(inputs, "top_k", int, 0)
    if top_k < 0:
        raise InvalidInput("top_k", f"must be >= 0, got {top_k}")
    _, seed = _first_of(inputs, ("seed", "random_seed"), int, None)
    min_name, min_tokens = _first_of(inputs, ("min_tokens", "min_length"), int, 0)
    if min_tokens < 0:
        raise InvalidInput(min_name, f"must be >= 0, got {min_tokens}")
    end_id = _scalar(inputs, "end_id", int, default_end_id)
    num_draft_tokens = _scalar(inputs, "num_draft_tokens", int, None)
    if num_draft_tokens is not None and not 0 <= num_draft_tokens <= max_draft_tokens:
        raise InvalidInput(
            "num_draft_tokens", f"must be in 0..{max_draft_tokens}, got {num_draft_tokens}"
        )
    fixed = _scalar(inputs, "fixed_num_draft_tokens", bool, False)
    if fixed and num_draft_tokens is None:
        raise InvalidInput("fixed_num_draft_tokens", "needs num_draft_tokens")
    proposer = _strings(inputs, "proposer")
    unknown = [name for name in proposer if name not in proposers]
    if unknown or len(set(proposer)) != len(proposer):
        allowed, got = ", ".join(proposers), ", ".join(proposer)
        raise InvalidInput(
            "proposer", f"each must be one of {allowed} (this server's), once; got {got}"
        )
    cache_salt = _strings(inputs, "cache_salt")
    if len(cache_salt) > 1 or (cache_salt and len(cache_salt[0]) > MAX_CACHE_SALT):
        raise InvalidInput(
            "cache_salt", f"expected one string of at most {MAX_CACHE_SALT} characters"
        )

    stream_interval = _scalar(inputs, "stream_interval", int, default_stream_interval)
    if stream_interval < 1:
        raise InvalidInput(
            "stream_interval", f"must be >= 1 (output tokens), got {stream_interval}"
        )

    beam_width = _scalar(inputs, "beam_width", int, 1)
    if beam_width != 1:
        raise InvalidInput(
            "beam_width",
            f"beam search is not supported, only 1; got {beam_width} "
            "(num_return_sequences gives independent sampled sequences)",
        )
    num_return_sequences = _scalar(inputs, "num_return_sequences", int, 1)
    if not 1 <= num_return_sequences <= max_return_sequences:
        raise InvalidInput(
            "num_return_sequences",
            f"must be in 1..{max_return_sequences}, got {num_return_sequences}",
        )
    for name, neutral in NEUTRAL_INPUTS.items():
        value = _scalar(inputs, name, float if isinstance(neutral, float) else int, neutral)
        if value != neutral:
            raise InvalidInput(name, f"only {neutral} is supported, got {value}")
    for name in UNSUPPORTED_FLAGS:
        if _scalar(inputs, name, bool, False):
            raise InvalidInput(name, "not supported by this server")
    controls = parse_logit_controls(inputs, tokenize, vocab_size, end_id, min_tokens)
    guide = parse_guide(inputs, end_id, check_guide)

    return GenerationRequest(
        prompt=prompt,
        prompt_ids=[int(t) for t in prompt_ids],
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed if seed is None else seed & (2**63 - 1),
        min_tokens=min_tokens,
        end_id=end_id,
        stop_words=_strings(inputs, "stop_words"),
        **controls,
        guide=guide,
        num_draft_tokens=num_draft_tokens,
        fixed_num_draft_tokens=fixed,
        proposers=tuple(proposer),
        cache_salt=cache_salt[0] if cache_salt else "",
        stream=_scalar(inputs, "stream", bool, False),
        stream_interval=stream_interval,
        exclude_input_in_output=_scalar(inputs, "exclude_input_in_output", bool, False),
        num_return_sequences=num_return_sequences,
        return_log_probs=_scalar(inputs, "return_log_probs", bool, False),
        return_perf_metrics=_scalar(inputs, "return_perf_metrics", bool, False),
        return_num_input_tokens=_scalar(inputs, "return_num_input_tokens", bool, False),
        return_num_output_tokens=_scalar(inputs, "return_num_output_tokens", bool, False),
    )


def parse_guide(
    inputs: dict[str, np.ndarray], end_id: int, check_guide: Callable[[Guide], object] | None
) -> Guide | None:
    """The request's guide (TensorRT-LLM's guided_decoding_guide_type and
    guided_decoding_guide), checked by compiling it; None without one."""
    kinds = _strings(inputs, GUIDE_TYPE_FIELD)
    texts = _strings(inputs, GUIDE_FIELD)
    if not kinds:
        if texts and texts[0]:
            raise InvalidInput(GUIDE_TYPE_FIELD, f"required with {GUIDE_FIELD}")
        return None
    if len(kinds) > 1 or len(texts) > 1:
        raise InvalidInput(GUIDE_TYPE_FIELD, "one guide per request")
    if kinds[0] not in GUIDE_TYPES:
        raise InvalidInput(
            GUIDE_TYPE_FIELD, f"{kinds[0]!r}: expected one of {', '.join(GUIDE_TYPES)}"
        )
    text = texts[0] if texts else ""
    if kinds[0] != "json" and not text.strip():
        raise InvalidInput(GUIDE_FIELD, f"required with {GUIDE_TYPE_FIELD} {kinds[0]!r}")
    if len(text) > MAX_GUIDE_CHARS:
        raise InvalidInput(GUIDE_FIELD, f"at most {MAX_GUIDE_CHARS} characters, got {len(text)}")
    if end_id < 0:
        raise InvalidInput("end_id", "a guided answer needs an end token (end_id >= 0)")
    guide = Guide(kinds[0], text)
    if check_guide is None:
        raise InvalidInput(GUIDE_TYPE_FIELD, "guided decoding is not available on this server")
    try:
        check_guide(guide)
    except ValueError as error:  # the grammar does not compile
        raise InvalidInput(GUIDE_FIELD, str(error)) from error
    return guide


def parse_logit_controls(
    inputs: dict[str, np.ndarray],
    tokenize,
    vocab_size: int | None,
    end_id: int,
    min_tokens: int,
) -> dict:
    """The request's logit controls as GenerationRequest fields; InvalidInput names a bad one.

    embedding_bias_words and bad_words are text, tokenized as TensorRT-LLM's preprocessing
    does (each word on its own, without special tokens): each token of a biased word gets its
    weight; a bad word's token sequence is never produced."""
    finite = {}
    for name, neutral in (
        ("repetition_penalty", 1.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("min_p", 0.0),
    ):
        value = _scalar(inputs, name, float, neutral)
        if not math.isfinite(value):
            raise InvalidInput(name, f"must be a finite number, got {value}")
        finite[name] = value
    if finite["repetition_penalty"] <= 0:
        raise InvalidInput(
            "repetition_penalty", f"must be > 0 (1: off), got {finite['repetition_penalty']}"
        )
    if not 0 <= finite["min_p"] <= 1:
        raise InvalidInput("min_p", f"must be in [0, 1], got {finite['min_p']}")
    prompt_ignore_length = _scalar(inputs, "prompt_ignore_length", int, 0)
    if prompt_ignore_length < 0:
        raise InvalidInput("prompt_ignore_length", f"must be >= 0, got {prompt_ignore_length}")

    bias: dict[int, float] = {}
    ids = _array(inputs, "logit_bias_ids", int)
    values = _array(inputs, "logit_bias_values", float)
    if len(ids) != len(values):
        raise InvalidInput(
            "logit_bias_values", f"{len(values)} values for {len(ids)} logit_bias_ids"
        )
    for token, value in zip(ids.tolist(), values.tolist(), strict=True):
        _check_token("logit_bias_ids", token, vocab_size)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidInput(
                "logit_bias_values", f"must be in [-100, 100], got {value} for token {token}"
            )
        bias[int(token)] = bias.get(int(token), 0.0) + float(value)
    words = _strings(inputs, "embedding_bias_words")
    weights = _array(inputs, "embedding_bias_weights", float)
    if len(words) != len(weights):
        raise InvalidInput(
            "embedding_bias_weights", f"{len(weights)} weights for {len(words)} words"
        )
    for word, weight in zip(words, weights.tolist(), strict=True):
        if not math.isfinite(weight):
            raise InvalidInput("embedding_bias_weights", f"must be finite, got {weight}")
        for token in _word_tokens(tokenize, word):
            bias[token] = bias.get(token, 0.0) + float(weight)
    if len(bias) > MAX_BIASES:
        raise InvalidInput("logit_bias_ids", f"at most {MAX_BIASES} tokens, got {len(bias)}")

    bad_words = _strings(inputs, "bad_words")
    if len(bad_words) > MAX_BAD_WORDS:
        raise InvalidInput("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(bad_words)}")
    bad_words_ids = [_word_tokens(tokenize, word) for word in bad_words]
    for word_ids in bad_words_ids:
        for token in word_ids:
            _check_token("bad_words", token, vocab_size)
    banned = {w[0] for w in bad_words_ids if len(w) == 1}
    if min_tokens > 0 and end_id >= 0:
        banned.add(end_id)  # not at first either
    if vocab_size is not None and len(banned) >= vocab_size:
        raise InvalidInput("bad_words", "they ban every token: none is left to choose")
    return dict(
        **finite,
        prompt_ignore_length=prompt_ignore_length,
        logit_bias={t: v for t, v in bias.items() if v != 0.0},
        bad_words_ids=[w for w in bad_words_ids if w],
    )


def _check_token(name: str, token: int, vocab_size: int | None) -> None:
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise InvalidInput(
            name, f"token id {token} is outside the vocabulary of {vocab_size} tokens"
        )


def _word_tokens(tokenize, word: str) -> list[int]:
    """A word's tokens as TensorRT-LLM's preprocessing makes them: the word alone, without
    the special tokens (a BOS) the tokenizer would put around a prompt."""
    return [int(t) for t in tokenize(word, add_special_tokens=False)]


def batch_size(inputs: dict[str, np.ndarray]) -> int:
    """Prompts in a request: the rows of text_input (or input_ids); 1 without either."""
    for name in ("text_input", "input_ids"):
        if name in inputs:
            array = np.asarray(inputs[name])
            return array.shape[0] if array.ndim >= 2 else 1
    return 1


def split_rows(inputs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request of B prompts (every tensor [B, ...], as Triton batches them) as B requests
    of one. A tensor of one row applies to every prompt. input_ids rows are cut to their
    input_lengths (preprocessing pads them)."""
    size = batch_size(inputs)
    if size < 1:
        raise InvalidInput("text_input", "no prompt in the request")
    rows: list[dict[str, np.ndarray]] = [{} for _ in range(size)]
    for name, value in inputs.items():
        array = np.asarray(value)
        if size > 1 and array.ndim >= 1 and array.shape[0] == size:
            parts = [array[i : i + 1] for i in range(size)]
        elif size == 1 or (array.ndim >= 1 and array.shape[0] == 1):
            parts = [array] * size
        else:
            raise InvalidInput(name, f"{list(array.shape)[:1]} rows for a batch of {size} prompts")
        for row, part in zip(rows, parts, strict=True):
            row[name] = part
    for row in rows:
        lengths = row.pop("input_lengths", None)
        if lengths is not None and "input_ids" in row:
            length = int(np.asarray(lengths).reshape(-1)[0])
            row["input_ids"] = np.asarray(row["input_ids"]).reshape(1, -1)[:, :length]
    return rows


def parse_requests(inputs: dict[str, np.ndarray], tokenize, **limits) -> list[GenerationRequest]:
    """One GenerationRequest per prompt of a (possibly batched) request, each tagged with its
    batch_index; a bad prompt refuses the whole request, naming the field and the index."""
    rows = split_rows(inputs)
    requests = []
    for index, row in enumerate(rows):
        try:
            request = parse_request(row, tokenize, **limits)
        except InvalidInput as error:
            if len(rows) == 1:
                raise
            detail = str(error)[len(error.field) + 2 :]
            raise InvalidInput(error.field, f"{detail} (batch_index {index})") from error
        request.batch_index = index
        requests.append(request)
    return requests
