"""The package's layout shows the architecture, and the README describes the tree it ships in.

Layers (lower first): `engines` and `text` know nothing of the loop; `loop` uses both;
`serving` (the Triton glue) uses the loop; the entry points at the top (launch, gateway,
client, the OpenAI API) use anything. Imports go one way, so there are no cycles.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.paths import PROJECT_ROOT as ROOT

PACKAGE = ROOT / "specdec"
LAYERS = {"engines": 0, "text": 0, "loop": 1, "serving": 2}
TOP = 3  # specdec/*.py: entry points


def layer_of(module: str) -> int:
    """specdec.loop.scheduler -> 1; specdec.launch -> TOP."""
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def specdec_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdec"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("specdec")}
    return names


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_go_one_way(path):
    own = layer_of(module_name(path))
    for imported in specdec_imports(path):
        theirs = layer_of(imported)
        assert theirs <= own, f"{module_name(path)} (layer {own}) imports {imported} ({theirs})"
        package, their_package = module_name(path).split(".")[1], imported.split(".")[1]
        if own == 0 and theirs == 0:  # engines and text stay apart
            assert package == their_package, f"{module_name(path)} imports {imported}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_every_module_says_what_it_is_for(path):
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.strip(), f"{module_name(path)} has no docstring"


def readme_code_blocks() -> list[str]:
    return re.findall(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_every_make_command_in_the_readme_names_a_target():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    commands = [
        line.split()[1]
        for block in readme_code_blocks()
        for line in block.splitlines()
        if line.strip().startswith("make ") and len(line.split()) > 1
    ]
    assert commands, "the README shows no make command"
    for target in commands:
        if "=" in target:  # a variable, e.g. `make REPLICAS=2`: the default goal
            continue
        assert target in targets, f"README: `make {target}` is not a Makefile target"


def test_the_readme_map_names_paths_that_exist():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Repository map", 1)[1]
    paths = re.findall(r"^\| `([^`]+)`", section, re.M)
    assert len(paths) >= 8, paths
    for path in paths:
        assert (ROOT / path.rstrip("/")).exists(), f"README map: {path} does not exist"


def test_the_loop_loads_no_decoder():
    """The loop speaks the engines' wire format; running an engine is the engine models' job.
    Importing every loop module loads neither the torch decoder nor onnxruntime nor TensorRT."""
    code = (
        "import importlib, pkgutil, sys, specdec.loop\n"
        "for m in pkgutil.walk_packages(specdec.loop.__path__, 'specdec.loop.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    assert "specdec.loop.scheduler" in loaded  # the walk found the loop's modules
    decoders = ("specdec.engines.llama", "specdec.engines.calls", "onnxruntime", "tensorrt")
    assert not [m for m in loaded if m.split(".")[0] in decoders or m in decoders]
