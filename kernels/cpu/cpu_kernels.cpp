// Native CPU kernels (declared in cpu_kernels.h; bound for Python in bindings.cpp):
//
// - paged decode attention, the fused counterpart of kernels/decode_attention.py;
// - RMSNorm with the residual add, SiLU-and-mul and rotary embedding, fused counterparts of
//   kernels/rms_norm.py, activation.py and rotary.py: one pass over memory instead of one per torch
//   op. They reproduce the references' rounding step by step (a bf16 result is rounded wherever the
//   torch reference produces a bf16 tensor), so they agree with them to the last bit or so;
// - the KV store (one memcpy per token).
//
// Run-time ISA dispatch (isa.h): the loops live in cpu_kernels_isa.h, compiled here once per
// instruction set inside a `#pragma GCC target` region (generic x86-64, AVX2+FMA+F16C, AVX-512),
// plus an AVX512-BF16 decode kernel; `set_isa` (called by kernels/cpu_native.py with the level
// read from /proc/cpuinfo) picks the variant. Work is spread over torch's own thread pool (at::parallel_for), so it never competes
// with a second OpenMP runtime.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "isa.h"

// A product and a sum round separately, as in torch's elementwise ops (rotary is then
// bit-identical): only explicit FMAs fuse, in every variant.
#pragma GCC optimize("fp-contract=off")

namespace {

using llk::Isa;
using llk::cpu::DecodeArgs;
using llk::cpu::Fp8E4m3Code;
using llk::cpu::Fp8E5m2Code;
using llk::cpu::Int8Code;
using llk::cpu::kCodeMax;
using llk::cpu::kIsCode;

namespace generic {
#include "cpu_kernels_isa.h"
}  // namespace generic

#ifdef LLK_X86_VARIANTS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LLK_ISA_HAS_AVX2 1  // the variants below may use AVX2+FMA intrinsics (attention_f32.h)
namespace avx2 {
#include "cpu_kernels_isa.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define LLK_ISA_HAS_AVX512 1  // attention_f32.h's prefill tiles may use 512-bit vectors
namespace avx512 {
#include "cpu_kernels_isa.h"
}  // namespace avx512
#undef LLK_ISA_HAS_AVX512
#undef LLK_ISA_HAS_AVX2
#pragma GCC pop_options

#pragma GCC push_options
// The avx512 namespace's options plus avx512bf16: with fewer, GCC does not inline that namespace's
// helpers here (store, the softmax), and a call per output element cost the kernel ~7 %.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512bf16 {
// bf16 caches on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and later),
// at any batch size. One task = some KV heads of a sequence (all of them once the sequences alone
// keep every thread busy, else one). Scores: vdpbf16ps on the bf16 query and the K rows in place
// (exact bf16 products, fp32 sums), 16 tokens a tile, whose 16 accumulators one transpose-reduce
// turns into a vector of 16 scores, then times the softmax scale. V: each row widened in
// registers (a shift) and taken by up to 4 query heads of its KV head at once, their accumulators
// in registers over all the tokens. Why: the widening kernel of attention_f32.h (8 lanes) copies
// every K and V row to fp32 in a buffer; on a 2-core Xeon with AMX (64 sequences x 192 tokens of
// the 246M Llama, 16 layers) it took 1.10-1.19 ms a layer, this one 0.90-0.96 (docs/benchmarks.md,
// "Decode attention"), 0.68-0.69 with its prefetches spread. The arithmetic of a
// (sequence, head) depends on nothing else: batched == unbatched, whatever the task split or
// thread count. Same result as the generic path up to fp32 summation order.
constexpr int64_t kTile = 16;  // tokens per score tile

#include "prefetch_cursor.h"

// out[p] = the sum of the 16 lanes of a[s], for the slot s that holds token p of the tile:
// s = (p % 4) * 4 + p / 4 (tile_token), the order this reduction leaves them in.
inline __m512 transpose_sum16(const __m512* a) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)  // halves of 256 bits: c[i] = [a[2i] summed to 8 | a[2i+1] to 8]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane k of d[i]: a[4i + k] summed to 4
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  const __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)), _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
}

