"""The thread that loads a model hands its OpenMP workers over before the engine thread steps: one
pool in the process, not two (llmctl/engine/openmp.py says why that matters for speed)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.openmp import loaded_openmp_runtime, release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or loaded_openmp_runtime() is None,
                                reason="finds the OpenMP runtime and counts threads through /proc (Linux)")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(expected: int, timeout_s: float = 5.0) -> int:
    """The thread count once it equals ``expected`` (a released worker exits asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while os_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()


def parallel_region() -> None:
    torch.randn(1 << 22).exp_()  # large enough for at::parallel_for to use every thread


def in_fresh_thread(fn: Callable[[], object]) -> object:
    """Run ``fn`` in a thread of its own, so its OpenMP pool is not the test runner's."""
    result: list[object] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
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
    def body() -> tuple[int, int, int, bool]:
        alone = os_threads()
        parallel_region()  # this thread's pool: one worker beside it
        with_pool = os_threads()
        released = release_thread_pool()
        return alone, with_pool, settled_threads(alone), released

    alone, with_pool, after, released = in_fresh_thread(body)
    assert released
    assert with_pool == alone + 1
    assert after == alone


def test_async_engine_start_leaves_only_the_loop_threads_pool(two_threads, stories_dir):
    def body() -> tuple[int, int]:
        engine = LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20)
        parallel_region()  # the loading thread's pool exists (loading may already have made it)
        with_pool = os_threads()
        async_engine = AsyncEngine(engine).start()  # the idle loop thread computes nothing yet
        try:
            # +1 for the loop thread, -1 for the loading thread's released worker
            return with_pool, settled_threads(with_pool)
        finally:
            async_engine.shutdown()

    with_pool, after_start = in_fresh_thread(body)
    assert after_start == with_pool
