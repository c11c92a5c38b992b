"""Settings of the served models (specdec/serving/settings.py, specdec/server_config.py): one
declaration per setting, which the launcher parses (a bad value stops the server before it
starts, with a message naming the variable) and writes into the rendered repository, and the
models read again (a missing parameter is its default, a bad one fails the load naming it);
docs/operations.md's table is that declaration. The access settings (keys, TLS files) become
tritonserver options."""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from tls import make_pki

from specdec.loop.config import SchedulerConfig
from specdec.paths import PROJECT_ROOT
from specdec.server_config import (
    ServerConfig,
    access_arguments,
    access_summary,
    get_parameter,
    render_repository,
)
from specdec.serving import settings
from specdec.serving.settings import (
    BY_VARIABLE,
    EXAMPLE_KEY,
    SETTINGS,
    Setting,
    decide_response_thread,
    markdown_table,
    model_settings,
    parse_auto_bool,
    parse_calibration_seconds,
    parse_certificate_file,
    parse_header_key,
    parse_private_key_file,
    parse_stream_interval,
    usable_cores,
)


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("4", 4), (" 16 ", 16)])
def test_stream_interval_values(value, expected):
    assert parse_stream_interval("STREAM_INTERVAL", value) == expected


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "four", "", "4 tokens"])
def test_a_bad_stream_interval_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^STREAM_INTERVAL: expected an integer >= 1"):
        parse_stream_interval("STREAM_INTERVAL", value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), ("AUTO", None), ("true", True), ("1", True), ("false", False), ("no", False)],
)
def test_response_thread_values(value, expected):
    assert parse_auto_bool("RESPONSE_THREAD", value) is expected


@pytest.mark.parametrize("value", ["maybe", "2", "on", ""])
def test_a_bad_response_thread_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^RESPONSE_THREAD: expected auto, true or false"):
        parse_auto_bool("RESPONSE_THREAD", value)


def test_auto_turns_the_response_thread_on_from_four_usable_cores():
    assert decide_response_thread(None, 2) == (
        False,
        "response_thread auto: off (2 usable cores < 4)",
    )
    assert decide_response_thread(None, 3)[0] is False
    assert decide_response_thread(None, 4) == (
        True,
        "response_thread auto: on (4 usable cores >= 4)",
    )
    # A setting wins over the core count either way.
    assert decide_response_thread(True, 2) == (True, "response_thread true (set)")
    assert decide_response_thread(False, 16) == (False, "response_thread false (set)")


def test_usable_cores_follow_the_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("value", "expected"), [("0", 0.0), ("5", 5.0), (" 2.5 ", 2.5)])
def test_calibration_seconds_values(value, expected):
    assert parse_calibration_seconds("CALIBRATION_SECONDS", value) == expected


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon", ""])
def test_a_bad_calibration_budget_names_the_setting(value):
    with pytest.raises(ValueError, match=r"^CALIBRATION_SECONDS: expected seconds >= 0"):
        parse_calibration_seconds("CALIBRATION_SECONDS", value)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"STREAM_INTERVAL": "0"}, "STREAM_INTERVAL"),
        ({"STREAM_INTERVAL": "x"}, "STREAM_INTERVAL"),
        ({"RESPONSE_THREAD": "sometimes"}, "RESPONSE_THREAD"),
        ({"CALIBRATION_SECONDS": "-1"}, "CALIBRATION_SECONDS"),
        ({"CALIBRATION_SECONDS": "soon"}, "CALIBRATION_SECONDS"),
        ({"CALIBRATION_SECONDS": "nan"}, "CALIBRATION_SECONDS"),
    ],
)
def test_server_config_refuses_a_bad_setting_naming_it(env, named):
    with pytest.raises(ValueError, match=f"^{named}: "):
        ServerConfig.from_env(env)


