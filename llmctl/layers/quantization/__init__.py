"""Quantized weights: packed formats, linear methods, and on-the-fly quantization."""
