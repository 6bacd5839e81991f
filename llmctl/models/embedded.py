"""The embedded default model: ``tiny-random-llama``.

A Llama-architecture model with RANDOM weights (about 26M parameters), built deterministically in
memory like vLLM's dummy load format, so every command runs on a fresh machine with no download.
It exercises every part of the engine at a realistic shape; its text is noise. Its byte-level BPE
tokenizer is trained at start-up on the short text below, so its output at least looks like
fragments of English words.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from llmctl.config import EMBEDDED_MODEL_NAME
from llmctl.layers.ops import TorchOps
from llmctl.models.config import ModelConfig
from llmctl.models.loader import build_model, init_random_weights
from llmctl.models.registry import CausalLM
from llmctl.tokenizer import Tokenizer

EMBEDDED_LABEL = f"{EMBEDDED_MODEL_NAME} (embedded, RANDOM weights: its text is noise)"
WEIGHT_SEED = 20261129

_CORPUS = """
Once upon a time there was a little engine that served words to anyone who asked. It kept its
memory in small pages of sixteen tokens each, and it never wasted a page: when a story ended, the
pages went back to the pool, and the next story could use them at once. Many people asked at the
same time, so the engine worked in steps. At every step it looked at who was waiting, who was
still writing, and how much room it had left. Short questions slipped in between long ones, and
nobody waited for the slowest writer to finish. When two people began with the same words, the
engine remembered those words only once and shared the pages between them. If one of them wanted
to change a shared page, the engine copied it first, so the other never noticed. Sometimes the
pool ran dry. Then the engine set aside the story it had started last, gave its pages to the
others, and came back to it later, writing it again from the beginning, word for word the same.
The engine measured everything: how long until the first word, how many words each second, how
full the pool was. It wrote the numbers on a board that anyone could watch, and people learned
that a small engine on a laptop could tell a good story quickly, if it was careful with memory.
The children liked the stories about dragons, rivers, trains, gardens, and the moon. Their
parents liked the stories that were short. The engine liked every question, because every
question was a new beginning.
"""

_SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=1)
def _build_tokenizer_json() -> str:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=_SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    return tok.to_str()


def embedded_tokenizer() -> Tokenizer:
    backend = HFTokenizer.from_str(_build_tokenizer_json())
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": _CHAT_TEMPLATE}
    eos_ids = [backend.token_to_id("</s>"), backend.token_to_id("<|im_end|>")]
    return Tokenizer(backend, config, {"eos_token_id": eos_ids}, source=EMBEDDED_MODEL_NAME)


def embedded_config_dict(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": [1, 3],
    }


def load_embedded(*, dtype: str, device: torch.device, ops: TorchOps) -> tuple[CausalLM, Tokenizer]:
    tokenizer = embedded_tokenizer()
    cfg = ModelConfig.from_dict(embedded_config_dict(tokenizer.vocab_size), source=EMBEDDED_MODEL_NAME)
    model = build_model(cfg, dtype=cfg.resolve_dtype(dtype, device), device=torch.device("cpu"), ops=ops)
    init_random_weights(model, WEIGHT_SEED)
    model = model.to(device)
    model.process_weights_after_loading()
    return model, tokenizer
