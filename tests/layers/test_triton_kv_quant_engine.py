"""The engine on the Triton kernels with a quantized KV cache (``--kv-cache-dtype``): on CUDA
``select_ops`` picks TritonOps, whose ``attend_quantized`` runs the quantized Triton kernels;
here they run in Triton's interpreter and must give the torch reference's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from model_factory import random_prompts

from llmctl.engine.kv_cache import KVFormat, QuantizedKVCache
from llmctl.engine.llm_engine import LLMEngine
from llmctl.layers import triton_ops
from llmctl.layers.attention import Attention
from llmctl.layers.backends import select_ops
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.sampling_params import SamplingParams


def _mixed_step(layer: Attention, kind: str) -> torch.Tensor:
    """One step of a 3-token prompt (blocks 2, 0) and a decode at position 4 (block 1), block size 4."""
    cache = QuantizedKVCache(KVFormat(kind, 1, 2, 16, 4, torch.float32), 4, 2, torch.device("cpu"))
    cache.zero_blocks(0, 4)
    layer.quantized_kv = cache.layer(0)
    slots = [8, 9, 10, 4]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_prefills=1,
        num_prefill_tokens=3,
        num_decodes=1,
        prefill_query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([3], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[2, 0]], dtype=torch.int32),
        prefill_is_fresh=True,
        decode_seq_lens=torch.tensor([5], dtype=torch.int32),
        decode_block_tables=torch.tensor([[3, 1]], dtype=torch.int32),
        max_decode_seq_len=5,
    )
    cache.begin_step(slots)
    return layer(torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), meta)


def test_cuda_dispatch_runs_the_quantized_triton_kernels(monkeypatch):
    """The decision itself (CI has no GPU): ``auto`` on CUDA gives TritonOps, and an attention
    layer holding a quantized KV view goes through its quantized Triton kernels; ``auto`` on a CPU
    keeps the torch reference."""
    ops = select_ops("auto", torch.device("cuda"))
    assert isinstance(ops, triton_ops.TritonOps)
    assert type(select_ops("auto", torch.device("cpu"))).attend_quantized is TorchOps.attend_quantized
    calls = []
    for name in (
        "quantize_and_cache_triton",
        "kivi_quantize_blocks_triton",
        "paged_prefill_attention_quantized_triton",
        "paged_decode_attention_quantized_triton",
    ):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    layer = Attention(4, 2, 16, 0.25, ops=ops)
    for kind, store in (("int8", "quantize_and_cache_triton"), ("kivi2", "kivi_quantize_blocks_triton")):
        calls.clear()
        torch.manual_seed(0)
        out = _mixed_step(layer, kind)
        assert calls == [store, "paged_prefill_attention_quantized_triton", "paged_decode_attention_quantized_triton"]
        torch.manual_seed(0)
        expected = _mixed_step(Attention(4, 2, 16, 0.25, ops=TorchOps()), kind)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8_e4m3", "kivi2"])  # every dtype: tests/kernels/test_triton_kv_quant.py
def test_triton_backend_matches_torch_with_quantized_kv(llama_dir, kind):
    # Two prompts share a 20-token prefix and the token budget forces chunked prefill, so cached
    # prefixes, chunks over quantized blocks, mixed prefill/decode steps and decodes all run. A
    # two-block KIVI window (not the default 128 tokens) makes window groups complete and get
    # quantized mid-prompt and mid-decode in these short sequences.
    prefix = list(range(10, 30))
    prompts = [prefix + p for p in random_prompts(2, 320, 3, 12, seed=2)] + random_prompts(1, 320, 5, 30, seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(
            model=str(llama_dir),
            kernel_backend=backend,
            kv_cache_memory=2 << 20,
            kv_cache_dtype=kind,
            skip_tokenizer=True,
            dtype="float32",
            max_num_batched_tokens=24,
            block_size=16,
            kv_residual_length=32,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
