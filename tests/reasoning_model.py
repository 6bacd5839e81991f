"""A tiny thinking model whose greedy output is known token by token.

Its tokenizer (byte-level BPE) has ``<think>`` and ``</think>`` as special tokens. Its weights make
the next token a function of the current one alone: every attention and MLP output projection is
zero, so the residual stream is the token's embedding, a one-hot direction for each token of the
script below; the LM head maps that direction to the token's successor (logit 8, every other 0).
A prompt's last token picks where the script starts:

    ALPHA   -> <think> REASONING... </think> ANSWER... </s>
    OMEGA   -> REASONING... </think> ANSWER... </s>        (no start tag, as DeepSeek-R1 writes)
    <think> -> REASONING...;  </think> -> ANSWER...

The chat template concatenates the messages' contents; at the generation prompt it writes
``<think></think>`` when ``enable_thinking`` is false and ``<think>`` when ``open_think`` is true
(a DeepSeek-R1 style template), and ``reasoning_effort`` in front when it is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmctl.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<think>", "</think>"]
REASONING_TEXT = "Rayleigh scattering favours short waves"
ANSWER_TEXT = "It looks blue."
ALPHA, OMEGA = "alpha", "omega"
TEMPLATE = (
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{% elif open_think is defined and open_think %}<think>{% endif %}"
    "{% endif %}"
)
HIDDEN = 64


def _tokenizer_json() -> str:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [REASONING_TEXT, ANSWER_TEXT, ALPHA, OMEGA, "answer yes no hello world"]
    tok.train_from_iterator(corpus * 50, trainer=trainer)
    return tok.to_str()


def build(out_dir: Path) -> dict:
    """The model directory, and the script's token ids: ``{"dir", "reasoning", "answer", ...}``."""
    from model_factory import make_config
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    backend = HFTokenizer.from_str(_tokenizer_json())
    tokenizer = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})
    ids = {name: backend.token_to_id(name) for name in SPECIALS}
    reasoning = tokenizer.encode(REASONING_TEXT, add_special_tokens=False)
    answer = tokenizer.encode(ANSWER_TEXT, add_special_tokens=False)
    alpha = tokenizer.encode(ALPHA, add_special_tokens=False)
    omega = tokenizer.encode(OMEGA, add_special_tokens=False)
    assert len(alpha) == len(omega) == 1, (alpha, omega)
    script = [
        (alpha[0], ids["<think>"]),
        (omega[0], reasoning[0]),
        (ids["<think>"], reasoning[0]),
        *zip(reasoning, reasoning[1:]),
        (reasoning[-1], ids["</think>"]),
        (ids["</think>"], answer[0]),
        *zip(answer, answer[1:]),
        (answer[-1], ids["</s>"]),
    ]
    tokens = [t for t, _ in script]
    assert len(set(tokens)) == len(tokens) <= HIDDEN, "every token of the script has one successor"

    config = make_config(
        "llama",
        vocab_size=backend.get_vocab_size(),
        hidden_size=HIDDEN,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                param.zero_()
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for direction, (token, successor) in enumerate(script):
            embed[token, direction] = 1.0
            head[successor, direction] = 1.0
    model.save_pretrained(out_dir)
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return {
        "dir": str(out_dir),
        "tokenizer": Tokenizer.from_dir(out_dir),
        "reasoning": reasoning,
        "answer": answer,
        "think": ids["<think>"],
        "end_think": ids["</think>"],
        "eos": ids["</s>"],
    }