def parameters_of(text: str) -> dict[str, str]:
    """A config.pbtxt's parameters."""
    keys = re.findall(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value', text)
    return {key: get_parameter(text, key) or "" for key in keys}


def test_settings_become_the_bls_parameters(tmp_path):
    config = ServerConfig.from_env(
        {"STREAM_INTERVAL": "4", "RESPONSE_THREAD": "auto", "RUN_DIR": str(tmp_path)}
    )
    text = (render_repository(config) / "speculative_decoding" / "config.pbtxt").read_text()
    assert get_parameter(text, "stream_interval") == "4"
    assert get_parameter(text, "response_thread") == "auto"
    assert get_parameter(text, "calibration_seconds") == "5"  # not set: the declared default


def assert_launch_refused(tmp_path: Path, settings: dict[str, str], message: str) -> None:
    """`make serve`'s command with `settings` exits at once with `message` and starts no
    server: nothing is rendered into its RUN_DIR."""
    env = {**os.environ, **settings, "RUN_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "specdec.launch"],
        env=env,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert message in done.stderr
    assert "tritonserver on" not in done.stdout
    assert not (tmp_path / "model_repository").exists()


def test_the_launcher_refuses_to_start_with_a_bad_stream_interval(tmp_path):
    """`make serve`'s command exits at once, naming the setting, and starts no server."""
    assert_launch_refused(
        tmp_path, {"STREAM_INTERVAL": "0"}, "STREAM_INTERVAL: expected an integer >= 1, got '0'"
    )


# -- one declaration per setting ------------------------------------------------------------

# A value each setting refuses; those in ANY_TEXT take any text (a folder, "": none).
BAD = {
    "TARGET_CHECKPOINT": " ",
    "DRAFT_CHECKPOINT": " ",
    "ENGINE": "tensorflow",
    "DEVICE": "gpu",
    "DTYPE": "double",
    "CUDA_GRAPHS": "sometimes",
    "NUM_SLOTS": "0",
    "MAX_CONTEXT": "1",
    "PROPOSERS": "medusa",
    "GUIDED_JSON_WHITESPACE": "pretty",
    "DEFAULT_NUM_DRAFT_TOKENS": "-1",
    "NGRAM_MATCH_LENGTHS": "1,2",
    "SUFFIX_STORE_BYTES": "64MB",
    "MAX_QUEUE": "-1",
    "PREFIX_CACHE": "maybe",
    "PREFIX_MIN_TOKENS": "0",
    "PREFILL_CHUNK": "-1",
    "STREAM_INTERVAL": "0",
    "RESPONSE_THREAD": "sometimes",
    "CALIBRATION_SECONDS": "-1",
    "TRITON_INFERENCE_KEY": "two words",
    "TRITON_ADMIN_KEY": "two words",
    "GRPC_SSL_CERT": "/no/such/server.crt",
    "GRPC_SSL_KEY": "/no/such/server.key",
}
ANY_TEXT = {"DRAFT_ENGINE_DIR", "TARGET_ENGINE_DIR"}
# A good value other than the default, for each setting a model takes.
GIVEN = {
    "TARGET_CHECKPOINT": "/opt/target",
    "DRAFT_CHECKPOINT": "/opt/draft",
    "ENGINE": "onnxruntime",
    "DEVICE": "cuda:1",
    "DTYPE": "bfloat16",
    "CUDA_GRAPHS": "true",
    "DRAFT_ENGINE_DIR": "/opt/engines/draft",
    "TARGET_ENGINE_DIR": "/opt/engines/target",
    "NUM_SLOTS": "8",
    "MAX_CONTEXT": "512",
    "PROPOSERS": "ngram",
    "GUIDED_JSON_WHITESPACE": "any",
    "DEFAULT_NUM_DRAFT_TOKENS": "3",
    "NGRAM_MATCH_LENGTHS": "4,2",
    "SUFFIX_STORE_BYTES": "1048576",
    "MAX_QUEUE": "16",
    "PREFIX_CACHE": "off",
    "PREFIX_MIN_TOKENS": "32",
    "PREFILL_CHUNK": "0",
    "STREAM_INTERVAL": "4",
    "RESPONSE_THREAD": "true",
    "CALIBRATION_SECONDS": "0",
}
MODEL_SETTINGS = [setting for setting in SETTINGS if setting.models]


def variable(setting: Setting) -> str:
    return setting.variable


def test_the_tables_here_cover_every_declared_setting():
    assert set(BAD) | ANY_TEXT == set(BY_VARIABLE)
    assert set(GIVEN) == {setting.variable for setting in MODEL_SETTINGS}


def test_each_setting_is_declared_once_and_each_parameter_belongs_to_one():
    assert len(BY_VARIABLE) == len(SETTINGS)
    owners = [(model, setting.key) for setting in SETTINGS for model in setting.models]
    assert len(owners) == len(set(owners))
    models = {path.parent.name for path in (PROJECT_ROOT / "model_repository").glob("*/*.pbtxt")}
    for setting in SETTINGS:
        assert bool(setting.key) == bool(setting.models), setting.variable
        assert set(setting.models) <= models, setting.variable
        assert setting.doc and "\n" not in setting.doc and "|" not in setting.doc


@pytest.mark.parametrize("setting", MODEL_SETTINGS, ids=variable)
def test_a_missing_parameter_is_the_default_and_each_default_parses(setting):
    assert setting.read({}) == setting.parse(setting.variable, setting.default)
    assert setting.read({setting.key: GIVEN[setting.variable]}) != setting.read({})
    if setting.gpu_default is not None:
        assert setting.parse("x", setting.gpu_default) != setting.read({})


def test_the_loops_defaults_are_the_declared_ones():
    """SchedulerConfig owns these; the declaration writes them as config.pbtxt text."""
    loop = SchedulerConfig(num_slots=1, max_context=2, max_draft_tokens=1, default_draft_tokens=0)
    assert settings.MAX_QUEUE.read({}) == loop.max_queue
    assert settings.PROPOSERS.read({}) == loop.proposer_names
    assert settings.NGRAM_MATCH_LENGTHS.read({}) == loop.ngram_match_lengths
    assert settings.SUFFIX_STORE_BYTES.read({}) == loop.suffix_store_bytes
    assert settings.PREFIX_MIN_TOKENS.read({}) == loop.prefix_min_tokens
    assert settings.PREFILL_CHUNK.read({}) == loop.prefill_chunk


@pytest.mark.parametrize(
    ("setting", "text", "value"),
    [
        (settings.NGRAM_MATCH_LENGTHS, "3,2,1", (3, 2, 1)),
        (settings.NGRAM_MATCH_LENGTHS, " 5, 2 ", (5, 2)),
        (settings.NGRAM_MATCH_LENGTHS, "4", (4,)),
        (settings.PROPOSERS, "", ()),
        (settings.PROPOSERS, "ngram, draft_model", ("ngram", "draft_model")),
        (settings.DEFAULT_NUM_DRAFT_TOKENS, "adaptive", None),
        (settings.DEFAULT_NUM_DRAFT_TOKENS, "0", 0),
        (settings.DEFAULT_NUM_DRAFT_TOKENS, "4", 4),
        (settings.DEVICE, "cuda:1", "cuda:1"),
        (settings.ENGINE, " tensorrt ", "tensorrt"),
        (settings.MAX_QUEUE, "0", 0),
        (settings.PREFILL_CHUNK, "0", None),
        (settings.CUDA_GRAPHS, "yes", True),
        (settings.CUDA_GRAPHS, " Auto ", None),
        (settings.TARGET_ENGINE_DIR, "", ""),
    ],
)
def test_setting_values(setting, text, value):
    assert setting.parse(setting.variable, text) == value


@pytest.mark.parametrize(
    ("setting", "text"),
    [
        (settings.NGRAM_MATCH_LENGTHS, "1,2"),  # shortest first
        (settings.NGRAM_MATCH_LENGTHS, "3,3"),
        (settings.NGRAM_MATCH_LENGTHS, "2,0"),
        (settings.NGRAM_MATCH_LENGTHS, ""),
        (settings.NGRAM_MATCH_LENGTHS, "3,two"),
        (settings.PROPOSERS, "ngram,ngram"),
        (settings.PROPOSERS, "ngram,eagle"),
        (settings.DEFAULT_NUM_DRAFT_TOKENS, "four"),
        (settings.DEVICE, "cuda:"),
        (settings.DTYPE, "fp16"),
        (settings.MAX_CONTEXT, "1"),
    ],
)
def test_refused_setting_values_name_the_setting(setting, text):
    with pytest.raises(ValueError, match=f"^{setting.variable}: expected "):
        setting.parse(setting.variable, text)


@pytest.mark.parametrize("name", sorted(BAD))
def test_server_config_refuses_every_bad_setting_naming_its_variable(name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        ServerConfig.from_env({name: BAD[name]})


@pytest.mark.parametrize("setting", [s for s in MODEL_SETTINGS if s.variable in BAD], ids=variable)
def test_a_bad_parameter_names_the_parameter_and_its_variable(setting):
    with pytest.raises(ValueError, match="^" + re.escape(f"{setting.key} ({setting.variable}): ")):
        setting.read({setting.key: BAD[setting.variable]})


def test_an_empty_variable_is_unset_except_where_empty_is_a_value():
    config = ServerConfig.from_env({"NUM_SLOTS": "", "TARGET_CHECKPOINT": "", "PROPOSERS": ""})
    assert config.parameters == {"speculative_decoding": {"proposers": ""}}


def test_every_setting_reaches_the_rendered_parameters_of_each_of_its_models(tmp_path):
    config = ServerConfig.from_env({**GIVEN, "RUN_DIR": str(tmp_path)})
    repository = render_repository(config)
    read = 0
    for setting in MODEL_SETTINGS:
        for model in setting.models:
            parameters = parameters_of((repository / model / "config.pbtxt").read_text())
            given = setting.parse(setting.variable, GIVEN[setting.variable])
            assert setting.read(parameters) == given, (model, setting.variable)
            read += 1
    assert read == sum(len(setting.models) for setting in MODEL_SETTINGS) > len(MODEL_SETTINGS)


def test_the_committed_configs_carry_no_setting():
    """The declaration is the one place a default is written: a model reads a missing
    parameter as its default, and rendering writes every one (below)."""
    for config_file in (PROJECT_ROOT / "model_repository").glob("*/config.pbtxt"):
        text = config_file.read_text()
        for setting in model_settings(config_file.parent.name):
            assert get_parameter(text, setting.key) is None, (config_file, setting.key)


def test_rendering_writes_every_declared_parameter(tmp_path):
    """A set variable wins; else a value written into the source config.pbtxt by hand stays;
    else the default is added. Parameters that are no setting stay as they are."""
    source = tmp_path / "source"
    shutil.copytree(PROJECT_ROOT / "model_repository", source)
    bls = source / "speculative_decoding" / "config.pbtxt"
    bls.write_text(
        bls.read_text()
        + 'parameters: { key: "max_queue" value: { string_value: "7" } }\n'
        + 'parameters: {key:"stream_interval" value:{string_value:"3"}}\n'
    )
    checkpoint = str(tmp_path / 'a "quoted" \\ folder')
    env = {
        "RUN_DIR": str(tmp_path / "run"),
        "STREAM_INTERVAL": "5",
        "TARGET_CHECKPOINT": checkpoint,
    }
    config = ServerConfig.from_env(env)
    config.source_repository = source
    repository = render_repository(config)
    text = (repository / "speculative_decoding" / "config.pbtxt").read_text()
    parameters = parameters_of(text)
    assert (
        parameters["stream_interval"] == "5"
        and len(re.findall('key: ?"stream_interval"', text)) == 1
    )
    assert parameters["max_queue"] == "7" and len(re.findall('key: ?"max_queue"', text)) == 1
    assert parameters["prefill_chunk"] == "256"
    assert parameters["checkpoint"] == checkpoint  # quotes and backslashes escaped, read back
    assert set(parameters) == {s.key for s in model_settings("speculative_decoding")} | {
        "max_num_draft_tokens",
    }
    assert parameters["draft_checkpoint"] == str(PROJECT_ROOT / settings.DRAFT_CHECKPOINT.default)
    draft = parameters_of((repository / "draft_model" / "config.pbtxt").read_text())
    assert draft == {"role": "draft", "engines_model_name": "speculative_decoding"}


# The operations guide's table, between these lines, is `python -m specdec.serving.settings
# --markdown`'s output.
TABLE_START = "<!-- settings table: generated by"
TABLE_END = "<!-- end of the settings table -->"


def test_the_operations_table_is_the_declaration():
    text = (PROJECT_ROOT / "docs" / "operations.md").read_text()
    table = text.split(TABLE_START, 1)[1].split("\n", 1)[1].split(TABLE_END, 1)[0]
    assert table == markdown_table(), "regenerate: python -m specdec.serving.settings --markdown"
    printed = subprocess.run(
        [sys.executable, "-m", "specdec.serving.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == markdown_table()
    assert len(table.splitlines()) == len(SETTINGS) + 2


def test_defaults_the_docs_name_are_the_declared_ones():
    """Prose such as "`MAX_QUEUE` (default 1024)" or "`PREFIX_CACHE`, default `on`"."""
    named = re.compile(r"`([A-Z][A-Z0-9_]+)`,? \(?default `?([^`),; ]+)")
    checked = 0
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        for name, value in named.findall(path.read_text()):
            if name in BY_VARIABLE:
                setting = BY_VARIABLE[name]
                assert value in (setting.default, setting.gpu_default), (path.name, name, value)
                checked += 1
    assert checked >= 5


def test_makes_shell_defaults_are_the_declared_ones():
    text = (PROJECT_ROOT / "Makefile").read_text()
    models = re.search(r"^MODELS := (\S+)$", text, re.MULTILINE)[1]
    defaults = re.findall(r"\$\$\{(\w+):-([^}]*)\}", text.replace("$(MODELS)", models))
    declared = [(name, value) for name, value in defaults if name in BY_VARIABLE]
    assert {name for name, _ in declared} >= {"TARGET_CHECKPOINT", "NUM_SLOTS", "MAX_CONTEXT"}
    for name, value in declared:
        assert value == BY_VARIABLE[name].default, name


# -- the models read the same declaration (a stand-in for triton_python_backend_utils) -------


@pytest.fixture
def glue(monkeypatch):
    """Imports a module of specdec/serving against a stand-in triton_python_backend_utils whose
    every attribute is a MagicMock; forgets the modules imported so after the test."""
    stand_in = types.ModuleType("triton_python_backend_utils")
    stand_in.__getattr__ = lambda name: MagicMock(name=name)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    before = set(sys.modules)
    yield lambda name: importlib.import_module(f"specdec.serving.{name}")
    for name in set(sys.modules) - before:
        if name.startswith("specdec.serving."):
            del sys.modules[name]


def model_args(model: str, parameters: dict[str, str]) -> dict:
    """Triton's initialize arguments: the committed config's parameters, then `parameters`."""
    committed = parameters_of(
        (PROJECT_ROOT / "model_repository" / model / "config.pbtxt").read_text()
    )
    config = {
        "parameters": {k: {"string_value": v} for k, v in {**committed, **parameters}.items()},
        "input": [],
    }
    return {"model_config": json.dumps(config), "model_name": model}


GLUE = {  # draft_model and target_model take no settings: they forward to the BLS
    "speculative_decoding": ("bls_model", "TritonPythonModel"),
    "preprocessing": ("text_models", "Preprocessing"),
}


@pytest.mark.parametrize("model", sorted(GLUE))
def test_a_bad_parameter_fails_the_models_load_naming_it(glue, model):
    module, name = GLUE[model]
    checked = 0
    for setting in model_settings(model):
        if setting.variable in ANY_TEXT:
            continue
        instance = getattr(glue(module), name)()
        message = "^" + re.escape(f"{setting.key} ({setting.variable}): ")
        with pytest.raises(ValueError, match=message):
            instance.initialize(model_args(model, {setting.key: BAD[setting.variable]}))
        checked += 1
    assert checked >= 1


def render_parameters(tmp_path: Path, env: dict[str, str], model: str) -> dict[str, str]:
    config = ServerConfig.from_env({**env, "RUN_DIR": str(tmp_path)})
    return parameters_of((render_repository(config) / model / "config.pbtxt").read_text())


def test_the_bls_creates_both_engines_from_its_settings(glue, monkeypatch, tmp_path):
    bls_model = glue("bls_model")
    calls: list[tuple] = []
    engine = SimpleNamespace(config=SimpleNamespace(vocab_size=49_152))

    def create_engine(*args, **kwargs):
        calls.append((args, kwargs))
        return engine

    def for_tokenizer(path: str, vocab_size: int, json_whitespace: str):
        grammars.append((path, vocab_size, json_whitespace))
        return None

    grammars: list[tuple] = []
    monkeypatch.setattr(bls_model, "create_engine", create_engine)
    monkeypatch.setattr(bls_model, "Grammars", SimpleNamespace(for_tokenizer=for_tokenizer))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    parameters = render_parameters(tmp_path / "given", GIVEN, "speculative_decoding")
    bls_model.create_engines(parameters)
    bls_model.create_engines({})
    # guided rows' grammars: the target's tokenizer, over its vocabulary
    target = str(tmp_path / "models/smollm2-135m-instruct")
    assert grammars == [("/opt/target", 49_152, "any"), (target, 49_152, "compact")]
    common = dict(num_slots=8, max_length=512, device="cuda:1", dtype="bfloat16", cuda_graphs=True)
    defaults = dict(num_slots=64, max_length=2048, device="cpu", dtype="float32", cuda_graphs=None)
    assert calls == [
        (("onnxruntime", "/opt/draft"), {**common, "engine_dir": "/opt/engines/draft"}),
        (("onnxruntime", "/opt/target"), {**common, "engine_dir": "/opt/engines/target"}),
        # nothing set: the declared defaults (cuda_graphs auto: create_engine resolves it)
        (("torch", str(tmp_path / "models/smollm2-135m-draft")), {**defaults, "engine_dir": None}),
        (
            ("torch", str(tmp_path / "models/smollm2-135m-instruct")),
            {**defaults, "engine_dir": None},
        ),
    ]


@pytest.mark.parametrize(
    ("env", "expected", "stream_interval", "calibration_seconds"),
    [
        (  # what is set reaches the loop's config
            {k: v for k, v in GIVEN.items() if k != "PREFIX_CACHE"},
            SchedulerConfig(
                num_slots=8,
                max_context=512,
                max_draft_tokens=8,
                default_draft_tokens=3,
                max_queue=16,
                proposer_names=("ngram",),
                ngram_match_lengths=(4, 2),
                suffix_store_bytes=1048576,
                prefix_min_tokens=32,
                prefill_chunk=None,
            ),
            4,
            0.0,
        ),
        (  # PREFIX_CACHE=off: no reuse, whatever PREFIX_MIN_TOKENS says
            {"PREFIX_CACHE": "off", "PREFIX_MIN_TOKENS": "32"},
            SchedulerConfig(64, 2048, 8, None, prefix_min_tokens=None),
            1,
            5.0,
        ),
        (None, SchedulerConfig(64, 2048, 8, None), 1, 5.0),  # no parameter: the defaults
    ],
)
def test_the_bls_builds_its_loop_from_its_settings(
    glue, monkeypatch, tmp_path, target_dir, env, expected, stream_interval, calibration_seconds
):
    monkeypatch.setenv("SPECDEC_HOME", str(target_dir.parent.parent))
    monkeypatch.setenv("SPECDEC_HTTP_PORT", "9")  # no server: the calibration waits for none
    parameters = {}
    if env is not None:
        env = {**env, "TARGET_CHECKPOINT": str(target_dir)}
        parameters = render_parameters(tmp_path, env, "speculative_decoding")
    bls_model = glue("bls_model")
    made: list[dict] = []  # the engines are another test's subject (above)
    # What the BLS reads of its engines: the target's vocabulary size (it bounds a bias).
    engines = SimpleNamespace(target_engine=SimpleNamespace(config=SimpleNamespace(vocab_size=8)))
    monkeypatch.setattr(bls_model, "create_engines", lambda p: made.append(p) or engines)
    model = bls_model.TritonPythonModel()
    model.initialize(model_args("speculative_decoding", parameters))
    try:
        assert len(made) == 1
        assert model.config == expected
        assert model.stream_interval == stream_interval
        assert model.calibration_seconds == calibration_seconds
    finally:
        model.finalize()


# -- access: the keys and TLS files (TRITON_INFERENCE_KEY, TRITON_ADMIN_KEY, GRPC_SSL_*) ------


def pem(label: str, body: bytes = b"\x30\x82" + bytes(range(64))) -> str:
    """A PEM block; the base64 body need not be a real certificate for these checks."""
    text = base64.encodebytes(body).decode()
    return f"-----BEGIN {label}-----\n{text}-----END {label}-----\n"


@pytest.fixture
def tls_files(tmp_path) -> dict[str, Path]:
    """Real certificates where their dates and key are read (made with openssl), PEM blocks
    of any body where only the labels are."""
    (tmp_path / "made").mkdir()
    made = make_pki(tmp_path / "made")
    ca, cert, key = made["ca"], made["cert"], made["key"]
    files = {
        "cert": cert.read_text(),
        "chain": cert.read_text() + ca.read_text(),
        "key": key.read_text(),
        "rsa_key": pem("RSA PRIVATE KEY"),
        "encrypted_key": pem("ENCRYPTED PRIVATE KEY"),
        "text": "not a certificate\n",
        "bad_base64": "-----BEGIN CERTIFICATE-----\n#not*base64#\n-----END CERTIFICATE-----\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(text)
    paths["folder"] = tmp_path
    paths["missing"] = tmp_path / "missing.pem"
    return paths


@pytest.mark.parametrize("value", ["k3y-0f_letters.and~digits", "a" * 64, "x:y=z"])
def test_header_key_values(value):
    assert parse_header_key("TRITON_INFERENCE_KEY", value) == value


@pytest.mark.parametrize("value", ["two words", "tab\tkey", "ключ", "new\nline", ""])
def test_a_bad_header_key_names_the_setting_and_never_shows_the_value(value):
    with pytest.raises(ValueError, match=r"^TRITON_INFERENCE_KEY: expected printable") as error:
        parse_header_key("TRITON_INFERENCE_KEY", value)
    assert not value or value not in str(error.value)


def test_the_committed_example_key_is_refused():
    """deploy/kubernetes/base/secret.yaml's placeholder: a pod that was not given a key of its
    own does not start with a public one."""
    with pytest.raises(ValueError, match=r"^TRITON_INFERENCE_KEY: still the committed example"):
        ServerConfig.from_env({"TRITON_INFERENCE_KEY": EXAMPLE_KEY})


def test_certificate_and_key_files_are_accepted(tls_files):
    assert parse_certificate_file("GRPC_SSL_CERT", str(tls_files["cert"])) == tls_files["cert"]
    assert parse_certificate_file("GRPC_SSL_CERT", str(tls_files["chain"])) == tls_files["chain"]
    for name in ("key", "rsa_key"):
        assert parse_private_key_file("GRPC_SSL_KEY", str(tls_files[name])) == tls_files[name]


@pytest.mark.parametrize(
    ("variable", "file", "message"),
    [
        ("GRPC_SSL_CERT", "missing", "cannot read .*missing.pem: No such file"),
        ("GRPC_SSL_CERT", "folder", "cannot read .*: Is a directory"),
        ("GRPC_SSL_CERT", "text", "text.pem is not a PEM file"),
        ("GRPC_SSL_CERT", "bad_base64", "a CERTIFICATE block that is not base64"),
        ("GRPC_SSL_CERT", "key", "key.pem holds no PEM certificate"),
        ("GRPC_SSL_KEY", "missing", "cannot read .*missing.pem"),
        ("GRPC_SSL_KEY", "text", "is not a PEM file"),
        ("GRPC_SSL_KEY", "cert", "cert.pem holds no PEM private key"),
        ("GRPC_SSL_KEY", "encrypted_key", "is encrypted; tritonserver needs it unencrypted"),
    ],
)
def test_a_bad_tls_file_is_refused_naming_the_variable(tls_files, variable, file, message):
    other = {"GRPC_SSL_CERT": "cert", "GRPC_SSL_KEY": "key"}
    env = {name: str(tls_files[default]) for name, default in other.items()}
    env[variable] = str(tls_files[file])
    with pytest.raises(ValueError, match=f"^{variable}: .*{message}"):
        ServerConfig.from_env(env)


@pytest.mark.parametrize(("given", "missing"), [("GRPC_SSL_CERT", "KEY"), ("GRPC_SSL_KEY", "CERT")])
def test_tls_needs_both_files(tls_files, given, missing):
    path = tls_files["cert" if given == "GRPC_SSL_CERT" else "key"]
    with pytest.raises(ValueError, match=f"^GRPC_SSL_{missing}: not set, and {given} is"):
        ServerConfig.from_env({given: str(path)})


def option_values(arguments: list[str], option: str) -> list[str]:
    return [a.split("=", 1)[1] for a in arguments if a.startswith(option + "=")]


def test_access_arguments_lock_what_is_set_and_nothing_else(tls_files):
    assert access_arguments(ServerConfig.from_env({})) == []
    config = ServerConfig.from_env(
        {
            "TRITON_INFERENCE_KEY": "infer:ence=key",
            "TRITON_ADMIN_KEY": "admin-secret",
            "GRPC_SSL_CERT": str(tls_files["cert"]),
            "GRPC_SSL_KEY": str(tls_files["key"]),
        }
    )
    arguments = access_arguments(config)
    for option in ("--http-restricted-api", "--grpc-restricted-protocol"):
        groups = {}
        for value in option_values(arguments, option):
            apis, restriction = value.split(":", 1)  # Triton splits at the first ':' and '='
            header, key = restriction.split("=", 1)
            groups[header] = (set(apis.split(",")), key)
        assert groups == {
            "inference-key": (
                {"inference", "metadata", "model-config", "statistics"},
                "infer:ence=key",
            ),
            "admin-key": (
                {"model-repository", "shared-memory", "trace", "logging"},
                "admin-secret",
            ),
        }
        # Health stays open (probes, the gateway's checks, the BLS's own readiness check).
        assert not any("health" in apis for apis, _ in groups.values())
    assert option_values(arguments, "--grpc-use-ssl") == ["true"]
    assert option_values(arguments, "--grpc-server-cert") == [str(tls_files["cert"])]
    assert option_values(arguments, "--grpc-server-key") == [str(tls_files["key"])]
    assert "infer:ence=key" not in repr(config) and "admin-secret" not in repr(config)
    assert access_summary(config) == (
        "gRPC TLS, inference needs the inference-key header, admin APIs need the admin-key header"
    )


def test_the_launcher_refuses_a_missing_certificate_before_the_server_starts(tmp_path):
    files = {"GRPC_SSL_CERT": tmp_path / "server.crt", "GRPC_SSL_KEY": tmp_path / "server.key"}
    assert_launch_refused(
        tmp_path,
        {name: str(path) for name, path in files.items()},
        f"GRPC_SSL_CERT: cannot read {files['GRPC_SSL_CERT']}",
    )
