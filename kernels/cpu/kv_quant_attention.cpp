// Paged decode attention reading a quantized KV pool directly (--kv-cache-dtype fp8_e4m3, fp8_e5m2,
// int8, kivi2, kivi4): the native counterpart of the torch reference in llmctl/engine/kv_cache.py
// (gather + dequantize + SDPA), with the same storage layout, scales and zeros
// (kernels/kv_quant.py). Codes are dequantized row by row inside the kernel (KIVI at head_dim
// 64/128 on AVX2: a row once per token, into the float kernels' score tiles and V chunks); KIVI
// blocks still in the residual window (residual_table[block] >= 0) are read from the
// full-precision residual pool.
//
// Declared in kv_quant_attention.h (bound for Python in bindings.cpp). Run-time ISA dispatch
// (isa.h): the body in kv_quant_attention_isa.h is compiled for generic x86-64 and for
// AVX2+FMA+F16C; `set_isa` picks (avx512 and avx512bf16 run the AVX2 variant).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

#include "isa.h"
#include "kv_quant_attention.h"

namespace {

using llk::kvq::KiviStoreArgs;
using llk::kvq::KvqArgs;
using llk::kvq::kFp8;
using llk::kvq::kInt8;
using llk::kvq::kKivi;

namespace generic {
#include "kv_quant_attention_isa.h"
}  // namespace generic

#ifdef LLK_X86_VARIANTS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LLK_KVQ_AVX2 1
namespace avx2 {
#include "kv_quant_attention_isa.h"
}  // namespace avx2
#undef LLK_KVQ_AVX2
#pragma GCC pop_options
#endif

bool g_avx2 = false;

// ---- KIVI store ----------------------------------------------------------------------------------
// One layer's KIVI store, as the module path's torch reference does it (kv_cache.QuantizedLayerKV:
// stage, then kv_quant.quantize_kivi_keys / quantize_kivi_values on the blocks the step completes),
// bit for bit: the same float operations per element, float16 scales and zeros rounded to nearest
// even before the codes are taken, codes rounded half to even. The step's plan (which token goes
// to which residual row, which blocks are quantized from which residual slot) is the host's
// (kv_cache.QuantizedKVCache.begin_step).

// kv_quant._minmax_codes' scale and zero of a group with minimum lo and maximum hi, as stored
// (float16) and as read back (float32); a zero scale divides by 1.
struct MinMax {
  at::Half scale, zero;
  float divisor, zero_f;
};

inline MinMax minmax_params(float lo, float hi, int levels) {
  constexpr float kHalfMax = 65504.f;
  MinMax m;
  const float scale = (hi - lo) / static_cast<float>(levels);
  m.scale = at::Half(scale > kHalfMax ? kHalfMax : scale);
  m.zero = at::Half(std::min(std::max(lo, -kHalfMax), kHalfMax));
  const float s = static_cast<float>(m.scale);
  m.divisor = s > 0.f ? s : 1.f;
  m.zero_f = static_cast<float>(m.zero);
  return m;
}

inline uint8_t minmax_code(float x, const MinMax& m, int levels) {
  const float q = std::nearbyint((x - m.zero_f) / m.divisor);
  return static_cast<uint8_t>(std::min(std::max(q, 0.f), static_cast<float>(levels)));
}

// Codes of one row of head_dim values packed little-end first: code d in byte d / (8 / bits).
inline void pack_row(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  const int per_byte = 8 / bits;
  for (int64_t i = 0; i < n / per_byte; ++i) {
    int byte = 0;
    for (int j = 0; j < per_byte; ++j) byte |= codes[i * per_byte + j] << (j * bits);
    out[i] = static_cast<uint8_t>(byte);
  }
}

// Steps 1-3 for one of K or V: the staging copies (taken before a freed residual slot is written
// again), this step's rows into staging and into their residual slots.
inline void stage_rows(const KiviStoreArgs& a, const float* x, int64_t stride, float* residual, float* staging) {
  const int64_t row = a.heads * a.head_dim, block = a.block_size * row;
  for (int64_t f = 0; f < a.num_finalize; ++f)
    std::memcpy(staging + f * block, residual + std::max<int64_t>(a.staged_from[f], 0) * block, block * sizeof(float));
  for (int64_t i = 0; i < a.num_staging; ++i)
    std::memcpy(staging + a.staging_rows[i] * row, x + a.staging_tokens[i] * stride, row * sizeof(float));
  for (int64_t i = 0; i < a.num_residual; ++i)
    std::memcpy(residual + a.residual_rows[i] * row, x + a.residual_tokens[i] * stride, row * sizeof(float));
}

// Keys of staged block f: one group per (head, channel) over the block's tokens.
inline void quantize_key_block(const KiviStoreArgs& a, int64_t f, std::vector<uint8_t>& codes) {
  const int levels = (1 << a.bits) - 1;
  const int64_t H = a.heads, D = a.head_dim, BS = a.block_size, packed = D * a.bits / 8;
  const float* x = a.staging_k + f * BS * H * D;
  const int64_t block = a.finalize_blocks[f];
  std::vector<MinMax> params(H * D);
  for (int64_t c = 0; c < H * D; ++c) {
    float lo = x[c], hi = x[c];
    for (int64_t t = 1; t < BS; ++t) {
      lo = std::min(lo, x[t * H * D + c]);
      hi = std::max(hi, x[t * H * D + c]);
    }
    params[c] = minmax_params(lo, hi, levels);
    a.k_scale[block * H * D + c] = params[c].scale;
    a.k_zero[block * H * D + c] = params[c].zero;
  }
  codes.resize(D);
  for (int64_t t = 0; t < BS; ++t)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) codes[d] = minmax_code(x[(t * H + h) * D + d], params[h * D + d], levels);
      pack_row(codes.data(), D, a.bits, a.k_codes + ((block * BS + t) * H + h) * packed);
    }
}

