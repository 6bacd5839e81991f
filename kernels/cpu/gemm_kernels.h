// What gemm_kernels.cpp offers the decode loop and the bindings: the fp32 panel GEMM.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

namespace llk::gemm {

std::vector<std::string> compiled_isas();
std::string set_isa(const std::string& name);  // avx512bf16 runs the avx512 variant
// x [.., k] @ w^T (+ bias) with w packed as [ceil(n / 16), k, 16] float32 panels.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias);

}  // namespace llk::gemm
