"""The thread that loads a model hands its OpenMP workers over before the engine thread steps: one
pool in the process, not two (llmctl/engine/openmp.py says why that matters for speed)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.openmp import loaded_openmp_runtime, release_thread_pool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or loaded_openmp_runtime() is None,
    reason="finds the OpenMP runtime and counts threads through /proc (Linux)",
)


def threads_named(name: str) -> set[int]:
    """Thread ids of this process whose name is ``name`` (threads inherit their creator's name)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == name:
                found.add(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def set_own_name(name: str) -> None:
    libc = ctypes.CDLL(None)
    assert libc.prctl(15, name.encode(), 0, 0, 0) == 0  # PR_SET_NAME: threads made from now on inherit it


def workers_of_this_thread(name: str) -> set[int]:
    """The OpenMP workers this thread made (after ``set_own_name(name)``): its namesakes but itself."""
    return threads_named(name) - {threading.get_native_id()}


def gone(tids: set[int], name: str, timeout_s: float = 10.0) -> bool:
    """True once none of ``tids`` is alive. The runtime returns from the release once every worker
    has left its pool; each then exits on its own, so the wait is bounded, not a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while tids & threads_named(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def thread_states(tids: set[int]) -> dict[int, str]:
    """Each thread's State line from /proc (for a failure message): what a worker that did not
    exit is doing."""
    states = {}
    for tid in tids:
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
            states[tid] = next(line for line in status.splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            states[tid] = "gone"
    return states


def parallel_region() -> None:
    torch.randn(1 << 22).exp_()  # large enough for at::parallel_for to use every thread


def in_fresh_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` in a thread of its own, so its OpenMP pool is not the test runner's."""
    result: list[object] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_runtime_is_torchs_openmp():
    assert loaded_openmp_runtime().name.startswith(("libgomp", "libiomp5", "libomp"))


def test_release_frees_the_calling_threads_workers(two_threads):
    def body() -> tuple[set[int], bool, bool]:
        set_own_name("llmctl-omp-t1")
        parallel_region()  # this thread's pool: one worker beside it, named after it
        workers = workers_of_this_thread("llmctl-omp-t1")
        released = release_thread_pool()
        return workers, released, gone(workers, "llmctl-omp-t1")

    workers, released, all_gone = in_fresh_thread(body)
    assert len(workers) == 1 and released
    assert all_gone, f"workers still alive 10 s after the release: {thread_states(workers)}"


SECOND_RUNTIME = """
import ctypes, os, sys, threading, time
from pathlib import Path
import torch
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)  # mapped after torch's, as importing scikit-learn does
from llmctl.engine.openmp import loaded_openmp_runtime, release_thread_pool

def threads():
    return set(os.listdir("/proc/self/task"))

runtime = loaded_openmp_runtime()
assert runtime is not None and runtime.resolve().parent == (Path(torch.__file__).parent / "lib").resolve(), runtime
torch.set_num_threads(2)
before = threads()
torch.randn(1 << 22).exp_()  # torch's pool for this thread: one worker beside it
workers = threads() - before
assert len(workers) == 1, workers
assert release_thread_pool()
deadline = time.monotonic() + 10
while workers & threads() and time.monotonic() < deadline:
    time.sleep(0.01)
assert not workers & threads(), "torch's worker survived the release"
print("ok", runtime)
"""


def other_openmp_runtime() -> Path | None:
    """A libgomp that is not torch's: scikit-learn's vendored copy (a test dependency through
    lm-eval), else the system's."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        vendored = sorted((Path(spec.origin).parent.parent / "scikit_learn.libs").glob("libgomp*.so*"))
        if vendored:
            return vendored[0]
    system = Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    return system if system.exists() else None


def test_a_second_runtime_in_the_process_is_not_the_one_released():
    """Another package's OpenMP runtime mapped after torch's comes first in /proc/self/maps; the
    release must still reach torch's runtime, whose pools the engine's kernels use."""
    other = other_openmp_runtime()
    if other is None:
        pytest.skip("no second OpenMP runtime on this machine to load beside torch's")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", SECOND_RUNTIME, str(other)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stderr[-2000:]


def test_async_engine_start_releases_the_loading_threads_workers(two_threads, stories_dir):
    def body() -> tuple[set[int], bool]:
        set_own_name("llmctl-omp-t2")
        engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
        parallel_region()  # the loading thread's pool exists (loading may already have made it)
        workers = workers_of_this_thread("llmctl-omp-t2")
        async_engine = AsyncEngine(engine).start()  # the idle loop thread computes nothing yet
        try:
            return workers, gone(workers, "llmctl-omp-t2")
        finally:
            async_engine.shutdown()

    workers, all_gone = in_fresh_thread(body)
    assert workers and all_gone
