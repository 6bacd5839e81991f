"""Comparisons with other engines (vLLM, transformers, llama.cpp) and the CPU's own ceilings."""
