"""LoRA adapters in the engine: each adapter's greedy output equals transformers + peft with the
adapter merged (fp32, CPU); a batch mixing the base model and three adapters, arriving staggered,
gives every request exactly its tokens alone; prefix-cache keys carry the adapter."""

from __future__ import annotations

import pytest
import torch
from lora_factory import MAX_NEW, engine_with, merged_greedy, run_alone
from model_factory import random_prompts

from llmctl.sampling_params import SamplingParams
from llmctl_kernels.cpu_native import load_native, native_unavailable_reason


@pytest.mark.parametrize("kernels", ["native CPU", "grouped torch"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_each_adapter_matches_peft_merged(family, kernels, lora_bases, lora_adapters, monkeypatch) -> None:
    """Through the native CPU kernel, and through torch's GEMMs with the native kernels off."""
    if kernels == "native CPU" and load_native() is None:
        pytest.skip(f"native CPU kernels: {native_unavailable_reason()}")
    monkeypatch.setenv("LLMCTL_NATIVE_CPU_KERNELS", "1" if kernels == "native CPU" else "0")
    base, adapters = lora_bases[family], lora_adapters[family]
    prompts = random_prompts(2, 320, 5, 20, seed=3)
    engine = engine_with(base, adapters)
    assert engine.lora.kernel.name.startswith(kernels)
    base_tokens = merged_greedy(base, None, prompts, MAX_NEW)
    for name, path in [(None, None), *adapters.items()]:
        expected = merged_greedy(base, path, prompts, MAX_NEW)
        if name is not None:
            assert expected != base_tokens, f"adapter {name} should change the output"
        got = [run_alone(engine, p, name) for p in prompts]
        assert got == expected, f"{family} adapter {name}"
    assert not engine.block_manager.usage  # every block back


def test_rank_and_alpha_patterns_match_peft(lora_bases, tmp_path) -> None:
    """PEFT's per-module ``rank_pattern`` / ``alpha_pattern`` (a name suffix, and a regex over one
    layer): each target gets its own rank and scale, and the output equals the merged model's."""
    from lora_factory import ALL_LINEAR, make_adapter

    base = lora_bases["llama"]
    adapter = make_adapter(
        base,
        tmp_path / "patterns",
        rank=8,
        targets=ALL_LINEAR,
        seed=41,
        alpha=16,
        std=0.15,
        rank_pattern={"q_proj": 32, r"layers\.1\.mlp\.down_proj": 4},
        alpha_pattern={"v_proj": 96, "o_proj": 2},
    )
    engine = engine_with(base, {"patterns": adapter})
    parts = engine.lora.adapters["patterns"].modules
    q = parts["model.layers.0.self_attn.qkv_proj"]
    assert [(p.a.shape[0], p.scale) for p in sorted(q, key=lambda p: p.offset)] == [
        (32, 16 / 32),
        (8, 16 / 8),
        (8, 96 / 8),
    ]  # q, k, v
    assert parts["model.layers.1.mlp.down_proj"][0].a.shape[0] == 4
    assert parts["model.layers.0.mlp.down_proj"][0].a.shape[0] == 8
    prompts = random_prompts(2, 320, 5, 20, seed=6)
    expected = merged_greedy(base, adapter, prompts, MAX_NEW)
    assert expected != merged_greedy(base, None, prompts, MAX_NEW)
    assert [run_alone(engine, p, "patterns") for p in prompts] == expected
    assert not engine.block_manager.usage


@pytest.mark.parametrize("max_loras", [3, 2])
def test_mixed_batch_equals_alone(max_loras, lora_bases, lora_adapters) -> None:
    """Base + 3 adapters in one batch (and one forward per step), staggered arrivals, chunked
    prefill: each request gets exactly the tokens it gets alone. With 2 slots, a third adapter's
    requests wait for one."""
    base, adapters = lora_bases["llama"], lora_adapters["llama"]
    loras = [None, "r8", "r64", "mlp16", "r8", None, "r64", "mlp16"]
    prompts = random_prompts(len(loras), 320, 3, 40, seed=5)
    alone_engine = engine_with(base, adapters)
    alone = [run_alone(alone_engine, p, lora) for p, lora in zip(prompts, loras)]
    engine = engine_with(base, adapters, max_num_batched_tokens=32, max_loras=max_loras)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ids: list[str] = []
    results: dict[str, list[int]] = {}
    most_adapters = 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        if len(ids) < len(prompts):  # a new request every step, while others prefill and decode
            i = len(ids)
            ids.append(engine.add_request(prompts[i], params, lora=loras[i]))
        running = {seq.lora.name if seq.lora else None for seq in engine.scheduler.running}
        assert len(running - {None}) <= max_loras
        if None in running:
            most_adapters = max(most_adapters, len(running) - 1)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.outputs[0].token_ids)
    assert most_adapters == max_loras  # the base model and that many adapters did share batches
    assert [results[i] for i in ids] == alone
    assert not engine.block_manager.usage


def test_prefix_cache_key_includes_adapter(lora_bases, lora_adapters) -> None:
    base, adapters = lora_bases["llama"], lora_adapters["llama"]
    engine = engine_with(base, adapters)
    prompt = random_prompts(1, 320, 40, 40, seed=9)[0]  # two full blocks of 16 and a partial one

    def hit(lora: str | None) -> int:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), lora=lora)
        seq = engine.requests[rid].sequences()[0]
        while engine.has_unfinished():
            engine.step()
        return seq.num_cached_tokens

    assert hit("r8") == 0
    assert hit("r8") == 32  # the same adapter shares the prompt's full blocks
    assert hit("r64") == 0  # another adapter never does
    assert hit(None) == 0  # nor the base model
    assert hit(None) == 32
    engine.remove_lora("r8")
    engine.add_lora("r8", adapters["r8"])  # the same name loaded again is another adapter
    assert hit("r8") == 0


