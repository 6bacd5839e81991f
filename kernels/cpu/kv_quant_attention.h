// What kv_quant_attention.cpp offers the decode loop and the bindings: the argument blocks of the
// quantized-KV decode attention and of the KIVI store, their kernels, and the tensor-level ones.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention_window.h"

namespace llk::kvq {

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
  int64_t window = 0;  // sliding window (attention_window.h); 0: the whole context
  float softcap = 0.f;  // attention-logit soft cap; 0: none
};

// ---- KIVI store ----------------------------------------------------------------------------------
// One layer's KIVI store, as the module path's torch reference does it (kv_cache.QuantizedLayerKV:
// stage, then kv_quant.quantize_kivi_keys / quantize_kivi_values on the blocks the step completes),
// bit for bit: the same float operations per element, float16 scales and zeros rounded to nearest
// even before the codes are taken, codes rounded half to even. The step's plan (which token goes
// to which residual row, which blocks are quantized from which residual slot) is the host's
// (kv_cache.QuantizedKVCache.begin_step).
struct KiviStoreArgs {
  int bits;
  int64_t heads, head_dim, block_size, value_group;
  const float* key;  // this step's keys: row t at key + t * key_stride, heads * head_dim floats
  int64_t key_stride;
  const float* value;
  int64_t value_stride;
  float* residual_k;  // [slots, BS, H, D] float32, this layer
  float* residual_v;
  const int64_t* residual_tokens;  // [R] tokens written to a residual row
  const int64_t* residual_rows;    // [R] their rows (slot * BS + offset)
  int64_t num_residual;
  const int64_t* staging_tokens;  // [S] tokens of the blocks quantized this step
  const int64_t* staging_rows;    // [S] their staging rows (index * BS + offset)
  int64_t num_staging;
  const int64_t* staged_from;      // [F] residual slot holding each quantized block's earlier tokens, -1 none
  const int64_t* finalize_blocks;  // [F] the pool blocks quantized this step
  int64_t num_finalize;
  float* staging_k;  // [F, BS, H, D]: the blocks' full-precision rows (an output: prefill reads them)
  float* staging_v;
  uint8_t* k_codes;  // [NB, BS, H, D * bits / 8]
  at::Half* k_scale;  // [NB, H, D]
  at::Half* k_zero;
  uint8_t* v_codes;  // [NB, BS, H, D * bits / 8]
  at::Half* v_scale;  // [NB, BS, H, D / value_group]
  at::Half* v_zero;
};


// ---- pointer-level kernels ----
bool all_within(const at::Tensor& t, int64_t lo, int64_t hi);
void kivi_store_run(const KiviStoreArgs& a);
void decode_task_avx2(const KvqArgs<float>& a, int64_t task, std::vector<float>& scratch);  // x86 only

// ---- tensor-level kernels (the Python module `llmctl_kernels._C.kv_quant`) ----
std::string set_isa(const std::string& name);
std::string isa();
at::Tensor quantized_decode_attention(
    at::Tensor query, int64_t kind, int64_t bits, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> k_scale,
    c10::optional<at::Tensor> v_scale, c10::optional<at::Tensor> k_zero, c10::optional<at::Tensor> v_zero,
    c10::optional<at::Tensor> residual_k, c10::optional<at::Tensor> residual_v,
    c10::optional<at::Tensor> residual_table, c10::optional<at::Tensor> lut, at::Tensor block_tables,
    at::Tensor seq_lens, int64_t value_group, double scale, int64_t window = 0, double softcap = 0.0);
void kivi_store(at::Tensor key, at::Tensor value, int64_t bits, int64_t value_group, at::Tensor residual_k,
                at::Tensor residual_v, at::Tensor residual_tokens, at::Tensor residual_rows, at::Tensor staging_tokens,
                at::Tensor staging_rows, at::Tensor staged_from, at::Tensor finalize_blocks, at::Tensor staging_k,
                at::Tensor staging_v, at::Tensor k_codes, at::Tensor k_scale, at::Tensor k_zero, at::Tensor v_codes,
                at::Tensor v_scale, at::Tensor v_zero);

}  // namespace llk::kvq
