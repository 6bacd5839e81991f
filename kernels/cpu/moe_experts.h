// One mixture-of-experts layer's packed experts (moe_experts.cpp) as other native sources call
// them: the native decode loop runs a layer's experts through the object Python bound
// (`llmctl_kernels._C.moe.Experts`), so both paths make the very same call.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace llk::moe {

class Experts;

// The experts behind a Python `_C.moe.Experts` object (its owner keeps it alive); a clear error
// for anything else.
const Experts* experts_of(pybind11::handle object);
int64_t num_experts(const Experts& experts);
// x [T, H] fp32, weights [T, k] fp32, ids [T, k] int64 -> [T, H]: Experts.forward.
at::Tensor run_experts(const Experts& experts, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids);

}  // namespace llk::moe
