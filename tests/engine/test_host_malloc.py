"""llmctl.engine.host_malloc: a CPU engine keeps its large activation blocks instead of faulting
the same pages in again every step. Run in a fresh interpreter: the thresholds are per process."""

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import resource, torch
    from llmctl.engine.host_malloc import keep_large_allocations

    def faults_over_ten_allocations():  # 24 MB each, as a prefill chunk's gate-up output
        x = torch.empty(12 << 20, dtype=torch.bfloat16); x.fill_(1); del x
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            x = torch.empty(12 << 20, dtype=torch.bfloat16); x.fill_(1); del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

    before = faults_over_ten_allocations()
    applied = keep_large_allocations()
    print(before, applied, faults_over_ten_allocations())
""")


def test_large_blocks_are_reused_after_the_thresholds_are_set():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, applied, after = out.split()
    assert applied == "True"  # glibc (Linux CI)
    assert int(before) > 1000  # glibc's defaults: every 24 MB block is mapped and faulted afresh
    assert int(after) < 100


def test_a_cpu_engine_applies_them():
    probe = (
        "from llmctl.engine.llm_engine import LLMEngine\n"
        "from llmctl.engine.host_malloc import keep_large_allocations\n"
        "LLMEngine(model='tiny-random-llama', device='cpu', skip_tokenizer=True, kv_cache_memory=16 << 20)\n"
        "print(keep_large_allocations.cache_info().currsize)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "1"