def test_triton_kernels_in_the_engine(lora_bases, lora_adapters) -> None:
    """The Triton kernels (the interpreter on a CPU) at the engine's selection point: a batch of the
    base model and two adapters gives each the merged model's tokens."""
    base, adapters = lora_bases["llama"], lora_adapters["llama"]
    engine = engine_with(base, adapters, kernel_backend="triton")
    assert engine.lora.kernel.name == "triton"
    prompt = random_prompts(1, 320, 6, 6, seed=4)[0]
    loras = [None, "r8", "r64"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params, lora=lora) for lora in loras]
    final = {}
    while engine.has_unfinished():
        final |= {out.request_id: list(out.outputs[0].token_ids) for out in engine.step() if out.finished}
    for rid, lora in zip(ids, loras):
        assert final[rid] == merged_greedy(base, lora and adapters[lora], [prompt], MAX_NEW)[0], lora


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_loop_adds_the_deltas_bitwise(dtype, lora_bases, lora_adapters, monkeypatch) -> None:
    """Decode steps with adapters run in the native decode loop (kernels/cpu/decode_loop.cpp), which
    adds each projection's deltas with the native LoRA kernel the module path calls: every step's
    logits equal the module path's bit for bit, for a batch mixing the base model and three
    adapters (rows of one adapter not adjacent: index groups, and adjacent: range groups)."""
    from llmctl.models.native_decode import ACTIVE

    base, adapters = lora_bases["llama"], lora_adapters["llama"]  # the loop does not take Qwen3's q/k norms
    loras = [None, "r8", "r64", "r8", "mlp16", "mlp16", None, "r64"]
    prompts = random_prompts(len(loras), 320, 3, 12, seed=9)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    def run(loop: bool) -> tuple[list[list[int]], list, int]:
        monkeypatch.setenv("LLMCTL_DECODE_LOOP", "1" if loop else "0")
        engine = engine_with(base, adapters, dtype=dtype)
        if loop and engine.runner.decode_path != ACTIVE:  # no compiler, or bf16 without oneDNN's prepacking
            pytest.skip(f"no native decode loop here: {engine.runner.decode_path}")
        runner, steps, native_steps = engine.runner, [], []
        execute, native = runner.execute, runner.native_decode
        if native is not None:
            runner.native_decode = lambda *a: native_steps.append(runner.lora.batch.plan is not None) or native(*a)
        runner.execute = _recording(execute, steps)
        ids = [engine.add_request(p, params, lora=lora) for p, lora in zip(prompts, loras)]
        results: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = list(out.outputs[0].token_ids)
        assert not engine.block_manager.usage
        return [results[i] for i in ids], steps, sum(native_steps)

    tokens, logits, adapted_loop_steps = run(loop=True)
    want_tokens, want_logits, _ = run(loop=False)
    assert adapted_loop_steps >= MAX_NEW - 2  # the loop ran the decode steps with adapters in the batch
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"


def _recording(execute, steps: list):
    def recording(sched):
        output = execute(sched)
        steps.append(output.logits.clone())
        return output

    return recording
