"""The native kernels are built at install time (setup.py) and only imported at start: a missing
build never hangs or breaks a start, it gives a reason; each C++ source compiles once; the kernel
package reads no llmctl setting and imports no llmctl module; ``set_isa_cap`` reaches loaded kernels."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl_kernels import cpu_features, native_module

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
SETUP = KERNELS.parent / "setup.py"


def test_no_source_includes_another_source_and_setup_builds_each_once():
    sources = sorted(path.name for path in (KERNELS / "cpu").glob("*.cpp"))
    for path in (KERNELS / "cpu").iterdir():
        assert not re.search(r'#include\s+"[^"]+\.cpp"', path.read_text()), f"{path.name} includes a .cpp"
    listed = ast.literal_eval(re.search(r"CPU_SOURCES = (\[.*?\])", SETUP.read_text(), re.S).group(1))
    assert sorted(listed) == sources and len(set(listed)) == len(listed)


def test_only_the_bindings_and_the_bound_classes_include_pybind():
    # the decode loop and the MoE experts call bind their own classes (bindings.cpp registers them);
    # the experts' header hands the decode loop the object Python bound
    for path in (KERNELS / "cpu").iterdir():
        text = path.read_text()
        if "torch/extension.h" in text or "pybind11" in text:
            assert path.name in ("bindings.cpp", "decode_loop.cpp", "moe_experts.cpp", "moe_experts.h"), path.name


def test_the_kernel_package_reads_no_llmctl_setting_and_imports_no_llmctl():
    for path in [*KERNELS.glob("*.py"), *(KERNELS / "cpu").iterdir()]:
        text = path.read_text()
        assert "LLMCTL_" not in text, path.name
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                names = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n == "llmctl" or n.startswith("llmctl.") for n in names), path.name


def test_a_missing_extension_gives_a_reason_and_the_loaders_return_none():
    """A child where ``llmctl_kernels._C`` cannot be imported (as after an install without a compiler)."""
    script = (
        "import sys; sys.modules['llmctl_kernels._C'] = None\n"
        "from llmctl_kernels import cpu_native, decode_loop, gemm_native, kv_quant_native, quant_native\n"
        "assert cpu_native.load_native() is None and quant_native.load_quant_native() is None\n"
        "assert kv_quant_native.load_kv_quant_native() is None and gemm_native.load_gemm_native() is None\n"
        "assert decode_loop.load_decode_loop() is None\n"
        "print(cpu_native.native_unavailable_reason())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "not built at install time" in result.stdout or "x86-64 Linux only" in result.stdout
    assert result.stderr.count("native CPU kernels unavailable") == 1  # said once, not once per module


def test_the_isa_cap_lowers_the_level_and_reaches_loaded_kernels():
    from llmctl_kernels.cpu_native import load_native

    if load_native() is None:
        pytest.skip(native_module.unavailable_reason() or "no native kernels here")
    from llmctl_kernels.kv_quant_native import load_kv_quant_native

    kv = load_kv_quant_native()
    with pytest.raises(ValueError, match="choose one of"):
        cpu_features.set_isa_cap("sse9")
    cpu_features.set_isa_cap("generic")
    try:
        assert cpu_features.isa_level() == "generic" and cpu_features.native_bf16_units() == []
        assert kv.isa() == "generic"
    finally:
        cpu_features.set_isa_cap(None)
    assert cpu_features.isa_level() == cpu_features.supported_isa_levels()[0]
    assert kv.isa() == ("generic" if cpu_features.isa_level() == "generic" else "avx2")


def test_the_extension_is_built_where_the_install_can_build_it():
    """The native-kernel tests skip where the extension is absent. On x86-64 Linux with a C++
    compiler the install builds it (setup.py), so an absent one there is a broken build and must
    fail here instead of turning those tests into quiet skips."""
    import platform as host
    import shutil

    if host.system() != "Linux" or host.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("the install builds the native kernels on x86-64 Linux with a C++ compiler only")
    assert native_module.unavailable_reason() is None
