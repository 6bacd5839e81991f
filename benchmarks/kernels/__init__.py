"""Micro-benchmarks of single kernels (attention, GEMM, GEMV, int8, quantized KV) on CPU and GPU."""
