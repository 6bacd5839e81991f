"""``llmctl serve`` with faults injected, for the fault-isolation tests. Run as a script with the
``serve`` arguments; ``LLMCTL_TEST_FAULTS`` (comma-separated) picks the faults:

- ``detokenizer``: a request whose prompt contains ``FAULT`` gets a detokenizer that raises at
  its second token (a fault in turning one request's tokens into text);
- ``forward``: once a prompt containing ``CRASH`` was tokenized, the model forward raises (a fault
  in model execution, which stops the engine loop).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from llmctl.models.llama import LlamaForCausalLM
from llmctl.tokenizer import IncrementalDetokenizer, Tokenizer

FAULTS = set(os.environ.get("LLMCTL_TEST_FAULTS", "").split(","))
crash_requested = False


class RaisingDetokenizer(IncrementalDetokenizer):
    steps = 0

    def step(self, token_id: int) -> str:
        self.steps += 1
        if self.steps >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return super().step(token_id)


def install() -> None:
    original_decode_stream = Tokenizer.decode_stream
    original_encode = Tokenizer.encode
    original_forward = LlamaForCausalLM.forward

    def decode_stream(self: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> Any:
        if "FAULT" in self.decode(list(prompt_token_ids)):
            return RaisingDetokenizer(self, prompt_token_ids, skip_special_tokens)
        return original_decode_stream(self, prompt_token_ids, skip_special_tokens)

    def encode(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        global crash_requested
        crash_requested = crash_requested or "CRASH" in text
        return original_encode(self, text, add_special_tokens)

    def forward(self: LlamaForCausalLM, *args: Any, **kwargs: Any) -> Any:
        if crash_requested:
            raise RuntimeError("injected model execution fault")
        return original_forward(self, *args, **kwargs)

    if "detokenizer" in FAULTS:
        Tokenizer.decode_stream = decode_stream  # type: ignore[method-assign]
    if "forward" in FAULTS:
        Tokenizer.encode = encode  # type: ignore[method-assign]
        LlamaForCausalLM.forward = forward  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from llmctl.cli import app

    sys.argv = ["llmctl", *sys.argv[1:]]
    app()
