"""Compile every Triton kernel for a real GPU target (sm_90, Hopper) on a machine without one.

Triton's wheel carries the whole NVIDIA toolchain (LLVM's NVPTX backend and ptxas), so the
kernels can be lowered all the way to a cubin here: this catches code that the interpreter runs
but the compiler rejects (shape rules of ``tl.dot``, dtype mixes, constexpr misuse) before a GPU
is ever touched. The public ``*_triton`` wrappers are called with CPU tensors at GPU-like shapes;
each launch is intercepted, its signature derived from the arguments, and the kernel compiled
(not run). Run as a script (TRITON_INTERPRET must be unset, the test does that in a subprocess)::

    python tests/kernels/sm90_compile.py [--verbose] [--quick]

Prints one line per compiled kernel (registers, spills, shared memory) and exits non-zero on the
first failure.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

try:  # Triton internals (3.4+): the launcher's own binder, so specialisation matches a real launch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    print(f"unsupported Triton {triton.__version__} internals: {exc}")
    sys.exit(3)

TARGET = GPUTarget("cuda", 90, 32)
MAX_DYNAMIC_SMEM = 227 * 1024  # per block on H100/H200
RESULTS: list[str] = []
VERBOSE = "--verbose" in sys.argv
QUICK = "--quick" in sys.argv  # bf16 and the main shapes only (the CPU test suite's variant)


def _resource_usage(cubin: bytes) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if not fields:
        return ""
    return (
        f"regs={fields.get('REG')} smem={fields.get('SHARED')} stack={fields.get('STACK')} local={fields.get('LOCAL')}"
    )


def _compile_launch(self: JITFunction, *args, grid, warmup, **kwargs):
    """Stands in for ``JITFunction.run``: the same argument binding and specialisation as a real
    launch (alignment of pointers and divisibility of integers by 16, integers equal to 1 folded),
    then compilation for ``TARGET`` instead of a launch."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    usage = _resource_usage(kernel.asm["cubin"])
    shown = {self.arg_names[k[0]]: v for k, v in constexprs.items() if self.arg_names[k[0]].isupper()}
    line = (
        f"{self.__name__:<26} {usage} dyn_smem={kernel.metadata.shared} "
        f"warps={options.num_warps} stages={options.num_stages} {shown}"
    )
    RESULTS.append(line)
    if kernel.metadata.shared > MAX_DYNAMIC_SMEM:
        raise RuntimeError(f"{line}: needs {kernel.metadata.shared} B of shared memory, sm_90 has {MAX_DYNAMIC_SMEM}")
    print(line if VERBOSE else f"ok {self.__name__} {usage} dyn_smem={kernel.metadata.shared}", flush=True)


def main() -> int:
    JITFunction.run = _compile_launch  # compile instead of launching

    from llmctl_kernels.activation import silu_and_mul_triton
    from llmctl_kernels.decode_attention import paged_decode_attention_triton
    from llmctl_kernels.kv_store import reshape_and_cache_triton
    from llmctl_kernels.prefill_attention import paged_prefill_attention_triton, varlen_causal_attention_triton
    from llmctl_kernels.rms_norm import rms_norm_triton
    from llmctl_kernels.rotary import rotary_embedding_triton

    decode_shapes = [(32, 8, 128, 1), (32, 8, 128, 4), (8, 8, 64, 1), (4, 1, 16, 2)]
    prefill_shapes = [(32, 8, 128), (8, 8, 64), (8, 1, 128), (8, 2, 256)]
    dtypes = [torch.bfloat16, torch.float32]
    if QUICK:
        decode_shapes, prefill_shapes, dtypes = decode_shapes[1:2] + decode_shapes[3:], prefill_shapes[:1], dtypes[:1]
    for dtype in dtypes:
        # decode: Llama-8B-like GQA (32q/8kv, D=128) with and without split-K; MHA D=64; small D.
        for hq, hkv, d, splits in decode_shapes:
            q = torch.empty(2, hq, d, dtype=dtype)
            kc = torch.empty(8, 16, hkv, d, dtype=dtype)
            bt = torch.zeros(2, 4, dtype=torch.int32)
            sl = torch.tensor([64, 10], dtype=torch.int32)
            paged_decode_attention_triton(q, kc, kc, bt, sl, 0.1, max_seq_len=4096, num_splits=splits)
        # prefill: paged and contiguous, GQA 4, MHA, MQA, D 128 / 64 / 256.
        for hq, hkv, d in prefill_shapes:
            q = torch.empty(40, hq, d, dtype=dtype)
            kc = torch.empty(8, 16, hkv, d, dtype=dtype)
            k = torch.empty(40, hkv, d, dtype=dtype)
            qsl = torch.tensor([0, 30, 40], dtype=torch.int32)
            sl = torch.tensor([50, 10], dtype=torch.int32)
            bt = torch.zeros(2, 4, dtype=torch.int32)
            paged_prefill_attention_triton(q, kc, kc, bt, qsl, sl, 0.1)
            if d == 128:
                varlen_causal_attention_triton(q, k, k, qsl, 0.1)
        # elementwise
        x = torch.empty(4, 4096, dtype=dtype)
        rms_norm_triton(x, torch.empty(4096, dtype=dtype), 1e-5, torch.empty_like(x))
        rms_norm_triton(x, torch.empty(4096, dtype=dtype), 1e-5)
        silu_and_mul_triton(torch.empty(4, 2 * 14336, dtype=dtype))
        pos = torch.zeros(4, dtype=torch.int64)
        cs = torch.empty(128, 128, dtype=torch.float32)
        rotary_embedding_triton(pos, torch.empty(4, 32, 128, dtype=dtype), torch.empty(4, 8, 128, dtype=dtype), cs)
        rotary_embedding_triton(pos, torch.empty(4, 8, 64, dtype=dtype), torch.empty(4, 2, 64, dtype=dtype), cs[:, :32])
        kc = torch.empty(8, 16, 8, 128, dtype=dtype)
        reshape_and_cache_triton(
            torch.empty(4, 8, 128, dtype=dtype),
            torch.empty(4, 8, 128, dtype=dtype),
            kc,
            kc,
            torch.zeros(4, dtype=torch.int64),
        )
    _compile_quantized_kv(QUICK)
    _compile_fused_experts(dtypes)
    print(f"compiled {len(RESULTS)} kernel variants for sm_90")
    return 0


