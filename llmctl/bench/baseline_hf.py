"""The ``--baseline hf`` comparison: the same workload through ``transformers`` static batching on
the same weights, in the same process (same torch threads, same dtype).

Static batching, as a closed-loop client with ``concurrency`` requests in flight sees it: requests
go in batches of ``concurrency`` in dataset order; each batch is left-padded and run by
``generate(do_sample=False)`` until its longest request is done, and only then does the next
batch start. So for a request:

- start = its batch's start (it was sent when the previous batch returned);
- token times = the decoding steps of ``generate`` (a streamer timestamps each step), the first
  after the batch's prefill; its own first ``output_len`` steps are its tokens;
- end = the batch's end, because ``generate`` returns the whole batch at once.

Every request generates exactly as many tokens as it got from llmctl in the measured run (EOS is
ignored), so both sides do the same work; throughput counts only those tokens, not the padding
steps of requests that finished early. ``transformers`` is a development dependency, imported
only here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmctl.bench.datasets import BenchRequest
from llmctl.bench.metrics import RequestRecord
from llmctl.bench.runner import RunResult
from llmctl.errors import LlmctlError
from llmctl.models.registry import CausalLM
from llmctl.tokenizer import Tokenizer
from llmctl_kernels.fp32_linear import unpack_panels

BASELINES = ("hf",)


class BaselineError(LlmctlError):
    """The baseline cannot run (transformers missing, model it cannot build)."""


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise BaselineError(
            "--baseline hf needs the `transformers` package: pip install 'llmctl[dev]' (or pip install transformers)"
        ) from exc
    return transformers


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """llmctl's weights under Hugging Face's names: the merged ``qkv_proj`` and ``gate_up_proj``
    matrices (and biases) split back into their parts; every other name already matches."""
    layer = model.model.layers[0]
    qkv_sizes = layer.self_attn.qkv_proj.part_sizes
    gate_up_sizes = layer.mlp.gate_up_proj.part_sizes
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_mkldnn:  # a CPU-prepacked linear weight (llmctl.layers.linear.prepack_for_cpu)
            tensor = tensor.to_dense()
        elif tensor.dim() == 3:  # a panel-packed fp32 linear weight (same function)
            tensor = unpack_panels(tensor, model.get_submodule(name.rsplit(".", 1)[0]).out_features)
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv_sizes)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), tensor.split(gate_up_sizes)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = tensor
    return out


def to_hf_model(model: CausalLM) -> Any:
    """A ``transformers`` model with the same config and the same weights (tensor-parallel size 1)."""
    transformers = require_transformers()
    raw = dict(model.config.raw)
    model_type = raw.pop("model_type", None) or model.config.family
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    dtype = next(model.parameters()).dtype
    config = transformers.AutoConfig.for_model(model_type, **raw)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    ours = hf_state_dict(model)
    wanted = hf.state_dict()
    missing = sorted(set(wanted) - set(ours))
    if missing:
        raise BaselineError(
            f"cannot map llmctl's weights onto transformers' {type(hf).__name__}: missing {missing[:4]}"
        )
    with torch.no_grad():
        for name, tensor in wanted.items():
            if tensor.shape != ours[name].shape:
                raise BaselineError(
                    f"{name}: transformers expects {tuple(tensor.shape)}, llmctl has {tuple(ours[name].shape)}"
                )
            tensor.copy_(ours[name])
    hf.generation_config.eos_token_id = None  # generate exactly the asked tokens (ignore EOS)
    return hf.eval()


class _StepClock:
    """A ``generate`` streamer that only timestamps: the first ``put`` is the prompt, each later one
    a decoding step of the whole batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _prompt_ids(request: BenchRequest, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(request.prompt, list):
        return request.prompt
    if tokenizer is None:
        raise BaselineError("text prompts need a tokenizer for the transformers baseline")
    return tokenizer.encode(request.prompt)


def run_static_batches(
    hf_model: Any,
    requests: Sequence[BenchRequest],
    batch_size: int,
    tokenizer: Tokenizer | None,
    pad_token_id: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Run ``requests`` in consecutive left-padded batches; see the module docstring for timings."""
    from transformers.generation.streamers import BaseStreamer

    clock_type = type("StepClock", (_StepClock, BaseStreamer), {})
    records: list[RequestRecord] = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = list(requests[first : first + batch_size])
        prompts = [_prompt_ids(r, tokenizer) for r in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(r.output_len for r in batch)
        clock = clock_type()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_token_id,
                streamer=clock,
            )
        batch_end = time.perf_counter()
        steps = clock.times[1:]
        for request, prompt in zip(batch, prompts):
            record = RequestRecord(
                start=batch_start,
                end=batch_end,
                chunk_times=steps[: request.output_len],
                prompt_tokens=len(prompt),
                output_tokens=min(request.output_len, len(steps)),
            )
            records.append(record)
            if on_done is not None:
                on_done(record)
    return RunResult(records, time.perf_counter() - started, target="transformers static batching")