// Values of staged block f: one group per (token, head, value_group channels).
inline void quantize_value_block(const KiviStoreArgs& a, int64_t f, std::vector<uint8_t>& codes) {
  const int levels = (1 << a.bits) - 1;
  const int64_t H = a.heads, D = a.head_dim, BS = a.block_size, G = a.value_group, packed = D * a.bits / 8;
  const int64_t block = a.finalize_blocks[f];
  codes.resize(D);
  for (int64_t t = 0; t < BS; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* x = a.staging_v + ((f * BS + t) * H + h) * D;
      const int64_t row = (block * BS + t) * H + h;
      for (int64_t g = 0; g < D / G; ++g) {
        float lo = x[g * G], hi = x[g * G];
        for (int64_t i = 1; i < G; ++i) {
          lo = std::min(lo, x[g * G + i]);
          hi = std::max(hi, x[g * G + i]);
        }
        const MinMax m = minmax_params(lo, hi, levels);
        a.v_scale[row * (D / G) + g] = m.scale;
        a.v_zero[row * (D / G) + g] = m.zero;
        for (int64_t i = 0; i < G; ++i) codes[g * G + i] = minmax_code(x[g * G + i], m, levels);
      }
      pack_row(codes.data(), D, a.bits, a.v_codes + row * packed);
    }
}

}  // namespace

// Every element of an int64 vector in [lo, hi): the plan's indices are checked before any write.
bool llk::kvq::all_within(const at::Tensor& t, int64_t lo, int64_t hi) {
  const int64_t* p = t.data_ptr<int64_t>();
  return std::all_of(p, p + t.numel(), [&](int64_t x) { return x >= lo && x < hi; });
}

void llk::kvq::kivi_store_run(const KiviStoreArgs& a) {
  stage_rows(a, a.key, a.key_stride, a.residual_k, a.staging_k);
  stage_rows(a, a.value, a.value_stride, a.residual_v, a.staging_v);
  at::parallel_for(0, a.num_finalize, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> codes;
    for (int64_t f = begin; f < end; ++f) {
      quantize_key_block(a, f, codes);
      quantize_value_block(a, f, codes);
    }
  });
}

namespace {

template <typename T>
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->numel() ? t->data_ptr<T>() : nullptr;
}

}  // namespace

