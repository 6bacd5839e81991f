// What cpu_kernels.cpp offers the other native sources (the decode loop) and the bindings: the KV
// code types, the argument block of the decode kernels, the tensor-level kernels, and the fp32
// row kernels of one ISA variant as function pointers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_window.h"
#include "isa.h"

namespace llk::cpu {

// The 8-bit codes of a quantized KV pool (--kv-cache-dtype int8, fp8_e4m3, fp8_e5m2; layout and
// torch reference in kernels/kv_quant.py): one byte per element, one float32 scale per (token, KV
// head). Distinct types, so that a kernel templated on its cache's element type reads them right.
struct Int8Code { int8_t bits; };
struct Fp8E4m3Code { uint8_t bits; };
struct Fp8E5m2Code { uint8_t bits; };
template <typename C>
constexpr bool kIsCode = std::is_same_v<C, Int8Code> || std::is_same_v<C, Fp8E4m3Code> || std::is_same_v<C, Fp8E5m2Code>;
// The largest magnitude a code holds: a row's scale is its amax / this (kernels/kv_quant.py's _qmax).
template <typename C>
constexpr float kCodeMax = std::is_same_v<C, Int8Code> ? 127.f : std::is_same_v<C, Fp8E4m3Code> ? 448.f : 57344.f;

// T: query and output; C: the cache's elements (T, or a code type with its scales).
template <typename T, typename C = T>
struct DecodeArgs {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  T* out;
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, heads_per_task;
  float scale;
  const float* k_scale = nullptr;  // codes only: [NB, BS, Hkv], a row's value = code * scale
  const float* v_scale = nullptr;
  int64_t window = 0;  // sliding window (attention_window.h); 0: the whole context
  float softcap = 0.f;  // attention-logit soft cap; 0: none
  const float* sinks = nullptr;  // [num_q_heads] sink logits (attention_window.h); null: none
};

// ---- tensor-level kernels (the Python module `llmctl_kernels._C.cpu`) ----
std::string set_isa(const std::string& name);
std::vector<std::string> compiled_isas();
llk::Isa selected_isa();  // set_isa's level (the multi-LoRA kernel follows it too)
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping);
// window > 0: a sliding window, softcap > 0: attention-logit soft-capping, sinks: [Hq] logits
// joining each softmax's denominator (attention_window.h), read as float32.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window = 0,
                                  double softcap = 0.0, c10::optional<at::Tensor> sinks = c10::nullopt);
bool decode_codes_supported(int64_t head_dim);
at::Tensor paged_decode_attention_codes(at::Tensor query, const std::string& kind, at::Tensor k_codes,
                                        at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale,
                                        at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                        int64_t window = 0, double softcap = 0.0);
void store_kv_codes(at::Tensor key, at::Tensor value, const std::string& kind, at::Tensor k_codes,
                    at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale, at::Tensor slot_mapping);
bool prefill_attention_supported(at::Tensor query, at::Tensor key_cache);
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor block_tables, at::Tensor query_start_loc, at::Tensor seq_lens,
                                   double scale, int64_t window = 0, double softcap = 0.0,
                                   c10::optional<at::Tensor> sinks = c10::nullopt);
at::Tensor paged_prefill_attention_codes(at::Tensor query, const std::string& kind, at::Tensor k_codes,
                                         at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale,
                                         at::Tensor block_tables, at::Tensor query_start_loc, at::Tensor seq_lens,
                                         double scale, int64_t window = 0, double softcap = 0.0);
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                            c10::optional<at::Tensor> residual);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor rotate(at::Tensor x, at::Tensor positions, at::Tensor cos_sin_cache);

// ---- fp32 row kernels of one variant, for a caller that owns its buffers (the decode loop) ----
using RmsNormFn = void (*)(const float*, const float*, const float*, float*, float*, int64_t, int64_t, int64_t, float);
using RotateFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const float*, float*, int64_t, int64_t,
                          int64_t, int64_t, int64_t);
using SiluFn = void (*)(const float*, float*, int64_t, int64_t, int64_t);
using DecodeFn = void (*)(const DecodeArgs<float>&, int64_t, int64_t);
template <typename C>
using QuantizeRowsFn = void (*)(const float*, int64_t, int64_t, int64_t, const int64_t*, float, C*, float*, int64_t,
                                int64_t);
template <typename C>
using DecodeCodesFn = void (*)(const DecodeArgs<float, C>&, int64_t, int64_t);

struct Fp32Kernels {
  RmsNormFn rms_norm;
  RotateFn rotate;
  SiluFn silu_and_mul;
  DecodeFn decode;
};

// The avx2 or the avx512 variant (avx512bf16: the avx512 one, bf16 changes nothing in fp32); x86 only.
Fp32Kernels fp32_kernels(bool avx512);
template <typename C>
QuantizeRowsFn<C> quantize_rows_fn(bool avx512);
template <typename C>
DecodeCodesFn<C> decode_codes_fn(bool avx512);

}  // namespace llk::cpu
