// The multi-LoRA kernel of the CPU (lora_kernels.cpp): one projection's adapter deltas for every
// adapter slot in a batch, added into its output in place. Called by the module path (through the
// `llmctl_kernels._C.lora` binding) and by the native decode loop, so both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace llk::lora {

// An adapted output slice [offset, offset + size) of the projection: its slots' A^T
// [slots, in, R] and B^T [slots, R, size] (R a multiple of 16, zero-padded) in the activations'
// dtype, contiguous, and scale [slots] fp32 (kernels/lora.py's transposed stacks).
using Stack = std::tuple<int64_t, int64_t, at::Tensor, at::Tensor, at::Tensor>;
// One slot's rows of the batch: [start, end), or the int64 row indices when given.
using Group = std::tuple<int64_t, int64_t, int64_t, c10::optional<at::Tensor>>;

void check_stack(const Stack& stack, int64_t in_features);
// out[rows of g, slice of st] += (x[rows] @ A^T[slot] * scale[slot]) @ B^T[slot] for every stack st
// and group g; x [T, in] and out [T, N] fp32 or bf16 (the same), each row contiguous.
void lora_add(at::Tensor out, const at::Tensor& x, const std::vector<Stack>& stacks, const std::vector<Group>& groups);

}  // namespace llk::lora
