"""An AVX2-only CPU, emulated on a newer one for side-by-side runs (``EMULATE_ISA=avx2`` in
benchmarks/run_peer_comparison.sh and run_smollm2_comparison.sh put this folder on PYTHONPATH).

Python imports ``sitecustomize`` at start-up in every process, the engines' worker processes too.
Here it makes torch report no AVX-512, AVX512-BF16, VNNI or AMX, so that vLLM loads its AVX2
library (``vllm._C_AVX2``) and its AVX2 attention, as it would on a Zen 3. The scripts also set
``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN),
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL) and ``LLMCTL_CPU_ISA=avx2`` (llmctl's kernels).

What this does not emulate: the core itself (pipes, caches, clock, memory bandwidth). Figures from
it say how the engines' AVX2 code paths compare on this machine, not what a Zen 3 measures.
"""

import os

if os.environ.get("EMULATE_ISA") == "avx2":
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_vnni_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