constexpr int64_t tile_token(int s) { return (s % 4) * 4 + s / 4; }  // the token of slot s (an involution)

struct TaskBuffers {
  std::vector<int64_t> offset;  // t -> the task's part of token t's K/V row in the cache (elements)
  std::vector<float> scores;    // [query heads of the task, padded]
  std::vector<float> inv_sum;   // [query heads of the task]
};

// V pass of GR query heads of one KV head over 64 of its dims: acc[g] += p[g][t] * v_t for t < len,
// v_t the bf16 row at v + offset[t] widened in registers (exact: a bf16 is the top half of its
// fp32). All GR heads take each row while it is in registers: the row is read once per KV head.
template <int GR>
inline void v_pass64(const uint16_t* v, const int64_t* offset, int64_t len, const float* const* p, __m512 (*acc)[4]) {
  for (int g = 0; g < GR; ++g)
    for (int l = 0; l < 4; ++l) acc[g][l] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const uint16_t* vr = v + offset[t];
    __m512 row[4];
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l)
      row[l] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * l))), 16));
#pragma GCC unroll 4
    for (int g = 0; g < GR; ++g) {
      const __m512 w = _mm512_set1_ps(p[g][t]);
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) acc[g][l] = _mm512_fmadd_ps(w, row[l], acc[g][l]);
    }
  }
}

