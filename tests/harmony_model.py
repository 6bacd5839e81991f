"""A tiny gpt-oss-style model whose greedy output is known token by token, for the ``gpt_oss``
reasoning parser.

Its tokenizer (byte-level BPE) has gpt-oss's harmony special tokens; its chat template is harmony's
in short (``reasoning_effort`` in the system message, past assistant turns in the ``final`` channel,
the generation prompt ``<|start|>assistant``). The weights make the next token a function of the
current one alone, as in tests/reasoning_model.py, following this script:

    ... is the sky blue <|end|> <|start|> assistant <|channel|> final <|message|> Light scatters <|return|>

so a prompt that ends at ``<|start|>assistant`` gets the final channel only, and one whose template
opened the analysis channel with its first word (``open_analysis``: ``<|channel|>analysis<|message|>Why``)
gets the rest of the analysis, then the final channel. (Every token has one successor, so a model of
this kind cannot write both channel headers itself: ``<|message|>`` would need two successors.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmctl.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
REASONING, ANSWER = "Why is the sky blue", "Light scatters"
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final"
    "{% else %}<|start|>{{ m['role'] }}{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant"
    "{% if open_analysis is defined and open_analysis %}<|channel|>analysis<|message|>Why{% endif %}{% endif %}"
)
CORPUS = f"system user assistant analysis final commentary Reasoning: low medium high {REASONING} {ANSWER}"
HIDDEN = 64


def tokenizer(template: str = TEMPLATE) -> Tokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # the script's words most often, so each is learnt whole
    backend.train_from_iterator([CORPUS] * 50 + [REASONING, ANSWER, "assistant", "final"] * 200, trainer=trainer)
    return Tokenizer(backend, {"eos_token": "<|return|>", "chat_template": template})


def build(out_dir: Path) -> dict:
    """The model directory and the script's token ids: ``{"dir", "tokenizer", "reasoning", "answer"}``
    (``reasoning``: the analysis tokens the model writes, after the template's ``Why``)."""
    from model_factory import make_config
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    ids = {name: tok.backend.token_to_id(name) for name in SPECIALS}

    def words(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    reasoning, answer, opening = words(REASONING), words(ANSWER), words("Why")
    assert reasoning[: len(opening)] == opening  # the template's "Why" is where the analysis goes on
    chain = [
        *reasoning,
        ids["<|end|>"],
        ids["<|start|>"],
        *words("assistant"),
        ids["<|channel|>"],
        *words("final"),
        ids["<|message|>"],
        *answer,
        ids["<|return|>"],
    ]
    script = list(zip(chain, chain[1:]))
    tokens = [t for t, _ in script]
    assert len(set(tokens)) == len(tokens) <= HIDDEN, "every token of the script has one successor"

    config = make_config(
        "llama",
        vocab_size=tok.backend.get_vocab_size(),
        hidden_size=HIDDEN,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|return|>"],
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
    tok.backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "chat_template": TEMPLATE}))
    return {"dir": str(out_dir), "tokenizer": tok, "reasoning": reasoning[len(opening) :], "answer": answer}
