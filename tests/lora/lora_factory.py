"""Random-weight PEFT LoRA adapters made with the real ``peft``, the oracle (transformers' greedy
generation with the adapter merged into the weights, fp32 on the CPU), and llmctl engines serving them."""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.config import EngineConfig
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 8


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: float = 16.0,
    use_rslora: bool = False,
    std: float = 0.3,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
) -> Path:
    """A PEFT adapter of ``base_dir`` with every lora_A/lora_B drawn at random (lora_B non-zero,
    so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int):
    """transformers + peft, the adapter merged into the weights (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model = model.eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def engine_with(base, adapters: dict, **overrides) -> LLMEngine:
    """A CPU fp32 engine on ``base`` serving ``adapters`` (name -> PEFT directory)."""
    settings = dict(
        model=str(base),
        dtype="float32",
        device="cpu",
        skip_tokenizer=True,
        kv_cache_memory=1 << 22,
        max_lora_rank=64,
        max_loras=4,
        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items()),
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def run_alone(engine: LLMEngine, prompt: list[int], lora: str | None) -> list[int]:
    """Greedy tokens of one request run alone."""
    engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), lora=lora)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return list(final.outputs[0].token_ids)
