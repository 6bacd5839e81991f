"""Perplexity of a model loaded with each ``--quantization`` against its float32 self.

MODEL is a float checkpoint directory (quantized on the fly by the loader, as ``--quantization``
does) or a GGUF model (a ``.gguf`` file or a packaged short name such as ``smollm2-135m``): its
weights are dequantized to float32 and that float32 model is the reference, every linear layer
then quantized on the fly by the same ``OnTheFlyQuantMethod``.

Runs the model directly (one fresh prefill per window, no KV cache kept): the engine's prompt-
logprobs path is not used, so this measures the weights alone. Each window of WINDOW tokens is
scored independently; perplexity = exp(mean negative log-likelihood of tokens 2..WINDOW). KLD is
the mean KL divergence of each kind's next-token distributions from the first kind's (as llama.cpp's
``llama-perplexity --kl-divergence`` reports): less noisy than a perplexity difference on a few
thousand tokens, where a rounding error can lower perplexity by luck. ``load s`` is the wall time of
loading the model with that quantization (the first kind's row is the load without it).

    python -m benchmarks.quality.quant_quality ../shared/models/stories260k --text benchmarks/data/fables.txt
    python -m benchmarks.quality.quant_quality smollm2-135m --text benchmarks/data/fables.txt
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from unittest import mock

import torch

from llmctl.layers.linear import LinearBase
from llmctl.layers.ops import AttentionMetadata, TorchOps
from llmctl.layers.quantization import linear_method_for
from llmctl.models.calibration import SCRATCH_BLOCK_SIZE, bind_scratch_kv, calibrate_quantization, calibration_tokens
from llmctl.models.gguf import gguf_tokenizer, load_gguf
from llmctl.models.gguf_files import resolve_gguf_spec
from llmctl.models.loader import load_model
from llmctl.tokenizer import Tokenizer
from llmctl_kernels.fp32_linear import unpack_panels

CPU = torch.device("cpu")


def load_quantized(model: str, kind: str, group_size: int, calibration: str | None = None):
    """``model`` with every linear layer quantized as ``--quantization kind`` (and ``--calibration``)
    does."""
    gguf_file = resolve_gguf_spec(model)
    if gguf_file is None:
        return load_model(
            Path(model),
            dtype="float32",
            device=CPU,
            ops=TorchOps(),
            quantization=kind,
            quantization_group_size=group_size,
            calibration=calibration,
        )
    # Keep the float layers' plain [N, K] weights (no CPU prepacking), so that they can be quantized
    # after loading, as the checkpoint loader quantizes them before any prepacking.
    with mock.patch("llmctl.layers.linear.prepack_for_cpu", return_value=None):
        loaded, _ = load_gguf(
            gguf_file, dtype="float32", device=CPU, ops=TorchOps(), with_tokenizer=False, quantization="none"
        )
    method = linear_method_for(kind, group_size)
    if method is not None:
        with torch.no_grad():
            for layer in loaded.modules():
                if isinstance(layer, LinearBase):
                    if layer.weight.dim() == 3:  # fp32 packed in panels for the native GEMM: back to [N, K]
                        layer.weight.data = unpack_panels(layer.weight.data, layer.out_features)
                    layer.method = method
            if calibration is not None:
                calibrate_quantization(loaded, calibration_tokens(calibration, gguf_tokenizer(gguf_file)))
            for layer in loaded.modules():
                if isinstance(layer, LinearBase) and layer.method is method:
                    method.process_weights_after_loading(layer)
            head = loaded.lm_head  # the LM head as the loader sets it up for this method
            head.logits_quantization = getattr(method, "logits_quantization", None)
            if head.logits_quantization and head.packed_format is None:
                head.process_weights_after_loading()
    return loaded


def load_tokenizer(model: str) -> Tokenizer:
    gguf_file = resolve_gguf_spec(model)
    return Tokenizer.from_dir(Path(model)) if gguf_file is None else gguf_tokenizer(gguf_file)


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one fresh sequence (its K/V in a scratch cache)."""
    n = len(ids)
    bind_scratch_kv(model, n, torch.float32)
    hidden = model(torch.tensor(ids), torch.arange(n), AttentionMetadata.single_prefill(n, SCRATCH_BLOCK_SIZE))
    return model.compute_logits(hidden).float()


def score(model, tokens: list[int], window: int, reference: list[torch.Tensor] | None):
    """Perplexity, the number of predicted tokens, the mean KL divergence from ``reference`` (None:
    0) and this model's log-probabilities per window (a reference for the next kinds)."""
    nll, kld, count, logprobs = 0.0, 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, window):
            chunk = tokens[start : start + window]
            if len(chunk) < 2:
                break
            logp = torch.log_softmax(prefill_logits(model, chunk), dim=-1)[:-1]
            target = torch.tensor(chunk[1:])
            nll -= logp.gather(1, target[:, None]).sum().item()
            if reference is not None:
                ref = reference[len(logprobs)]
                kld += (ref.exp() * (ref - logp)).sum().item()
            logprobs.append(logp)
            count += len(chunk) - 1
    return math.exp(nll / count), count, kld / count, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a float checkpoint directory, a .gguf file or a packaged model name")
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--kinds", default="none,int8,fp8,int4:32,int4:64,int4:128")
    args = parser.parse_args()
    tokens = load_tokenizer(args.model).encode(args.text.read_text())
    kinds = args.kinds.split(",")
    base, reference = None, None
    print(f"{Path(args.model).name}: {len(tokens)} tokens of {args.text.name}, windows of {args.window}")
    for spec in kinds:
        name, _, calibration = spec.partition("+")  # int4:64+builtin = --calibration builtin
        kind, _, group = name.partition(":")
        started = time.perf_counter()
        model = load_quantized(args.model, kind, int(group or 64), calibration or None)
        load_s = time.perf_counter() - started
        ppl, count, kld, logprobs = score(model, tokens, args.window, reference)
        base, reference = base or ppl, reference or logprobs
        print(
            f"{spec:10s} perplexity {ppl:8.4f}  ({100 * (ppl / base - 1):+6.2f} % vs {kinds[0]}, "
            f"{count} predicted tokens)  KLD {kld:.5f}  load {load_s:5.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
