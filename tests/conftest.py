"""Shared test setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is first compiled, so it is set
here, at import time of the test session, for every test module.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# GPTQ results (--calibration) go to a folder of this session, not the user's cache: every test
# run computes its own (tests/layers/test_gptq.py checks the cache itself).
os.environ.setdefault("LLMCTL_GPTQ_CACHE", tempfile.mkdtemp(prefix="llmctl-gptq-"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from llmctl.platform import apply_isa_cap  # noqa: E402

apply_isa_cap()  # LLMCTL_CPU_ISA (the emulated-CPU runs) caps the kernels of every test, engines or not

REPO_ROOT = Path(__file__).resolve().parent.parent
STORIES_DIR = REPO_ROOT.parent / "shared" / "models" / "stories260k"

torch.set_num_threads(int(os.environ.get("LLMCTL_TEST_THREADS", max(1, min(2, os.cpu_count() or 1)))))


# Test tiers (scripts/test.sh), by where a test lives, so a new test in one of these places is
# tiered too. `subprocess`: starts servers, CLIs or other Python processes; `parallel`: torchrun
# ranks; `slow`: long in process; `native`: native CPU kernels and the paths that choose them, which
# scripts/test.sh runs again with the ISA capped at AVX2 and at generic.
TIERS: dict[str, tuple[str, ...]] = {
    "subprocess": (
        "server/",
        "deploy/",
        "router/test_router_e2e.py",
        "bench/test_cli.py",
        "bench/test_runner.py",
        "chat/test_chat.py",
        "hub/",
        "test_main_cli.py",
        "test_packaging.py",
        "test_perplexity.py",
        "tui/test_real_server.py",
        "tui/test_reconnect.py",
        "engine/test_host_malloc.py",
        "kernels/test_native_module.py",
        "models/test_stories.py",
        "lora/test_lora_server.py",
        "models/test_gguf_vs_llama_cpp.py",
    ),
    "parallel": ("parallel/",),
    "slow": (
        "models/test_gguf_smollm2.py",
        "bench/test_baseline_hf.py",
        "kernels/test_triton_",
        "layers/test_triton_",
        "layers/test_gptq.py",
        "lora/test_lora_kernels.py",
        "lora/test_lora_engine.py",
        "models/test_gguf_moe.py",
    ),
    "native": (
        "kernels/test_cpu_native.py",
        "kernels/test_gemm_native.py",
        "kernels/test_int8_gemm.py",
        "kernels/test_kivi_store_native.py",
        "kernels/test_kv_codes_native.py",
        "kernels/test_kv_quant_native.py",
        "kernels/test_quant_half_scales.py",
        "kernels/test_quant_interleaved.py",
        "kernels/test_quant_native.py",
        "models/test_decode_loop.py",
        "models/test_dtype_choice.py",
        "models/test_models_exact.py",
        "models/test_gguf_packed.py",
        "engine/test_batching.py",
        "engine/test_kv_quant_engine.py",
        "layers/test_quantization.py",
        "test_platform.py",
    ),
}
TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        where = Path(item.fspath).resolve().relative_to(TESTS_DIR).as_posix()
        for marker, places in TIERS.items():
            if where.startswith(places):
                item.add_marker(marker)


@pytest.fixture
def gemm_from_one_row():
    """Every row count through the native int4/int8 many-row GEMM, whose outputs do not depend on
    the number of rows (kernels/cpu/qgemm.h); below its threshold the int16 passes round
    differently. Nothing changes without the native kernels."""
    from llmctl_kernels.quant_native import load_quant_native, native_unavailable_reason

    module = load_quant_native() if native_unavailable_reason() is None else None
    previous = None if module is None else module.set_qgemm_min_rows(1)
    yield
    if previous is not None:
        module.set_qgemm_min_rows(previous)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real pretrained stories260k model, read in place from ../shared (never copied)."""
    if not (STORIES_DIR / "model.safetensors").is_file():
        pytest.skip(f"{STORIES_DIR} is absent")
    return STORIES_DIR


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random-weight checkpoint per supported family, saved by ``transformers``."""
    from model_factory import FAMILIES, make_hf_model

    root = tmp_path_factory.mktemp("hf_models")
    return {family: make_hf_model(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def llama_dir(hf_model_dirs) -> Path:
    return hf_model_dirs["llama"]


@pytest.fixture(scope="session")
def llama64_dir(tmp_path_factory) -> Path:
    """The tiny Llama with head_dim 64 (the others have 16): the head sizes the native kernels
    specialize, e.g. the 8-bit KV kernels and the decode loop's attention, start at 64."""
    from model_factory import make_hf_model

    return make_hf_model("llama", tmp_path_factory.mktemp("hf_models") / "llama-head64", seed=11, head_dim=64)


@pytest.fixture(autouse=True)
def _sigint_left_as_found():
    """A test that leaves SIGINT ignored, handled or blocked in this process fails here, by name, and
    the disposition is put back. (A pytest started as a background job of a non-interactive shell
    has SIGINT ignored from the start: that is kept, not flagged. Children that must see Ctrl-C set
    it to the default themselves, as tests/chat/test_chat.py does.)"""
    import signal

    handler, blocked = signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    handler_after = signal.getsignal(signal.SIGINT)
    blocked_after = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if handler_after is not handler or blocked_after != blocked:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, {signal.SIGINT})
        pytest.fail(
            f"this test changed SIGINT in the pytest process: handler {handler!r} -> {handler_after!r}, "
            f"blocked {blocked} -> {blocked_after}"
        )