// KV heads [h0, h1) of sequence `seq` (their part of a token's cache row is contiguous).
template <int64_t D>
void decode_task(const DecodeArgs<at::BFloat16>& a, int64_t seq, int64_t h0, int64_t h1, TaskBuffers& buf) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int64_t kChunks = D / 32;  // 32 bf16 per vdpbf16ps
  const int64_t group = a.num_q_heads / a.num_kv_heads, heads = h1 - h0, span = heads * D;
  const int64_t first = llk::window_first(a.seq_lens[seq] - 1, a.window);  // the keys [first, seq_len)
  const int64_t len = a.seq_lens[seq] - first;
  const int64_t padded = (len + kTile - 1) / kTile * kTile;
  avx512::f32attn::token_offsets(buf.offset, a.block_tables + seq * a.max_blocks, a.block_size, first, len, padded,
                                 a.num_kv_heads * D, h0 * D);
  const int64_t* offset = buf.offset.data();
  buf.scores.resize(heads * group * padded);
  float* scores = buf.scores.data();
  const uint16_t* k_cache = reinterpret_cast<const uint16_t*>(a.k_cache);
  const uint16_t* v_cache = reinterpret_cast<const uint16_t*>(a.v_cache);
  const uint16_t* q = reinterpret_cast<const uint16_t*>(a.q + (seq * a.num_q_heads + h0 * group) * D);
  // Blocks sit anywhere in the pool: the score pass prefetches the K rows of the next tile, and the
  // V rows of its own tile into L2 for the V pass (a sequence's V is ~100 KiB); without the V
  // prefetch the kernel took 25 % longer. The tile's prefetches are spread over its query heads
  // (prefetch_cursor.h).
  const int64_t lines_per_row = (span * 2 + 63) / 64, rows_of_tile = heads * group;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t t0 = 0; t0 < padded; t0 += kTile) {  // pass 1: scores
    PrefetchCursor next_k{k_cache, offset, t0 + kTile, std::min(t0 + 2 * kTile, len), lines_per_row};
    PrefetchCursor this_v{v_cache, offset, t0, std::min(t0 + kTile, len), lines_per_row};
    const int64_t k_lines = next_k.share(rows_of_tile), v_lines = this_v.share(rows_of_tile);  // per query head
    for (int64_t r = 0; r < rows_of_tile; ++r) {  // query head r of the task, of KV head h0 + r / group
      next_k.issue<_MM_HINT_T0>(k_lines);
      this_v.issue<_MM_HINT_T1>(v_lines);
      __m512bh qv[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + r * D + 32 * c);
      const uint16_t* k_head = k_cache + (r / group) * D;
      __m512 acc[kTile];
#pragma GCC unroll 16
      for (int s = 0; s < kTile; ++s) {
        const uint16_t* kr = k_head + offset[t0 + tile_token(s)];
        acc[s] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
        for (int64_t c = 1; c < kChunks; ++c)
          acc[s] = _mm512_dpbf16_ps(acc[s], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
      }
      _mm512_storeu_ps(scores + r * padded + t0, _mm512_mul_ps(transpose_sum16(acc), scale));
    }
  }
  buf.inv_sum.resize(heads * group);
  float* inv_sum = buf.inv_sum.data();
  if (a.softcap > 0.f)
    for (int64_t r = 0; r < heads * group; ++r) llk::softcap_scores(scores + r * padded, len, a.softcap);
  for (int64_t r = 0; r < heads * group; ++r)  // 16 lanes, the tail masked (zeros up to padded)
    inv_sum[r] = avx512::f32attn::Lanes16::softmax_prefix(scores + r * padded, len, padded,
                                                          llk::sink_of(a.sinks, h0 * group + r));
  for (int64_t hh = 0; hh < heads; ++hh)  // pass 2: the sums of V weighted by each query head's p
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t rows = std::min<int64_t>(4, group - g0), r0 = hh * group + g0;
      const float* p[4];
      for (int64_t g = 0; g < rows; ++g) p[g] = scores + (r0 + g) * padded;
      for (int64_t half = 0; half < D; half += 64) {
        const uint16_t* v = v_cache + hh * D + half;
        __m512 acc[4][4];
        switch (rows) {  // acc[g] for g < rows
          case 1: v_pass64<1>(v, offset, len, p, acc); break;
          case 2: v_pass64<2>(v, offset, len, p, acc); break;
          case 3: v_pass64<3>(v, offset, len, p, acc); break;
          default: v_pass64<4>(v, offset, len, p, acc); break;
        }
        for (int64_t g = 0; g < rows; ++g) {
          alignas(64) float tmp[64];
          const __m512 inv = _mm512_set1_ps(inv_sum[r0 + g]);
          for (int l = 0; l < 4; ++l) _mm512_store_ps(tmp + 16 * l, _mm512_mul_ps(acc[g][l], inv));
          at::BFloat16* out = a.out + (seq * a.num_q_heads + h0 * group + r0 + g) * D + half;
          for (int d = 0; d < 64; ++d) avx512::store(out + d, tmp[d]);
        }
      }
    }
}

// Tasks [begin, end): a.heads_per_task KV heads of a sequence each.
template <int64_t D>
void decode_range(const DecodeArgs<at::BFloat16>& a, int64_t begin, int64_t end) {
  TaskBuffers buf;
  const int64_t tasks_per_seq = a.num_kv_heads / a.heads_per_task;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t h0 = (task % tasks_per_seq) * a.heads_per_task;
    decode_task<D>(a, task / tasks_per_seq, h0, h0 + a.heads_per_task, buf);
  }
}
}  // namespace avx512bf16
#pragma GCC pop_options
#endif

Isa g_isa = Isa::kGeneric;

// Calls NAME<T>(args...) in the namespace of the selected ISA; fp16 always takes the generic
// variant (no CPU computes it natively, and it is never the auto dtype on a CPU).
#ifdef LLK_X86_VARIANTS
#define LLK_ISA_CALL(T, NAME, ...)                                                  \
  do {                                                                                 \
    if (!std::is_same_v<T, at::Half> && g_isa >= Isa::kAvx512) avx512::NAME<T>(__VA_ARGS__); \
    else if (!std::is_same_v<T, at::Half> && g_isa == Isa::kAvx2) avx2::NAME<T>(__VA_ARGS__); \
    else generic::NAME<T>(__VA_ARGS__);                                                \
  } while (0)
#else
#define LLK_ISA_CALL(T, NAME, ...) generic::NAME<T>(__VA_ARGS__)
#endif