namespace llk::kvq {

// avx2 and above run the AVX2 variant (there is no wider one).
std::string set_isa(const std::string& name) {
  llk::Isa level;
  TORCH_CHECK(llk::parse_isa(name, &level), "unknown or not compiled ISA level: ", name);
  g_avx2 = level >= llk::Isa::kAvx2;
  return name;
}

#ifdef LLK_X86_VARIANTS
void decode_task_avx2(const KvqArgs<float>& a, int64_t task, std::vector<float>& scratch) {
  avx2::decode_task(a, task, scratch);
}
#endif

std::string isa() { return g_avx2 ? "avx2" : "generic"; }

// query [S, Hq, D]; codes/scales/zeros of one layer as kv_cache.KVFormat lays them out.
at::Tensor quantized_decode_attention(
    at::Tensor query, int64_t kind, int64_t bits, at::Tensor k, at::Tensor v,
    c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
    c10::optional<at::Tensor> k_zero, c10::optional<at::Tensor> v_zero,
    c10::optional<at::Tensor> residual_k, c10::optional<at::Tensor> residual_v,
    c10::optional<at::Tensor> residual_table, c10::optional<at::Tensor> lut,
    at::Tensor block_tables, at::Tensor seq_lens, int64_t value_group, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && k.dim() == 4, "query [S, Hq, D], codes [NB, BS, Hkv, *]");
  TORCH_CHECK(kind == kFp8 || kind == kInt8 || kind == kKivi, "kind: 0 fp8, 1 int8, 2 KIVI");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "codes must be contiguous");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
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
                 static_cast<float>(scale), window, static_cast<float>(softcap)};
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; ++task) {
#ifdef LLK_X86_VARIANTS
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

// One layer's KIVI store (float32 keys and values): see KiviStoreArgs. The plan's tensors are
// kv_cache.StepPlan's; staging_k / staging_v [F, BS, H, D] receive the quantized blocks' rows.
void kivi_store(at::Tensor key, at::Tensor value, int64_t bits, int64_t value_group, at::Tensor residual_k,
                at::Tensor residual_v, at::Tensor residual_tokens, at::Tensor residual_rows,
                at::Tensor staging_tokens, at::Tensor staging_rows, at::Tensor staged_from,
                at::Tensor finalize_blocks, at::Tensor staging_k, at::Tensor staging_v, at::Tensor k_codes,
                at::Tensor k_scale, at::Tensor k_zero, at::Tensor v_codes, at::Tensor v_scale,
                at::Tensor v_zero) {
  TORCH_CHECK(bits == 2 || bits == 4, "KIVI: 2 or 4 bits");
  TORCH_CHECK(residual_k.dim() == 4 && residual_k.scalar_type() == at::kFloat && residual_k.is_contiguous() &&
                  residual_v.sizes() == residual_k.sizes() && residual_v.scalar_type() == at::kFloat &&
                  residual_v.is_contiguous(), "KIVI residual: contiguous float32 [slots, BS, H, D]");
  const int64_t block_size = residual_k.size(1), heads = residual_k.size(2), head_dim = residual_k.size(3);
  TORCH_CHECK(value_group > 0 && head_dim % value_group == 0 && head_dim % (8 / bits) == 0, "KIVI groups");
  const int64_t row = heads * head_dim;
  for (const auto* x : {&key, &value})
    TORCH_CHECK(x->scalar_type() == at::kFloat && (x->dim() == 2 || x->dim() == 3) && x->stride(-1) == 1 &&
                    (x->dim() == 2 ? x->size(1) == row
                                   : x->size(1) == heads && x->size(2) == head_dim && x->stride(1) == head_dim),
                "KIVI store: float32 rows of heads * head_dim (a row stride of its own allowed)");
  TORCH_CHECK(value.size(0) == key.size(0), "as many values as keys");
  const int64_t num_finalize = finalize_blocks.numel();
  for (const auto* t : {&residual_tokens, &residual_rows, &staging_tokens, &staging_rows, &staged_from, &finalize_blocks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "KIVI plan: int64 vectors");
  TORCH_CHECK(residual_rows.numel() == residual_tokens.numel() && staging_rows.numel() == staging_tokens.numel() &&
                  staged_from.numel() == num_finalize, "KIVI plan: lengths disagree");
  for (const auto* t : {&staging_k, &staging_v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == num_finalize * block_size * row,
                "KIVI staging: contiguous float32 [F, BS, H, D]");
  const int64_t num_blocks = k_codes.size(0), packed = head_dim * bits / 8;
  for (const auto* t : {&k_codes, &v_codes})
    TORCH_CHECK(t->scalar_type() == at::kByte && t->is_contiguous() && t->numel() == num_blocks * block_size * row / (8 / bits),
                "KIVI codes: contiguous uint8 [NB, BS, H, D * bits / 8]");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(3) == packed, "KIVI codes: [NB, BS, H, D * bits / 8]");
  for (const auto* t : {&k_scale, &k_zero})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == num_blocks * row, "KIVI key scales");
  for (const auto* t : {&v_scale, &v_zero})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->numel() == num_blocks * block_size * row / value_group, "KIVI value scales");
  const int64_t tokens = key.size(0), slots = residual_k.size(0);
  TORCH_CHECK(all_within(residual_tokens, 0, tokens) && all_within(staging_tokens, 0, tokens) &&
                  all_within(residual_rows, 0, slots * block_size) &&
                  all_within(staging_rows, 0, num_finalize * block_size) && all_within(staged_from, -1, slots) &&
                  all_within(finalize_blocks, 0, num_blocks), "KIVI plan out of range");
  const KiviStoreArgs a{static_cast<int>(bits), heads, head_dim, block_size, value_group,
                        key.data_ptr<float>(), key.stride(0),
                        value.data_ptr<float>(), value.stride(0),
                        residual_k.data_ptr<float>(), residual_v.data_ptr<float>(),
                        residual_tokens.data_ptr<int64_t>(), residual_rows.data_ptr<int64_t>(), residual_tokens.numel(),
                        staging_tokens.data_ptr<int64_t>(), staging_rows.data_ptr<int64_t>(), staging_tokens.numel(),
                        staged_from.data_ptr<int64_t>(), finalize_blocks.data_ptr<int64_t>(), num_finalize,
                        staging_k.data_ptr<float>(), staging_v.data_ptr<float>(),
                        k_codes.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(), k_zero.data_ptr<at::Half>(),
                        v_codes.data_ptr<uint8_t>(), v_scale.data_ptr<at::Half>(), v_zero.data_ptr<at::Half>()};
  kivi_store_run(a);
}

}  // namespace llk::kvq
