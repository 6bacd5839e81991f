// Paged decode attention reading a quantized KV pool directly (--kv-cache-dtype fp8_e4m3, fp8_e5m2,
// int8, kivi2, kivi4): the native counterpart of the torch reference in llmctl/engine/kv_cache.py
// (gather + dequantize + SDPA), with the same storage layout, scales and zeros
// (kernels/kv_quant.py). Codes are dequantized row by row inside the kernel (KIVI at head_dim
// 64/128 on AVX2: a row once per token, into the float kernels' score tiles and V chunks); KIVI
// blocks still in the residual window (residual_table[block] >= 0) are read from the
// full-precision residual pool.
//
// A module of its own (built by kernels/kv_quant_native.py through kernels/native_build.py), so it
// builds and fails independently of the float kernels. Run-time ISA dispatch: the body in
// kv_quant_attention_isa.h is compiled for generic x86-64 and for AVX2+FMA+F16C; `set_isa` picks.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum Kind : int { kFp8 = 0, kInt8 = 1, kKivi = 2 };

template <typename T>
struct KvqArgs {
  int kind, bits;
  const T* q;
  const uint8_t* k;  // codes: fp8/int8 [NB, BS, H, D] bytes, KIVI [NB, BS, H, D*bits/8]
  const uint8_t* v;
  const float* k_scale;  // fp8/int8: [NB, BS, H]
  const float* v_scale;
  const at::Half* kivi_k_scale;  // KIVI: [NB, H, D]
  const at::Half* kivi_k_zero;
  const at::Half* kivi_v_scale;  // KIVI: [NB, BS, H, D / value_group]
  const at::Half* kivi_v_zero;
  const T* residual_k;  // KIVI: [slots, BS, H, D] in the model dtype
  const T* residual_v;
  const int64_t* residual_table;  // KIVI: [NB] residual slot of each block, -1 = quantized
  const float* lut;               // fp8: value of each of the 256 codes
  const int32_t* block_tables;
  const int32_t* seq_lens;
  T* out;
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, value_group;
  float scale;
};

namespace generic {
#include "kv_quant_attention_isa.h"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LLMCTL_KVQ_VARIANTS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LLMCTL_KVQ_AVX2 1
namespace avx2 {
#include "kv_quant_attention_isa.h"
}  // namespace avx2
#undef LLMCTL_KVQ_AVX2
#pragma GCC pop_options
#endif

bool g_avx2 = false;

template <typename T>
const T* ptr_or_null(const c10::optional<torch::Tensor>& t) {
  return t.has_value() && t->numel() ? t->data_ptr<T>() : nullptr;
}

}  // namespace

std::string set_isa(const std::string& name) {
#ifdef LLMCTL_KVQ_VARIANTS
  if (name == "avx2") {
    g_avx2 = true;
    return name;
  }
#endif
  TORCH_CHECK(name == "generic", "unknown or not compiled ISA level: ", name);
  g_avx2 = false;
  return name;
}

std::string isa() { return g_avx2 ? "avx2" : "generic"; }

// query [S, Hq, D]; codes/scales/zeros of one layer as kv_cache.KVFormat lays them out.
torch::Tensor quantized_decode_attention(
    torch::Tensor query, int64_t kind, int64_t bits, torch::Tensor k, torch::Tensor v,
    c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
    c10::optional<torch::Tensor> k_zero, c10::optional<torch::Tensor> v_zero,
    c10::optional<torch::Tensor> residual_k, c10::optional<torch::Tensor> residual_v,
    c10::optional<torch::Tensor> residual_table, c10::optional<torch::Tensor> lut,
    torch::Tensor block_tables, torch::Tensor seq_lens, int64_t value_group, double scale) {
  TORCH_CHECK(query.dim() == 3 && k.dim() == 4, "query [S, Hq, D], codes [NB, BS, Hkv, *]");
  TORCH_CHECK(kind == kFp8 || kind == kInt8 || kind == kKivi, "kind: 0 fp8, 1 int8, 2 KIVI");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "codes must be contiguous");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k.size(1), num_kv_heads = k.size(2);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  if (kind == kKivi) {
    TORCH_CHECK((bits == 2 || bits == 4) && k.size(3) == head_dim * bits / 8, "KIVI codes: head_dim * bits / 8 bytes");
    TORCH_CHECK(value_group > 0 && head_dim % value_group == 0, "value group must divide head_dim");
    TORCH_CHECK(k_scale && k_zero && v_scale && v_zero, "KIVI needs scales and zeros");
    for (const auto* t : {&*k_scale, &*k_zero, &*v_scale, &*v_zero})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous(), "KIVI scales/zeros: contiguous float16");
    TORCH_CHECK(residual_table && residual_table->scalar_type() == at::kLong && residual_table->is_contiguous() &&
                    residual_table->numel() >= k.size(0), "KIVI needs an int64 residual table over every block");
    TORCH_CHECK(residual_k && residual_v && residual_k->scalar_type() == q.scalar_type() &&
                    residual_k->is_contiguous() && residual_v->is_contiguous(), "KIVI residual: contiguous, query dtype");
  } else {
    TORCH_CHECK(k.size(3) == head_dim && k.element_size() == 1, "fp8/int8 codes: one byte per element");
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() &&
                    v_scale->is_contiguous(), "fp8/int8 need contiguous float32 scales");
    TORCH_CHECK(kind == kInt8 || (lut && lut->scalar_type() == at::kFloat && lut->numel() == 256), "fp8 needs a 256-entry table");
  }
  if (num_seqs == 0) return out;
  auto dispatch = [&](auto tag) {
    using T = decltype(tag);
    KvqArgs<T> a{static_cast<int>(kind), static_cast<int>(bits), q.data_ptr<T>(),
                 static_cast<const uint8_t*>(k.data_ptr()), static_cast<const uint8_t*>(v.data_ptr()),
                 kind == kKivi ? nullptr : ptr_or_null<float>(k_scale),
                 kind == kKivi ? nullptr : ptr_or_null<float>(v_scale),
                 kind == kKivi ? ptr_or_null<at::Half>(k_scale) : nullptr,
                 kind == kKivi ? ptr_or_null<at::Half>(k_zero) : nullptr,
                 kind == kKivi ? ptr_or_null<at::Half>(v_scale) : nullptr,
                 kind == kKivi ? ptr_or_null<at::Half>(v_zero) : nullptr,
                 kind == kKivi ? residual_k->data_ptr<T>() : nullptr,
                 kind == kKivi ? residual_v->data_ptr<T>() : nullptr,
                 kind == kKivi ? residual_table->data_ptr<int64_t>() : nullptr,
                 kind == kFp8 ? lut->data_ptr<float>() : nullptr,
                 bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(),
                 num_q_heads, num_kv_heads, head_dim, block_size, bt.size(1), value_group,
                 static_cast<float>(scale)};
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; ++task) {
#ifdef LLMCTL_KVQ_VARIANTS
        if (g_avx2) {
          avx2::decode_task(a, task, scratch);
          continue;
        }
#endif
        generic::decode_task(a, task, scratch);
      }
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: dispatch(float{}); break;
    case at::kBFloat16: dispatch(at::BFloat16{}); break;
    case at::kHalf: dispatch(at::Half{}); break;
    default: TORCH_CHECK(false, "quantized_decode_attention: float32, bfloat16 or float16 query expected");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_isa", &set_isa, "Select the kernel variant: generic or avx2");
  m.def("isa", &isa, "The kernel variant in use");
  m.def("quantized_decode_attention", &quantized_decode_attention,
        "Paged decode attention over a quantized KV pool, dequantizing inside the kernel (CPU)");
}