// Runs the lambda (which uses ``scalar_t``) for the storage types the kernels take.
#define LLK_DISPATCH(TYPE, NAME, ...)                                                      \
  switch (TYPE) {                                                                            \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__(); break; }                              \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__(); break; }                    \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__(); break; }                            \
    default: TORCH_CHECK(false, NAME ": float32, bfloat16 or float16 expected, got ", TYPE); \
  }

// bf16 decode through vdpbf16ps where the CPU has it and the shapes suit; false: not taken.
template <typename T>
bool decode_with_avx512_bf16(const DecodeArgs<T>&, int64_t) {
  return false;
}

#ifdef LLK_X86_VARIANTS
template <>
bool decode_with_avx512_bf16(const DecodeArgs<at::BFloat16>& args, int64_t num_seqs) {
  if (g_isa != Isa::kAvx512Bf16 || (args.head_dim != 64 && args.head_dim != 128)) return false;
  auto kernel = args.head_dim == 64 ? avx512bf16::decode_range<64> : avx512bf16::decode_range<128>;
  const int64_t tasks = num_seqs * (args.num_kv_heads / args.heads_per_task);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return true;
}
#endif

}  // namespace

namespace llk::cpu {

std::string set_isa(const std::string& name) {
  TORCH_CHECK(llk::parse_isa(name, &g_isa), "unknown or not compiled ISA level: ", name);
  return name;
}

Isa selected_isa() { return g_isa; }

std::vector<std::string> compiled_isas() {
#ifdef LLK_X86_VARIANTS
  return {"generic", "avx2", "avx512", "avx512bf16"};
#else
  return {"generic"};
#endif
}

// Attention sinks: [num_q_heads], one logit per query head (attention_window.h), read as float32
// (a bf16 model's are widened here; a float32 tensor is used as it is).
static at::Tensor checked_sinks(const c10::optional<at::Tensor>& sinks, int64_t num_q_heads) {
  if (!sinks.has_value()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_q_heads, "sinks: [num_q_heads] expected");
  return sinks->to(at::kFloat).contiguous();
}

static const float* sinks_data(const at::Tensor& sinks) { return sinks.defined() ? sinks.data_ptr<float>() : nullptr; }

at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale, int64_t window,
                                     double softcap, c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, Hq, D], cache [NB, BS, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto out = at::empty_like(q);
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes disagree");
  if (num_seqs == 0) return out;
  const at::Tensor sink_logits = checked_sinks(sinks, num_q_heads);
  LLK_DISPATCH(q.scalar_type(), "paged_decode_attention", [&] {
    using T = scalar_t;
    // Whole sequences per task when they alone keep every thread busy, else one KV head per task.
    const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
    DecodeArgs<T> args{q.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), bt.data_ptr<int32_t>(),
                       lens.data_ptr<int32_t>(), out.data_ptr<T>(), num_q_heads, num_kv_heads, head_dim,
                       block_size, bt.size(1), heads_per_task, static_cast<float>(scale)};
    args.window = window;
    args.softcap = static_cast<float>(softcap);
    args.sinks = sinks_data(sink_logits);
    if (decode_with_avx512_bf16(args, num_seqs)) return;
    const int64_t tasks = num_seqs * (num_kv_heads / heads_per_task);
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      LLK_ISA_CALL(T, decode_range, args, begin, end);
    });
  });
  return out;
}

// Runs the lambda (which uses ``code_t``) for the 8-bit KV code type of ``kind``.
#define LLK_CODE_DISPATCH(KIND, ...)                                                          \
  do {                                                                                           \
    if (KIND == "int8") { using code_t = Int8Code; __VA_ARGS__(); }                              \
    else if (KIND == "fp8_e4m3") { using code_t = Fp8E4m3Code; __VA_ARGS__(); }                  \
    else if (KIND == "fp8_e5m2") { using code_t = Fp8E5m2Code; __VA_ARGS__(); }                  \
    else TORCH_CHECK(false, "8-bit KV codes: int8, fp8_e4m3 or fp8_e5m2, not ", KIND);           \
  } while (0)

