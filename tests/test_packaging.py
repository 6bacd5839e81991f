"""The wheel ships what the tree has, under import names that collide with nobody.

The kernels live in the top-level folder ``kernels/`` but import as ``llmctl_kernels``: the import
name ``kernels`` is Hugging Face's package, which transformers >= 5.25 requires and imports. A
``kernels/__init__.py`` here would shadow it for every Python started in a checkout (and the wheel
would overwrite its files in site-packages).
"""

from __future__ import annotations

import importlib.machinery
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for folder in ("llmctl", "kernels"):
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("llmctl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _tree_files(folder: str, patterns: tuple[str, ...]) -> set[Path]:
    root = REPO_ROOT / folder
    return {
        path.relative_to(root)
        for pattern in patterns
        for path in root.rglob(pattern)
        if "__pycache__" not in path.parts
    }


def test_the_wheel_has_two_top_level_packages_and_no_kernels(wheel_names):
    top = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"llmctl", "llmctl_kernels"}


def test_every_module_and_kernel_source_of_the_tree_is_in_the_wheel(wheel_names):
    llmctl = {f"llmctl/{path.as_posix()}" for path in _tree_files("llmctl", ("*.py", "*.txt"))}
    kernels = {f"llmctl_kernels/{path.as_posix()}" for path in _tree_files("kernels", ("*.py", "*.cpp", "*.h"))}
    assert any(name.endswith("gemm_kernels_isa.h") for name in kernels)
    assert llmctl - wheel_names == set(), "a package missing from [tool.setuptools] packages in pyproject.toml"
    assert kernels - wheel_names == set()


def test_a_checkout_on_sys_path_does_not_provide_a_package_named_kernels():
    spec = importlib.machinery.PathFinder.find_spec("kernels", [str(REPO_ROOT)])
    # A folder without __init__.py is at most a namespace portion, which any installed package wins over.
    assert spec is None or spec.origin is None, f"{spec.origin} shadows Hugging Face's `kernels` package"


def test_the_kernels_import_as_llmctl_kernels_from_the_checkout():
    import llmctl_kernels.cpu_features as cpu_features

    assert Path(cpu_features.__file__).resolve() == REPO_ROOT / "kernels" / "cpu_features.py"
