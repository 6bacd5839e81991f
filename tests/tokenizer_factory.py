"""Small tokenizers of the two kinds whose streaming decode is hard, built in memory (no hub).

``byte_level_bpe``: GPT-2 / Llama 3 / Qwen style, trained on CJK and emoji text, so its
vocabulary has tokens that hold part of a character (``"\\xe4\\xbd"``) and tokens that span a
character boundary. The byte-fallback kind is the real ``stories260k`` tokenizer (Llama 2 style).
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmctl.tokenizer import Tokenizer

MIXED_TEXT = (
    "Once upon a time 你好世界，猫在桌子上睡觉。日本語のテキストです。 Emoji 🙂🐱🚀 and "
    "café naïve façade — «quotes» 中文：猫 한국어 텍스트 "
)

# Qwen3's chat template in short: contents trimmed, and an empty think block after the generation
# prompt when the caller turns thinking off (``enable_thinking=False``).
QWEN3_STYLE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


@lru_cache(maxsize=1)
def _byte_level_json() -> str:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>", "<|im_end|>", "<|im_start|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([MIXED_TEXT * 3] * 20, trainer=trainer)
    return tok.to_str()


def byte_level_bpe() -> Tokenizer:
    backend = HFTokenizer.from_str(_byte_level_json())
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}, source="test-byte-level-bpe")