// Whether paged_decode_attention_codes takes this head_dim here (AVX2 or AVX-512 variants only).
bool decode_codes_supported(int64_t head_dim) {
  return g_isa != Isa::kGeneric && (head_dim == 64 || head_dim == 128);
}

// query [tokens, Hq, D] against one layer of an 8-bit KV pool: codes [NB, BS, Hkv, D] as bytes,
// float32 scales [NB, BS, Hkv].
void check_code_pool(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& v_codes,
                     const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(query.dim() == 3 && k_codes.dim() == 4 && k_codes.element_size() == 1 &&
                  v_codes.sizes() == k_codes.sizes(), "query [T, Hq, D], codes [NB, BS, Hkv, D] bytes");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous() &&
                  k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.numel() == k_codes.numel() / k_codes.size(3) && v_scale.numel() == k_scale.numel(),
              "contiguous codes and float32 scales, one per row");
  TORCH_CHECK(decode_codes_supported(query.size(2)) && k_codes.size(3) == query.size(2) &&
                  query.size(1) % k_codes.size(2) == 0, "8-bit KV attention: head_dim 64 or 128 on the AVX2 or "
              "AVX-512 variants, query heads a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16, "float32 or bfloat16 query");
}

// Decode attention over an 8-bit KV pool (codes [NB, BS, Hkv, D] as bytes, float32 scales
// [NB, BS, Hkv]): the float kernel's score tiles and V chunks on code rows widened to fp32 a tile
// at a time, the scales applied per (token, KV head) to the scores and the softmax weights. Same
// result as dequantizing and attending (kernels/kv_quant.py) up to fp32 summation order; the native
// decode loop calls the same code.
at::Tensor paged_decode_attention_codes(at::Tensor query, const std::string& kind, at::Tensor k_codes,
                                           at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale,
                                           at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                           int64_t window, double softcap) {
  check_code_pool(query, k_codes, v_codes, k_scale, v_scale);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), num_kv_heads = k_codes.size(2);
  if (num_seqs == 0) return out;
#ifdef LLK_X86_VARIANTS
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks = num_seqs * (num_kv_heads / heads_per_task);
  auto run = [&](auto query_tag, auto code_tag) {
    using T = decltype(query_tag);
    using C = decltype(code_tag);
    const DecodeArgs<T, C> args{q.data_ptr<T>(), static_cast<const C*>(k_codes.data_ptr()),
                                static_cast<const C*>(v_codes.data_ptr()), bt.data_ptr<int32_t>(),
                                lens.data_ptr<int32_t>(), out.data_ptr<T>(), num_q_heads, num_kv_heads, q.size(2),
                                k_codes.size(1), bt.size(1), heads_per_task, static_cast<float>(scale),
                                k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), window,
                                static_cast<float>(softcap)};
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      if (g_isa >= Isa::kAvx512) avx512::decode_codes_range<T, C>(args, begin, end);
      else avx2::decode_codes_range<T, C>(args, begin, end);
    });
  };
  LLK_CODE_DISPATCH(kind, [&] {
    if (q.scalar_type() == at::kFloat) run(float{}, code_t{});
    else run(at::BFloat16{}, code_t{});
  });
#endif
  return out;
}

