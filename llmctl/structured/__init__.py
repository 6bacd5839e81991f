"""Structured outputs (grammar-constrained decoding) and tool calling for the OpenAI server."""

from llmctl.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from llmctl.structured.bitmask import allocate_bitmask, apply_bitmask_, bitmask_bias, unpack_bitmask
from llmctl.structured.manager import StructuredOutputManager
from llmctl.structured.spec import StructuredOutputSpec

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarMatcher",
    "StructuredOutputManager",
    "StructuredOutputSpec",
    "allocate_bitmask",
    "apply_bitmask_",
    "bitmask_bias",
    "unpack_bitmask",
]
