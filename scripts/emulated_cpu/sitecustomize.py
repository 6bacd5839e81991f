"""A smaller x86 CPU, emulated on a newer one (``scripts/emulate_isa.sh`` puts this folder on
PYTHONPATH and sets ``EMULATE_ISA``).

Python imports ``sitecustomize`` at start-up in every process, test and engine worker processes
too. Here it makes torch's CPU probes report what the emulated CPU lacks, so that code asking torch
(vLLM picks ``vllm._C_AVX2`` and its AVX2 attention this way, llmctl's dtype choice falls back to
them where /proc/cpuinfo is absent) sees that CPU:

- ``avx2``: no AVX-512, AVX512-BF16, VNNI or AMX (an AVX2-only Zen 3);
- ``generic``: not even AVX2.

The script also caps the libraries' own dispatch: ``ATEN_CPU_CAPABILITY`` (torch's kernels),
``ONEDNN_MAX_CPU_ISA`` (oneDNN), ``MKL_ENABLE_INSTRUCTIONS`` (MKL) and ``LLMCTL_CPU_ISA``
(llmctl's kernels). What this does not emulate: the core itself (pipes, caches, clock, memory
bandwidth). Figures from it say how code paths compare on this machine, not what a Zen 3 measures.
"""

import importlib.abc
import importlib.util
import os
import sys

_MISSING = {
    "avx2": (
        "_is_avx512_supported",
        "_is_avx512_vnni_supported",
        "_is_avx512_bf16_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
        "_is_vnni_supported",
    ),
}
_MISSING["generic"] = (*_MISSING["avx2"], "_is_avx2_supported")


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu`` right after torch is first imported, so a process that never imports
    torch (a CLI that only reads files) does not pay for it or change its behaviour."""

    def __init__(self, missing: tuple[str, ...]) -> None:
        self.missing = missing

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, missing = spec.loader.exec_module, self.missing

        def exec_and_patch(module):
            exec_module(module)
            for probe in missing:
                if hasattr(module.cpu, probe):
                    setattr(module.cpu, probe, lambda: False)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("EMULATE_ISA") in _MISSING:
    sys.meta_path.insert(0, _PatchTorchOnImport(_MISSING[os.environ["EMULATE_ISA"]]))