// Quantize-on-store of this step's K and V (float32 [T, Hkv, D], rows may be strided) into an
// 8-bit pool through the slot mapping (-1 skipped): bit for bit kernels/kv_quant.py's
// quantize_per_token, the torch reference.
void store_kv_codes(at::Tensor key, at::Tensor value, const std::string& kind, at::Tensor k_codes,
                    at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale, at::Tensor slot_mapping) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && key.dim() == 3 &&
                  value.sizes() == key.sizes(), "float32 K and V [T, Hkv, D]");
  TORCH_CHECK(k_codes.is_contiguous() && v_codes.is_contiguous() && k_codes.element_size() == 1 &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.scalar_type() == at::kFloat &&
                  v_scale.scalar_type() == at::kFloat, "contiguous byte codes and float32 scales");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(k_codes.numel() == k_scale.numel() * dim && k_codes.size(-1) == dim && k_codes.size(-2) == heads,
              "pool rows of Hkv x D codes, one scale per row");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == tokens, "one slot per token");
  const int64_t capacity = k_scale.numel() / heads;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " outside the pool");
  LLK_CODE_DISPATCH(kind, [&] {
    const float qmax = kCodeMax<code_t>;
    auto quantize = [&](const at::Tensor& x, at::Tensor& codes, at::Tensor& scales) {
      TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == dim, "K/V heads must be contiguous within a token");
      LLK_ISA_CALL(code_t, quantize_rows, x.data_ptr<float>(), x.stride(0), heads, dim, slot, qmax,
                      static_cast<code_t*>(codes.data_ptr()), scales.data_ptr<float>(), 0, tokens);
    };
    quantize(key, k_codes, k_scale);
    quantize(value, v_codes, v_scale);
  });
}

// fp32 or bf16 caches, head_dim 64 or 128, an AVX2 or AVX-512 machine: the tiled kernel of
// attention_f32.h in 8 or 16 lanes. Other shapes and dtypes keep torch's SDPA
// (kernels/prefill_attention.py); the caller checks with prefill_attention_supported first.
bool prefill_attention_supported(at::Tensor query, at::Tensor key_cache) {
#ifdef LLK_X86_VARIANTS
  const auto dtype = query.scalar_type();
  return g_isa != Isa::kGeneric && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         key_cache.scalar_type() == dtype && (query.size(-1) == 64 || query.size(-1) == 128);
#else
  return false;
#endif
}

#ifdef LLK_X86_VARIANTS
// Tasks (sequence, KV head) handed out one at a time, largest first: chunks of very different
// lengths still split evenly over the threads. Each thread keeps its own scratch.
template <typename Args, typename Scratch>
void prefill_tasks_on_threads(const Args& args, void (*kernel)(const Args&, int64_t, int64_t, Scratch&),
                              const std::vector<std::pair<int64_t, int64_t>>& tasks, int64_t num_kv_heads) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks.size()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(tasks.size()); i = next.fetch_add(1))
      kernel(args, tasks[i].second / num_kv_heads, tasks[i].second % num_kv_heads, scratch);
  });
}

template <typename T, typename C = T>
void prefill_on_threads(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& bt, const at::Tensor& starts, const at::Tensor& lens,
                        at::Tensor& out, double scale, int64_t window, double softcap,
                        const float* k_scale = nullptr, const float* v_scale = nullptr,
                        const float* sinks = nullptr) {
  const int64_t num_seqs = lens.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (-cost, task), cost ~ q_len x seq_len
  const int32_t* s = starts.data_ptr<int32_t>();
  const int32_t* l = lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t h = 0; h < num_kv_heads; ++h)
      tasks.emplace_back(-static_cast<int64_t>(s[i + 1] - s[i]) * l[i], i * num_kv_heads + h);
  std::stable_sort(tasks.begin(), tasks.end());
  auto run = [&](auto args, auto kernel64, auto kernel128) {
    args = {q.data_ptr<T>(), static_cast<const C*>(key_cache.data_ptr()), static_cast<const C*>(value_cache.data_ptr()),
            bt.data_ptr<int32_t>(), s, l, out.data_ptr<T>(), num_q_heads, num_kv_heads, key_cache.size(1), bt.size(1),
            static_cast<float>(scale), k_scale, v_scale, window, static_cast<float>(softcap), sinks};
    prefill_tasks_on_threads(args, head_dim == 64 ? kernel64 : kernel128, tasks, num_kv_heads);
  };
  if (g_isa >= Isa::kAvx512)
    run(avx512::f32attn::PrefillArgs<T, C>{}, avx512::f32attn::prefill_task<T, 64, C>,
        avx512::f32attn::prefill_task<T, 128, C>);
  else
    run(avx2::f32attn::PrefillArgs<T, C>{}, avx2::f32attn::prefill_task<T, 64, C>,
        avx2::f32attn::prefill_task<T, 128, C>);
}
#endif