def _compile_quantized_kv(quick: bool) -> None:
    """The kernels over the quantized KV cache (--kv-cache-dtype): every format's store, decode
    (split and not) and prefill, at a Llama-8B-like GQA shape (32q/8kv, D=128), bf16 (and fp32)."""
    from llmctl.engine.kv_cache import KVFormat
    from llmctl_kernels.decode_attention import paged_decode_attention_quantized_triton
    from llmctl_kernels.kv_store import kivi_quantize_blocks_triton, quantize_and_cache_triton
    from llmctl_kernels.prefill_attention import paged_prefill_attention_quantized_triton

    hq, hkv, d, bs = 32, 8, 128, 16
    kinds = ("fp8_e4m3", "int8", "kivi2") if quick else ("fp8_e4m3", "fp8_e5m2", "int8", "kivi2", "kivi4")
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    for dtype, kind in itertools.product(dtypes, kinds):
        fmt = KVFormat(kind, 1, hkv, d, bs, dtype)
        cache = {name: torch.empty(8, *shape, dtype=dt) for name, (shape, dt) in fmt.tensor_shapes().items()}
        residual = torch.empty(4, bs, hkv, d, dtype=dtype)
        fp = (residual, residual, torch.zeros(8, dtype=torch.int64)) if fmt.is_kivi else None
        q = torch.empty(2, hq, d, dtype=dtype)
        bt = torch.zeros(2, 4, dtype=torch.int32)
        sl = torch.tensor([64, 10], dtype=torch.int32)
        for splits in (1, 4):
            paged_decode_attention_quantized_triton(
                q, cache, kind, bt, sl, 0.1, full_precision=fp, max_seq_len=4096, num_splits=splits
            )
        qp = torch.empty(40, hq, d, dtype=dtype)
        kivi = (
            dict(full_precision=(residual, residual, torch.zeros(8, dtype=torch.int32)), residual=fp, window=8 * bs)
            if fmt.is_kivi
            else {}
        )  # KIVI: a 128-token residual window
        paged_prefill_attention_quantized_triton(
            qp,
            cache,
            kind,
            bt,
            torch.tensor([0, 30, 40], dtype=torch.int32),
            torch.tensor([50, 10], dtype=torch.int32),
            0.1,
            **kivi,
        )
        kv = torch.empty(4, hkv, d, dtype=dtype)
        if fmt.is_kivi:
            index = torch.zeros(2, dtype=torch.int64)
            kivi_quantize_blocks_triton(residual, residual, index, index, cache, fmt.bits)
        else:
            quantize_and_cache_triton(kv, kv, cache, kind, torch.zeros(4, dtype=torch.int64))


def _compile_fused_experts(dtypes: list[torch.dtype]) -> None:
    """The fused-experts launches at a Qwen3-30B-A3B-like shape (128 experts, top 8, H=2048,
    I=768), with and without gpt-oss's biases."""
    from llmctl_kernels.activation import silu_and_mul_torch
    from llmctl_kernels.moe_triton import fused_experts_triton

    experts, hidden, inter, tokens, top_k = 128, 2048, 768, 6, 8
    for dtype in dtypes:
        x = torch.empty(tokens, hidden, dtype=dtype)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=dtype)
        fused_experts_triton(x, w13, w2, weights, ids, silu_and_mul_torch)
        bias13 = torch.zeros(experts, 2 * inter, dtype=dtype)
        bias2 = torch.zeros(experts, hidden, dtype=dtype)
        fused_experts_triton(x, w13, w2, weights, ids, silu_and_mul_torch, bias13, bias2)


if __name__ == "__main__":
    sys.exit(main())
