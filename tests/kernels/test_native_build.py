"""kernels/native_build.py: a build never hangs a start. A lock file left by a killed build is
taken over; a live build is waited for up to LLMCTL_NATIVE_BUILD_TIMEOUT, then the caller runs
without the extension and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmctl_kernels import native_build
from llmctl_kernels.native_build import build_extension, module_name_for

if native_build.unavailable_reason() is not None:
    pytest.skip(native_build.unavailable_reason(), allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# pybind11 alone (shipped in torch's include dir): a module that builds in seconds, not a minute.
TINY = """
#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b + OFFSET; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A fresh source (unique per test, so nothing is cached yet) and an empty kernel cache."""
    source = tmp_path / "tiny.cpp"
    source.write_text(f"// {tmp_path}\n{TINY}")
    monkeypatch.setenv("LLMCTL_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    return source


def lock_file(source: Path, flags: list[str]) -> Path:
    return Path(os.environ["LLMCTL_KERNEL_CACHE"]) / f"{module_name_for('tiny', [source], flags)}.lock"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_left_by_a_killed_build_is_taken_over(tiny, capfd):
    flags = ["-DOFFSET=1"]
    pid = dead_pid()  # what a build killed mid-way leaves: its lock file and a partial output
    lock_file(tiny, flags).write_text(f"{pid}\n")
    partial = lock_file(tiny, flags).with_suffix(f".{pid}.partial.so")
    partial.write_bytes(b"half a module")
    module = build_extension("tiny", [tiny], flags, timeout_s=5)
    assert module is not None and module.add(2, 3) == 6
    assert not partial.exists()
    err = capfd.readouterr().err
    assert "building the native tiny kernels" in err and "waiting" not in err
    # built once: a second call (another start) imports the cached module without building
    assert build_extension("tiny", [tiny], flags, timeout_s=5) is module
    assert "building" not in capfd.readouterr().err


def test_a_live_build_is_waited_for_then_given_up_on(tiny, capfd):
    flags = ["-DOFFSET=2"]
    lock = lock_file(tiny, flags)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{{os.getpid()}}\\n".encode())
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert build_extension("tiny", [tiny], flags, timeout_s=1.5) is None
        err = capfd.readouterr().err
        assert f"waiting for pid {holder.pid}" in err
        assert "still building" in native_build.FAILURES["tiny"] and "pure-torch path" in err
    finally:
        holder.kill()
        holder.wait()
    # its holder gone, the same lock file no longer blocks anyone
    module = build_extension("tiny", [tiny], flags, timeout_s=5)
    assert module is not None and module.add(1, 1) == 4


def test_a_compiler_error_is_reported_not_raised(tiny, capfd):
    tiny.write_text(tiny.read_text() + "\nthis is not C++;\n")
    assert build_extension("tiny", [tiny], ["-DOFFSET=0"], timeout_s=5) is None
    assert "the compiler failed" in native_build.FAILURES["tiny"]
    assert not list(Path(os.environ["LLMCTL_KERNEL_CACHE"]).glob("*.so"))  # nothing half-written


def test_an_engine_start_behind_a_live_build_runs_on_torch_and_says_so(tmp_path):
    """The engine's own kernels, with an empty cache and their build lock held by another process:
    the start completes after the (short) time limit, on the torch path. The engine's other native
    modules come from the kernel cache when already built there (as scripts/setup.sh does):
    compiling all of them from nothing again took minutes of this test's time."""
    from llmctl_kernels.cpu_native import NAME

    for built in native_build.cache_dir().glob("*.so"):
        if not built.name.startswith(f"{NAME}_") and ".partial." not in built.name:
            (tmp_path / built.name).symlink_to(built)
    env = {**os.environ, "LLMCTL_KERNEL_CACHE": str(tmp_path), "LLMCTL_NATIVE_BUILD_TIMEOUT": "1",
           "PYTHONPATH": str(ROOT)}
    script = textwrap.dedent(f"""
        import fcntl, os
        from llmctl_kernels.cpu_native import CFLAGS, HEADERS, LDFLAGS, NAME, SOURCE
        from llmctl_kernels.native_build import module_name_for
        lock = os.path.join({str(tmp_path)!r}, module_name_for(NAME, [SOURCE], CFLAGS, LDFLAGS, HEADERS) + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        child = os.fork()
        if child == 0:  # the child holds the lock as a build in progress would
            fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b"%d\\n" % os.getpid())
            import time; time.sleep(60); os._exit(0)
        import signal, time; time.sleep(1.0)
        from llmctl.engine.llm_engine import LLMEngine
        engine = LLMEngine(kv_cache_memory=8 << 20, skip_tokenizer=True)
        print("ops:", engine.ops.description, flush=True)
        os.kill(child, signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ops: torch\n" in proc.stdout
    assert "waiting for pid" in proc.stderr and "running on the pure-torch path" in proc.stderr