at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor query_start_loc, at::Tensor seq_lens,
                                      double scale, int64_t window, double softcap,
                                      c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, Hq, D], cache [NB, BS, Hkv, D]");
  TORCH_CHECK(prefill_attention_supported(query, key_cache), "native prefill attention: fp32 or bf16, head_dim "
              "64 or 128, and an AVX2 CPU expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto starts = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  TORCH_CHECK(key_cache.size(3) == q.size(2) && q.size(1) % key_cache.size(2) == 0, "head shapes disagree");
  TORCH_CHECK(starts.size(0) == lens.size(0) + 1 && bt.size(0) == lens.size(0),
              "one table row and one chunk per sequence");
  TORCH_CHECK(starts.data_ptr<int32_t>()[starts.size(0) - 1] == q.size(0),
              "query_start_loc must end at the number of query tokens");
  const at::Tensor sink_logits = checked_sinks(sinks, q.size(1));
#ifdef LLK_X86_VARIANTS
  if (q.scalar_type() == at::kFloat)
    prefill_on_threads<float>(q, key_cache, value_cache, bt, starts, lens, out, scale, window, softcap, nullptr,
                              nullptr, sinks_data(sink_logits));
  else
    prefill_on_threads<at::BFloat16>(q, key_cache, value_cache, bt, starts, lens, out, scale, window, softcap,
                                     nullptr, nullptr, sinks_data(sink_logits));
#endif
  return out;
}

// Causal prefill / extend over an 8-bit KV pool: paged_prefill_attention on each task's K and V
// dequantized once (code * scale in fp32, as kernels/kv_quant.py's dequantize_per_token).
at::Tensor paged_prefill_attention_codes(at::Tensor query, const std::string& kind, at::Tensor k_codes,
                                            at::Tensor v_codes, at::Tensor k_scale, at::Tensor v_scale,
                                            at::Tensor block_tables, at::Tensor query_start_loc,
                                            at::Tensor seq_lens, double scale, int64_t window, double softcap) {
  check_code_pool(query, k_codes, v_codes, k_scale, v_scale);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "int32 tables");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto starts = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  TORCH_CHECK(starts.size(0) == lens.size(0) + 1 && bt.size(0) == lens.size(0),
              "one table row and one chunk per sequence");
  TORCH_CHECK(starts.data_ptr<int32_t>()[starts.size(0) - 1] == q.size(0),
              "query_start_loc must end at the number of query tokens");
#ifdef LLK_X86_VARIANTS
  LLK_CODE_DISPATCH(kind, [&] {
    if (q.scalar_type() == at::kFloat)
      prefill_on_threads<float, code_t>(q, k_codes, v_codes, bt, starts, lens, out, scale, window, softcap,
                                        k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
    else
      prefill_on_threads<at::BFloat16, code_t>(q, k_codes, v_codes, bt, starts, lens, out, scale, window, softcap,
                                               k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
  });
#endif
  return out;
}

// ---- RMSNorm (+ residual) ------------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps,
                                                  c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "x [N, H], weight [H]");
  auto xc = x.contiguous();
  auto w = weight.contiguous().to(x.scalar_type());
  auto out = at::empty_like(xc);
  auto new_residual = residual.has_value() ? at::empty_like(xc) : xc;
  auto rc = residual.has_value() ? residual->contiguous() : xc;
  const int64_t rows = xc.size(0), hidden = xc.size(1);
  LLK_DISPATCH(xc.scalar_type(), "rms_norm", [&] {
    const scalar_t* rp = residual.has_value() ? rc.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      LLK_ISA_CALL(scalar_t, rms_norm_rows, xc.data_ptr<scalar_t>(), rp, w.data_ptr<scalar_t>(),
                      out.data_ptr<scalar_t>(), new_residual.data_ptr<scalar_t>(), begin, end, hidden,
                      static_cast<float>(eps));
    });
  });
  return {out, new_residual};
}

// ---- SiLU-and-mul -------------------------------------------------------------------------------
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x [N, 2 * d]");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), d = xc.size(1) / 2;
  auto out = at::empty({rows, d}, xc.options());
  LLK_DISPATCH(xc.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      LLK_ISA_CALL(scalar_t, silu_and_mul_rows, xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), begin, end, d);
    });
  });
  return out;
}

// ---- rotary embedding (rotate-half layout) ------------------------------------------------------
at::Tensor rotate(at::Tensor x, at::Tensor positions, at::Tensor cos_sin_cache) {
  // x [T, H, D] (any strides with a contiguous last dim) -> a new contiguous [T, H, D]
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, H, D] with a contiguous last dim");
  auto pos = positions.to(at::kLong).contiguous();
  auto cache = cos_sin_cache.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rot = cache.size(1);
  auto out = at::empty({tokens, heads, dim}, x.options());
  LLK_DISPATCH(x.scalar_type(), "rotary", [&] {
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      LLK_ISA_CALL(scalar_t, rotate_rows, x.data_ptr<scalar_t>(), x.stride(0), x.stride(1),
                      pos.data_ptr<int64_t>(), cache.data_ptr<float>(), out.data_ptr<scalar_t>(), begin, end,
                      heads, dim, rot);
    });
  });
  return out;
}

// ---- KV store --------------------------------------------------------------------------------
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping) {
  // key/value [T, Hkv, D] (rows may be strided, last two dims contiguous), caches [NB, BS, Hkv, D]
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "K/V and cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = key.size(0), row = key_cache.size(2) * key_cache.size(3);
  auto copy = [&](const at::Tensor& src, at::Tensor& dst) {
    auto s2 = src.reshape({tokens, row});
    TORCH_CHECK(s2.stride(1) == 1, "K/V rows must be contiguous");
    const int64_t elem = s2.element_size(), stride = s2.stride(0);
    const char* sp = static_cast<const char*>(s2.data_ptr());
    char* dp = static_cast<char*>(dst.data_ptr());
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      if (slot[t] >= 0) std::memcpy(dp + slot[t] * row * elem, sp + t * stride * elem, row * elem);
  };
  copy(key, key_cache);
  copy(value, value_cache);
}

#ifdef LLK_X86_VARIANTS
Fp32Kernels fp32_kernels(bool wide) {
  if (wide)
    return {avx512::rms_norm_rows<float>, avx512::rotate_rows<float>, avx512::silu_and_mul_rows<float>,
            avx512::decode_range<float>};
  return {avx2::rms_norm_rows<float>, avx2::rotate_rows<float>, avx2::silu_and_mul_rows<float>,
          avx2::decode_range<float>};
}

template <typename C>
QuantizeRowsFn<C> quantize_rows_fn(bool wide) {
  return wide ? avx512::quantize_rows<C> : avx2::quantize_rows<C>;
}

template <typename C>
DecodeCodesFn<C> decode_codes_fn(bool wide) {
  return wide ? avx512::decode_codes_range<float, C> : avx2::decode_codes_range<float, C>;
}

template QuantizeRowsFn<Int8Code> quantize_rows_fn<Int8Code>(bool);
template QuantizeRowsFn<Fp8E4m3Code> quantize_rows_fn<Fp8E4m3Code>(bool);
template QuantizeRowsFn<Fp8E5m2Code> quantize_rows_fn<Fp8E5m2Code>(bool);
template DecodeCodesFn<Int8Code> decode_codes_fn<Int8Code>(bool);
template DecodeCodesFn<Fp8E4m3Code> decode_codes_fn<Fp8E4m3Code>(bool);
template DecodeCodesFn<Fp8E5m2Code> decode_codes_fn<Fp8E5m2Code>(bool);
#endif

}  // namespace llk::cpu
