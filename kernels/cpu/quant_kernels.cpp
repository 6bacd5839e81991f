// Quantized linear kernels for CPUs: y[m, n] = sum_k x[m, k] * w[n, k], with w in one of the packed
// formats of llmctl/layers/quantization/formats.py, read straight from the packed bytes (no float
// copy of the weight is made; the prefill path dequantizes one slab of rows at a time).
//
// Decode (few rows of x) is memory-bound: every weight byte is read once per step, so the kernels
// stream the packed rows and do the arithmetic in integers, like llama.cpp:
// - int4 and int8 weights: the activations are quantized per row and per block of 32 inputs to
//   int16 (scale = max|x| / 32767, round to nearest even); each 32-input block is one integer dot
//   product (int8 weights widened to s16, int4 nibbles masked in 16-bit words; madd -> s32,
//   exact), scaled in float by weight-scale x activation-scale. An asymmetric weight's min adds min * sum(x over the group), with the exact
//   float sum of x. (int8 activations, llama.cpp's Q8_1, cost SmolLM2-135M Q4_1 +1.4 % perplexity
//   and flipped greedy answers at close margins; int16 costs about one instruction more a block.)
//   Per-output-channel int8 (group == K, no mins) rounds activations per token instead and sums
//   each dot product exactly in integers (int8_gemm.h), at every M.
// - fp8 (e4m3fn) weights: bytes become fp16 by moving the bit fields ((b & 0x80) << 8 | (b & 0x7f) << 7
//   is the same number times 2^-8, subnormals included), F16C converts to fp32, fp32 FMAs with x.
// Prefill (many rows) is compute-bound. fp8 then dequantizes a slab of weight rows to fp32 and
// multiplies it with at::mm (torch's BLAS), which re-uses each weight across all rows of x. int4 and
// int8 keep the integer path at every M, so that a row's result never depends on the batch it is in
// (batched == unbatched); their slab path, with exact float activations, is there on request.
//
// Scales and mins are float32, or float16 where every value is exactly a float16 (GGUF files store
// them so; kernels/quant_native.py makes the copy), or in the tile-interleaved layout stepped: an
// int8 per group times a float32 step per 256 inputs (GGUF's K-quants, d * sc). Decode streams
// every weight byte once a step and is bound by memory bandwidth on small CPUs: float16 scales and
// mins cut Q4_1's bytes per weight from 0.75 to 0.625 (Q8_0's from 1.125 to 1.0625), stepped ones
// Q4_K's from 0.75 to 0.59. Each gives the same float32 values, so the results are bitwise those
// of the float32 scales.
//
// ISA (isa.h): AVX2+FMA+F16C is the baseline of this file (the `#pragma GCC target` below; the
// loader checks the CPU for it before any call). Functions for AVX-512 carry their own target
// attributes and are chosen at run time, with the same bits as the AVX2 ones: per-channel int8's
// VNNI tile (int8_gemm.h, vpdpwssd) and the interleaved int4/int8 tiles' zmm passes below.
// `set_isa` caps them (avx2: no AVX-512 code; generic: also per-channel int8's scalar tile).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if !defined(__x86_64__)
#error "the quantized CPU kernels need x86-64 (AVX2); other CPUs use the torch reference"
#endif
#include <immintrin.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"
#include "quant_kernels.h"

#pragma GCC target("avx2,fma,f16c")

namespace {

using llk::quant::QB;
using llk::quant::QuantizedX;
using llk::quant::RT;
using llk::quant::STEP;
using llk::quant::TileLayout;
using llk::quant::interleaved_gemm;
using llk::quant::kE2m1Values;
using llk::quant::kE2m1Weights;
using llk::quant::kInt4Weights;
using llk::quant::kInt8Weights;
using llk::quant::packed_gemm;
using llk::quant::quantize_x;
using llk::quant::tile_layout;

// The highest variant `set_isa` allows (the CPU's own support is checked where a variant is picked).
std::atomic<int> g_isa_cap{static_cast<int>(llk::Isa::kAvx512Bf16)};
// Rows of x from which interleaved_gemm takes qgemm.h's many-row GEMM (below: the int16
// passes, bound by the weight stream at those sizes): 0 for qgemm_min_rows' measured default per
// variant and weight kind; set_qgemm_min_rows fixes it for both kinds (tests, A/B runs).
std::atomic<int64_t> g_qgemm_min_rows{0};
int64_t qgemm_min_rows(bool int4);  // after qgemm.h

constexpr int64_t MT = 4;   // rows of x that share one pass over a weight row (fp8)
constexpr float X_LEVELS = 32767.f;  // activations: int16, scale = max|x| / 32767 per 32-input block

// ---- dynamic int16 activations ---------------------------------------------------------------

// int4_tile_avx2 reads a block's 16 weight bytes as 8 16-bit words of 4 nibbles, word i = inputs
// 4i .. 4i+3; its lanes want x as (4i+0 for each i, 4i+1 ..., 4i+2 ..., 4i+3 ...): position j of the
// permuted block holds input 4 * (j % 8) + j / 8.
//
// One block in AVX2 (at m = 1 this runs on one thread before every GEMV: K = 1,536 took 6 us in
// scalar code, a tenth of the down projection): max|x| (maxps keeps the running max when x is
// NaN, as fmax does), x * (32767 / max) rounded to nearest even (what nearbyint does in the default
// rounding mode), packed to int16; the sums stay scalar, in input order (the mins' float sums).
__attribute__((target("avx2,fma"))) inline void quantize_block_avx2(const float* xb, bool nibble_order, int16_t* qb,
                                                                     float* scale, float* sums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax8 = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), amax8);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  float s0 = 0.f, s1 = 0.f;
  for (int j = 0; j < 16; ++j) s0 += xb[j];
  for (int j = 16; j < QB; ++j) s1 += xb[j];
  *scale = amax / X_LEVELS;
  sums[0] = s0;
  sums[1] = s1;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? X_LEVELS / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  if (nibble_order) {  // q[c] <- inputs c, 4 + c, ..., 28 + c: a 4 x 4 transpose of (4a + c, 4a + 4 + c) pairs
    const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < 4; ++i) q[i] = _mm256_permutevar8x32_epi32(q[i], pairs);
    const __m256i lo01 = _mm256_unpacklo_epi64(q[0], q[1]), hi01 = _mm256_unpackhi_epi64(q[0], q[1]);
    const __m256i lo23 = _mm256_unpacklo_epi64(q[2], q[3]), hi23 = _mm256_unpackhi_epi64(q[2], q[3]);
    q[0] = _mm256_permute2x128_si256(lo01, lo23, 0x20);
    q[1] = _mm256_permute2x128_si256(hi01, hi23, 0x20);
    q[2] = _mm256_permute2x128_si256(lo01, lo23, 0x31);
    q[3] = _mm256_permute2x128_si256(hi01, hi23, 0x31);
  }
  for (int i = 0; i < 2; ++i)  // packs interleaves the 128-bit lanes; the permute puts them back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16 * i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
}

}  // namespace

QuantizedX llk::quant::quantize_x(const float* x, int64_t m, int64_t k, bool nibble_order) {
  // At qgemm's sizes the int16 rows are made only if a row-layout GEMM asks for them (packed_gemm).
  if (m >= qgemm_min_rows(/*int4=*/nibble_order)) return QuantizedX{m, k, {}, {}, {}, x};
  QuantizedX r{m, k, std::vector<int16_t>(m * k), std::vector<float>(m * k / QB), std::vector<float>(m * k / 16), x};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < k / QB; ++b)
        quantize_block_avx2(x + i * k + b * QB, nibble_order, r.q.data() + i * k + b * QB,
                            &r.scale[i * (k / QB) + b], &r.sum16[i * (k / 16) + 2 * b]);
    }
  });
  return r;
}

namespace {

// The int16 rows of x that quantize_x skipped at qgemm's sizes (its m, k and float rows kept).
QuantizedX int16_rows(const QuantizedX& xq, bool nibble_order) {
  QuantizedX r{xq.m, xq.k, std::vector<int16_t>(xq.m * xq.k), std::vector<float>(xq.m * xq.k / QB),
               std::vector<float>(xq.m * xq.k / 16), xq.x};
  at::parallel_for(0, xq.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t b = 0; b < xq.k / QB; ++b)
        quantize_block_avx2(xq.x + i * xq.k + b * QB, nibble_order, r.q.data() + i * xq.k + b * QB,
                            &r.scale[i * (xq.k / QB) + b], &r.sum16[i * (xq.k / 16) + 2 * b]);
  });
  return r;
}

// sum(x[row, g*G : (g+1)*G]) for every group g, from the 16-input partial sums.
inline void group_sums(const QuantizedX& xq, int64_t row, int64_t group, float* out) {
  const float* s = xq.sum16.data() + row * (xq.k / 16);
  for (int64_t g = 0; g < xq.k / group; ++g) {
    float t = 0.f;
    for (int64_t j = g * group / 16; j < (g + 1) * group / 16; ++j) t += s[j];
    out[g] = t;
  }
}

// ---- AVX2 -------------------------------------------------------------------------------------
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One fp8 row against float rows of x (k a multiple of 16); the result is 2^-8 times the dot product.
__attribute__((target("avx2,fma,f16c"))) void fp8_row_avx2(const uint8_t* w, const float* x, int64_t k,
                                                            int64_t rows, float* acc) {
  const __m256i sign = _mm256_set1_epi16(0x80), magnitude = _mm256_set1_epi16(0x7F);
  __m256 a[MT];
  for (int i = 0; i < MT; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, sign), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(h, magnitude), 7));
    const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
    const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
    for (int64_t i = 0; i < rows; ++i) {
      a[i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i * k + j), a[i]);
      a[i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i * k + j + 8), a[i]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) acc[i] = hsum256(a[i]);
}

// Decode-shaped tiles: R weight rows (R <= RT) against one quantized x row, so that each x block is
// loaded once for R rows and R independent accumulation chains hide the FMA latency. The loops walk
// groups, then the blocks of a group: no division in the inner loop. Every row's arithmetic (the
// per-block products, its own accumulator, hsum256, then the mins in group order) does not depend
// on R, so a row's result does not depend on which tile, thread or batch it lands in.

// One x row's quantized blocks, their scales and its exact group sums (for the mins).
struct XRow {
  const int16_t* q;
  const float* scale;
  const float* group_sums;
  // The same sums by group (sums_by_group[g * stride + u] for the u-th row of a pass): set on the
  // first row of a pass of TilePick::by_group_from rows or more (add_pass_mins reads 4 or 8 rows'
  // sums of a group at once).
  const float* sums_by_group = nullptr;
  int64_t stride = 0;
};

// A scale or min as float32: stored so, or as float16 bits (converted exactly).
inline float to_float(float v) { return v; }
__attribute__((target("f16c"))) inline float to_float(uint16_t half_bits) { return _cvtsh_ss(half_bits); }

template <typename S>
using TileFn = void (*)(const uint8_t*, int64_t, const S*, const S*, int64_t, int64_t, XRow, float*);

// The product and the sum round separately (no FMA contraction, whichever S: the compiler contracted
// the two instantiations differently). Row r's min of group g is mins[r * groups + g].
template <int R, typename S>
__attribute__((target("avx2,fma,f16c"), optimize("fp-contract=off"))) inline void add_mins(
    const S* mins, int64_t groups, const float* xs, const __m256* acc, float* out) {
  float y[R];
  for (int r = 0; r < R; ++r) y[r] = hsum256(acc[r]);
  if (mins != nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int r = 0; r < R; ++r) y[r] += to_float(mins[r * groups + g]) * xs[g];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = y[r];
}

// int4 weights against int16 activations, without widening bytes: the block's 16 bytes go to both
// 128-bit lanes, read as 16-bit words of 4 nibbles; one AND keeps nibble 0 in the low lane and
// nibble 1 (times 16) in the high lane, a shift by 8 and the same AND give nibbles 2 and 3; two madd
// with x (permuted to match by quantize_x), then the high lane's int32 sums shift right by 4
// (exact: multiples of 16). Exact int32 sums (|sum| < 32 * 15 * 32767 < 2^24, so the float
// conversion is exact too; before the shift |16 * 15 * 32767 * 4| < 2^31).
template <int R, typename S>
__attribute__((target("avx2,fma,f16c"))) void int4_tile_avx2(const uint8_t* w, int64_t row_bytes, const S* scales,
                                                             const S* mins, int64_t groups, int64_t bpg, XRow x,
                                                             float* out) {
  const __m256i nibble = _mm256_setr_epi16(15, 15, 15, 15, 15, 15, 15, 15, 240, 240, 240, 240, 240, 240, 240, 240);
  const __m256i unscale = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const __m256i x01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QB));
      const __m256i x23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QB + 16));
      const float xd = x.scale[b];
      for (int r = 0; r < R; ++r) {
        const __m256i raw = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + b * 16)));
        const __m256i n01 = _mm256_and_si256(raw, nibble), n23 = _mm256_and_si256(_mm256_srli_epi16(raw, 8), nibble);
        const __m256i dot = _mm256_srav_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(n01, x01), _mm256_madd_epi16(n23, x23)), unscale);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(to_float(scales[r * groups + g]) * xd),
                                 acc[r]);
      }
    }
  }
  add_mins<R, S>(mins, groups, x.group_sums, acc, out);
}

// int8 weights against int16 activations: the 32 weights widened to 16 bits, madd with x. Each
// int32 lane sums at most 4 products, |sum| <= 4 * 128 * 32767 < 2^24: exact, also as a float.
// Group 16: the first 16 inputs and the last 16 get their own scale, so the halves stay apart.
template <int R, typename S>
__attribute__((target("avx2,fma,f16c"))) void int8_tile_avx2(const uint8_t* w_bytes, int64_t row_bytes, const S* scales,
                                                             const S* mins, int64_t groups, int64_t bpg, XRow x,
                                                             float* out) {
  const int8_t* w = reinterpret_cast<const int8_t*>(w_bytes);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t nb = bpg == 0 ? groups / 2 : groups * bpg;
  int64_t g = 0, left = bpg;  // the group of block b (bpg != 0), without a division per block
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QB));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QB + 16));
    const float xd = x.scale[b];
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + b * QB));
      const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)), xlo);
      const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)), xhi);
      const S* s = scales + r * groups;
      if (bpg == 0) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(to_float(s[2 * b]) * xd), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(to_float(s[2 * b + 1]) * xd), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(to_float(s[g]) * xd),
                                 acc[r]);
      }
    }
    if (bpg != 0 && --left == 0) ++g, left = bpg;
  }
  add_mins<R, S>(mins, groups, x.group_sums, acc, out);
}

// out[m, n] for every n: tiles of RT weight rows in parallel, each against every row of x while the
// tile's bytes are in L1.
template <typename S>
void tiled_gemm(const QuantizedX& xq, const uint8_t* w, int64_t row_bytes, const S* scales, const S* mins,
                int64_t group, int64_t n, const TileFn<S>* tile_fns, float* out) {
  const int64_t m = xq.m, groups = xq.k / group, nb = xq.k / QB;
  const int64_t bpg = group == 16 ? 0 : group / QB;
  std::vector<float> xsums(m * groups);
  if (mins != nullptr) {
    for (int64_t r = 0; r < m; ++r) group_sums(xq, r, group, xsums.data() + r * groups);
  }
  const int64_t tiles = (n + RT - 1) / RT;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float y[RT];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * RT, rows = std::min(RT, n - j0);
      for (int64_t i = 0; i < m; ++i) {
        const XRow x{xq.q.data() + i * xq.k, xq.scale.data() + i * nb, xsums.data() + i * groups};
        tile_fns[rows](w + j0 * row_bytes, row_bytes, scales + j0 * groups, mins ? mins + j0 * groups : nullptr,
                       groups, bpg, x, y);
        for (int64_t r = 0; r < rows; ++r) out[i * n + j0 + r] = y[r];
      }
    }
  });
}

template <typename S>
void packed_gemm_as(const QuantizedX& xq, const uint8_t* w, bool int4, const void* scales, const void* mins,
                    int64_t group, int64_t n, float* out) {
  static constexpr TileFn<S> int4_tiles[] = {nullptr, int4_tile_avx2<1, S>, int4_tile_avx2<2, S>,
                                             int4_tile_avx2<3, S>, int4_tile_avx2<4, S>};
  static constexpr TileFn<S> int8_tiles[] = {nullptr, int8_tile_avx2<1, S>, int8_tile_avx2<2, S>,
                                             int8_tile_avx2<3, S>, int8_tile_avx2<4, S>};
  tiled_gemm<S>(xq, w, int4 ? xq.k / 2 : xq.k, static_cast<const S*>(scales), static_cast<const S*>(mins), group, n,
                int4 ? int4_tiles : int8_tiles, out);
}

// The integer path of a packed int4 (``int4``) or int8 weight [n, xq.k] against quantized x -> out [m, n].
// ``scales`` and ``mins`` (undefined: none) are both float32 or both float16.
}  // namespace

void llk::quant::packed_gemm(const QuantizedX& xq, const uint8_t* w, bool int4, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t group, int64_t n, float* out) {
  if (xq.q.size() != static_cast<size_t>(xq.m * xq.k))  // quantize_x left the int16 rows to qgemm's sizes
    return packed_gemm(int16_rows(xq, int4), w, int4, scales, mins, group, n, out);
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == at::kFloat, "scales must be float32 or float16");
  TORCH_CHECK(!mins.defined() || mins.scalar_type() == scales.scalar_type(), "mins and scales of one dtype");
  const void* mn = mins.defined() ? mins.data_ptr() : nullptr;
  if (half) packed_gemm_as<uint16_t>(xq, w, int4, scales.data_ptr(), mn, group, n, out);
  else packed_gemm_as<float>(xq, w, int4, scales.data_ptr(), mn, group, n, out);
}

namespace {

// ---- tile-interleaved layout -----------------------------------------------------------------
// The layout above has a tile read 12 places at once (RT rows' blocks, RT rows' scales, RT rows'
// mins). The interleaved layout, made once when a weight is bound (interleave_tiles), stores each
// tile of RT rows as one run of bytes in the order the tile reads them (llama.cpp's repacked
// q4_0x4 idea), so a tile is one sequential stream:
//   for each group g: the RT rows' scales of g, then for each block of g the RT rows' blocks (16
//                     bytes for int4, 32 for int8), row after row;
//   then, with mins:  for each group g the RT rows' mins of g.
// int8 in groups of 16 (GGUF's Q6_K): for each 32-input block the RT rows' scales of its first
// group, of its second, then the RT rows' 32 bytes; the mins as above, per group of 16.
// Scales and mins are float32, float16 (where exact) or stepped: an int8 each, and at the tile's
// start the RT rows' float32 steps of each STEP inputs (then those of the mins), where the stream
// that prefetches the tile's bytes reads them first. GGUF's K-quants
// store d * sc so (d float16, sc 6 or 8 bits): Q4_K reads 4.75 bits a weight instead of 6.
// Rows past n (in the last tile) are zero. Each row's arithmetic is that of the tiles above, in the
// same order (the same products, accumulators, hsum256 and mins): the same bits.

// Each block asks for the bytes 2 KiB ahead of it in the tile's stream (one line a block for int4,
// two for int8; past a tile's end, the next tile's): at one thread 8-25 % faster in
// benchmarks/kernels/gemv_micro.py than leaving it to the hardware prefetchers (1 KiB and 4 KiB: less).
constexpr int64_t TILE_PREFETCH = 2048;

template <typename S>
using InterleavedTileFn = void (*)(const uint8_t*, const TileLayout&, const XRow*, float*);

// A tile's scales and mins as float32, RT rows at a time: stored so, as float16 bits (converted
// exactly), or stepped (S = int8_t: an int8 per group and row times the row's float32 step for
// the group's STEP inputs, a product that is exact): every format gives the kernels the very
// floats of the float32 scales, hence the same bits.
template <typename S>
struct TileScales {
  const float* steps = nullptr;  // stepped: [steps][RT] scale steps, then [steps][RT] min steps
  int64_t min_steps = 0;
  int shift = 0;  // log2(groups per step)
  TileScales(const uint8_t* tile, const TileLayout& l) {
    if constexpr (std::is_same_v<S, int8_t>) {
      steps = reinterpret_cast<const float*>(tile);
      min_steps = l.steps() * RT;
      shift = __builtin_ctzll(static_cast<unsigned long long>(l.groups_per_step()));
    }
  }
  // The RT values stored at p: group g's scales (or, with `mins`, its mins).
  __attribute__((target("avx2,f16c"), always_inline)) inline __m128 values(const uint8_t* p, int64_t g,
                                                                           bool mins = false) const {
    if constexpr (std::is_same_v<S, uint16_t>) {
      return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    } else if constexpr (std::is_same_v<S, float>) {
      return _mm_loadu_ps(reinterpret_cast<const float*>(p));
    } else {
      int32_t four;
      std::memcpy(&four, p, sizeof(four));
      const __m128 ints = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
      return _mm_mul_ps(ints, _mm_loadu_ps(steps + (mins ? min_steps : 0) + (g >> shift) * RT));
    }
  }
  // Row r's value of the same (the scalar code's).
  inline float value(const uint8_t* p, int64_t g, int r, bool mins = false) const {
    if constexpr (std::is_same_v<S, int8_t>) {
      return static_cast<float>(static_cast<int8_t>(p[r])) * steps[(mins ? min_steps : 0) + (g >> shift) * RT + r];
    } else {
      S v;
      std::memcpy(&v, p + r * sizeof(S), sizeof(S));
      return to_float(v);
    }
  }
};

// Group g's RT scales at p (in both 128-bit lanes); times a block's x scale, lane r (and r + 4)
// holds row r's scale * xd, the very product the row layout's tiles compute one row at a time.
template <typename S>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 group_scales(const TileScales<S>& ts,
                                                                                  const uint8_t* p, int64_t g) {
  const __m128 s4 = ts.values(p, g);
  return _mm256_set_m128(s4, s4);
}

__attribute__((target("avx2"))) inline __m256 lane(__m256 v, int r) {
  return _mm256_permutevar_ps(v, _mm256_set1_epi32(r));
}

// What differs between the formats in an interleaved tile: one row's block unpacked to 16-bit
// words (once, for every x row of a pass), its product with one x block as int32 lanes (exact, as
// in int4_tile_avx2 / int8_tile_avx2), and a block's bytes per row; the *512 forms are the same for
// the AVX-512 tiles, two 256-bit halves at a time.
struct Int4Block {
  static constexpr int64_t BYTES = QB / 2;
  struct Words { __m256i n01, n23; };
  __attribute__((target("avx2"), always_inline)) static inline Words unpack(const uint8_t* w) {
    const __m256i nibble = _mm256_setr_epi16(15, 15, 15, 15, 15, 15, 15, 15, 240, 240, 240, 240, 240, 240, 240, 240);
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return {_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_srli_epi16(raw, 8), nibble)};
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i dot(const Words& w, __m256i x01, __m256i x23) {
    const __m256i unscale = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    return _mm256_srav_epi32(_mm256_add_epi32(_mm256_madd_epi16(w.n01, x01), _mm256_madd_epi16(w.n23, x23)), unscale);
  }
  // The zmm forms (tile_interleaved_pairs): the same words in both 256-bit halves, but each nibble
  // shifted down to the bottom by its own count (AVX512-BW's per-word shift), so the high lanes
  // need no shift after the madd: the same int32 sums as dot's, one instruction less per x row.
  struct Words512 { __m512i n01, n23; };
  // Each 128-bit lane of raw holds a row's 16 bytes; the low lanes of a 256-bit half keep nibbles
  // 0 and 2 of each word, the high lanes nibbles 1 and 3.
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 nibbles512(__m512i raw) {
    const __m512i low4 = _mm512_set1_epi16(15);
    const __m512i shift01 = _mm512_setr4_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL);
    const __m512i shift23 = _mm512_setr4_epi64(0x0008000800080008LL, 0x0008000800080008LL, 0x000C000C000C000CLL,
                                               0x000C000C000C000CLL);
    return {_mm512_and_si512(_mm512_srlv_epi16(raw, shift01), low4), _mm512_and_si512(_mm512_srlv_epi16(raw, shift23), low4)};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 unpack512(const uint8_t* w) {
    return nibbles512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i dot512(const Words512& w, __m512i x01,
                                                                                          __m512i x23) {
    return _mm512_add_epi32(_mm512_madd_epi16(w.n01, x01), _mm512_madd_epi16(w.n23, x23));
  }
  // Rows r and r + 1 of a block (16 bytes each, consecutive in the interleaved stream), one per half.
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 unpack512_rows(const uint8_t* w) {
    const __m256i two = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return nibbles512(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(two)));
  }
};

struct Int8Block {
  static constexpr int64_t BYTES = QB;
  struct Words { __m256i lo, hi; };
  __attribute__((target("avx2"), always_inline)) static inline Words unpack(const uint8_t* w) {
    const __m128i* v = reinterpret_cast<const __m128i*>(w);
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(v)), _mm256_cvtepi8_epi16(_mm_loadu_si128(v + 1))};
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i dot(const Words& w, __m256i xlo, __m256i xhi) {
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, xlo), _mm256_madd_epi16(w.hi, xhi));
  }
  struct Words512 { __m512i lo, hi; };
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 unpack512(const uint8_t* w) {
    const Words ymm = unpack(w);
    return {_mm512_broadcast_i64x4(ymm.lo), _mm512_broadcast_i64x4(ymm.hi)};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 unpack512_rows(const uint8_t* w) {
    const __m128i* v = reinterpret_cast<const __m128i*>(w);  // row r: v[0], v[1]; row r + 1: v[2], v[3]
    return {_mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128(v + 2), _mm_loadu_si128(v))),
            _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128(v + 3), _mm_loadu_si128(v + 1)))};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i dot512(const Words512& w, __m512i xlo,
                                                                                          __m512i xhi) {
    return _mm512_add_epi32(_mm512_madd_epi16(w.lo, xlo), _mm512_madd_epi16(w.hi, xhi));
  }
};

// int8 values held as 4-bit codes (kE2m1Values; byte i: input i's code, then input i + 16's).
// The AVX-512 forms look them up by vpshufb into the very bytes an Int8Block holds and take its
// words. The AVX2 form, bound by its shuffles at one row of x, widens the codes' bytes to words
// first and looks up value + OFFSET (a byte >= 0, 0 for the zero high byte): one shuffle fewer a
// block than looking up and sign-extending, and dot takes OFFSET * (x's lane sums) back off
// (x_offset, once per block and x row), so each int32 lane is int8's exact sum: the same bits.
struct E2m1Block {
  static constexpr int64_t BYTES = QB / 2;
  static constexpr int16_t OFFSET = -kE2m1Values[0];
  static_assert(kE2m1Values[0] < 0 && kE2m1Values[15] + OFFSET < 128, "code 0 the least value; value + OFFSET a byte");
  struct Words { __m256i lo, hi; };  // value + OFFSET as int16: inputs 0-15, 16-31
  using Words512 = Int8Block::Words512;
  // A block's 32 values: inputs 0-15 in lo, 16-31 in hi.
  __attribute__((target("avx2"), always_inline)) static inline void values(const uint8_t* w, __m128i& lo, __m128i& hi) {
    const __m128i book = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Values)), low4 = _mm_set1_epi8(15);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    lo = _mm_shuffle_epi8(book, _mm_and_si128(raw, low4));
    hi = _mm_shuffle_epi8(book, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
  }
  __attribute__((target("avx2"), always_inline)) static inline Words unpack(const uint8_t* w) {
    const __m128i book = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Values)),
                                      _mm_set1_epi8(static_cast<char>(OFFSET)));
    const __m256i book2 = _mm256_broadcastsi128_si256(book);
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return {_mm256_shuffle_epi8(book2, _mm256_and_si256(words, _mm256_set1_epi16(15))),
            _mm256_shuffle_epi8(book2, _mm256_srli_epi16(words, 4))};
  }
  // OFFSET * x's sums over each int32 lane's inputs (2j, 2j + 1 of each half): what dot takes off.
  __attribute__((target("avx2"), always_inline)) static inline __m256i x_offset(__m256i xlo, __m256i xhi) {
    const __m256i offset = _mm256_set1_epi16(OFFSET);
    return _mm256_add_epi32(_mm256_madd_epi16(xlo, offset), _mm256_madd_epi16(xhi, offset));
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i dot(const Words& w, __m256i xlo, __m256i xhi,
                                                                         __m256i x_off) {
    return _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(w.lo, xlo), _mm256_madd_epi16(w.hi, xhi)), x_off);
  }
  // The AVX-512 forms take a tile's whole block, RT rows of 16 code bytes (one 64-byte line), and
  // look its four rows up together, one 128-bit lane a row (two vpshufb for all four, a third of
  // the instructions of looking each row's halves up apart): inputs 0-15 in `lo`, 16-31 in `hi`.
  struct Looked512 { __m512i lo, hi; };
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Looked512 look_up512(const uint8_t* w) {
    static_assert(RT * BYTES == 64, "a tile's block: one zmm of codes");
    const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Values)));
    const __m512i raw = _mm512_loadu_si512(w), low4 = _mm512_set1_epi8(15);
    return {_mm512_shuffle_epi8(book, _mm512_and_si512(raw, low4)),
            _mm512_shuffle_epi8(book, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4))};
  }
  // As Int8Block::unpack512_rows' words for rows 2h and 2h + 1 of the looked-up block.
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 pair512(const Looked512& v, int h) {
    const auto half = [h](__m512i x) { return h == 0 ? _mm512_castsi512_si256(x) : _mm512_extracti64x4_epi64(x, 1); };
    return {_mm512_cvtepi8_epi16(half(v.lo)), _mm512_cvtepi8_epi16(half(v.hi))};
  }
  // As Int8Block::unpack512's words for row r of the looked-up block: its lane in both halves.
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Words512 row512(const Looked512& v, int r) {
    const __m512i lane = _mm512_add_epi64(_mm512_set1_epi64(2 * r), _mm512_setr_epi64(0, 1, 0, 1, 0, 1, 0, 1));
    return {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(lane, v.lo))),
            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi64(lane, v.hi)))};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i dot512(const Words512& w, __m512i xlo,
                                                                                          __m512i xhi) {
    return Int8Block::dot512(w, xlo, xhi);
  }
};

// The RT rows' results of a tile against one x row: each row's hsum256 (the same adds in the same
// order, four rows at once by a transpose: (a0 + a2) + (a1 + a3) per row), then its mins in group
// order, four rows per vector (the interleaved layout stores a group's RT mins together). Product
// and sum round separately, as in add_mins; the same bits as RT calls of the scalar code.
__attribute__((target("avx2,fma"))) inline __m128 hsum_rows(const __m256* acc) {
  static_assert(RT == 4, "one 4-lane vector per tile");
  __m128 s0 = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
  __m128 s1 = _mm_add_ps(_mm256_castps256_ps128(acc[1]), _mm256_extractf128_ps(acc[1], 1));
  __m128 s2 = _mm_add_ps(_mm256_castps256_ps128(acc[2]), _mm256_extractf128_ps(acc[2], 1));
  __m128 s3 = _mm_add_ps(_mm256_castps256_ps128(acc[3]), _mm256_extractf128_ps(acc[3], 1));
  _MM_TRANSPOSE4_PS(s0, s1, s2, s3);
  return _mm_add_ps(_mm_add_ps(s0, s2), _mm_add_ps(s1, s3));
}

// One x row's RT results y plus its mins (``mins``: the tile's, or null), in group order.
template <typename S>
__attribute__((target("avx2,fma,f16c"), optimize("fp-contract=off"))) inline __m128 add_row_mins(
    const TileScales<S>& ts, const uint8_t* mins, int64_t groups, const float* xs, __m128 y) {
  if (mins != nullptr) {
    for (int64_t g = 0; g < groups; ++g)
      y = _mm_add_ps(y, _mm_mul_ps(ts.values(mins + g * RT * sizeof(S), g, true), _mm_set1_ps(xs[g])));
  }
  return y;
}

template <typename S>
__attribute__((target("avx2,fma,f16c"))) inline void finish_rows(const TileScales<S>& ts, const uint8_t* mins,
                                                                  int64_t groups, const float* xs, const __m256* acc,
                                                                  float* out) {
  _mm_storeu_ps(out, add_row_mins(ts, mins, groups, xs, hsum_rows(acc)));
}

// A block's RT rows of bytes ask for the stream TILE_PREFETCH ahead: 1 line (int4), 2 (int8).
template <typename Block>
inline void prefetch_ahead(const uint8_t* p) {
  for (int64_t line = 0; line < RT * Block::BYTES / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(p + TILE_PREFETCH + 64 * line), _MM_HINT_T0);
}

// One tile of the interleaved layout against MX quantized x rows: walks the stream group by group
// (the RT scales, then each block's RT rows, each unpacked once for the MX rows), then adds the
// mins. ONE_BLOCK: groups of 32 (GGUF's Q4_1, Q4_0, Q8_0), the inner loop known to run once. Each
// x row's accumulators see the same products in the same order whatever MX: the same bits.
template <typename S, bool ONE_BLOCK, typename Block, int MX>
__attribute__((target("avx2,fma,f16c"))) void tile_interleaved(const uint8_t* p, const TileLayout& l, const XRow* x,
                                                               float* out) {
  const int64_t bpg = ONE_BLOCK ? 1 : l.bpg;
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m256 acc[MX][RT];
  for (int i = 0; i < MX; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    const __m256 scales = group_scales(ts, p, g);
    p += RT * sizeof(S);
    for (int64_t e = 0; e < bpg; ++e, ++b, p += RT * Block::BYTES) {
      prefetch_ahead<Block>(p);
      __m256i x0[MX], x1[MX], x_off[MX];
      __m256 sx[MX];
      for (int i = 0; i < MX; ++i) {
        x0[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].q + b * QB));
        x1[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].q + b * QB + 16));
        sx[i] = _mm256_mul_ps(scales, _mm256_set1_ps(x[i].scale[b]));
        if constexpr (std::is_same_v<Block, E2m1Block>) x_off[i] = Block::x_offset(x0[i], x1[i]);
      }
      for (int r = 0; r < RT; ++r) {
        const typename Block::Words w = Block::unpack(p + r * Block::BYTES);
        for (int i = 0; i < MX; ++i) {
          __m256i dot;
          if constexpr (std::is_same_v<Block, E2m1Block>) dot = Block::dot(w, x0[i], x1[i], x_off[i]);
          else dot = Block::dot(w, x0[i], x1[i]);
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), lane(sx[i], r), acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < MX; ++i)
    finish_rows<S>(ts, l.mins ? p : nullptr, l.groups, x[i].group_sums, acc[i], out + i * RT);
}

// int8 in groups of 16 against MX x rows (AVX2; the AVX-512 forms below give its bits): each block's two halves
// scaled apart, as int8_tile_avx2 does for group 16 (first half, then second, into the same
// accumulator), so each row gets the row layout's bits.
template <typename S, int MX>
__attribute__((target("avx2,fma,f16c"))) void tile_interleaved_g16(const uint8_t* p, const TileLayout& l,
                                                                   const XRow* x, float* out) {
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m256 acc[MX][RT];
  for (int i = 0; i < MX; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < l.groups / 2; ++b) {
    const __m256 first = group_scales(ts, p, 2 * b), second = group_scales(ts, p + RT * sizeof(S), 2 * b + 1);
    p += 2 * RT * sizeof(S);
    prefetch_ahead<Int8Block>(p);
    __m256i x0[MX], x1[MX];
    __m256 s0[MX], s1[MX];
    for (int i = 0; i < MX; ++i) {
      x0[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].q + b * QB));
      x1[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].q + b * QB + 16));
      const __m256 xd = _mm256_set1_ps(x[i].scale[b]);
      s0[i] = _mm256_mul_ps(first, xd);
      s1[i] = _mm256_mul_ps(second, xd);
    }
    for (int r = 0; r < RT; ++r) {
      const Int8Block::Words w = Int8Block::unpack(p + r * QB);
      for (int i = 0; i < MX; ++i) {
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w.lo, x0[i])), lane(s0[i], r), acc[i][r]);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w.hi, x1[i])), lane(s1[i], r), acc[i][r]);
      }
    }
    p += RT * QB;
  }
  for (int i = 0; i < MX; ++i)
    finish_rows<S>(ts, l.mins ? p : nullptr, l.groups, x[i].group_sums, acc[i], out + i * RT);
}

}  // namespace

TileLayout llk::quant::tile_layout(int64_t k, int64_t group, int64_t kind, int64_t scale_bytes, bool mins) {
  TORCH_CHECK(scale_bytes == 4 || scale_bytes == 2 || (scale_bytes == 1 && STEP % group == 0 && k % STEP == 0),
              "tile scales: 4 (float32), 2 (float16) or 1 byte (stepped: a group dividing ", STEP,
              " and K a multiple of it)");
  TORCH_CHECK(kind >= kInt8Weights && kind <= kE2m1Weights, "tile kind: 0 int8, 1 int4, 2 int8 as E2M1 codes");
  TORCH_CHECK(kind != kE2m1Weights || group % QB == 0, "E2M1 codes: groups of a multiple of 32");
  TileLayout l{k / group, group / QB, kind == kInt8Weights ? QB : QB / 2, scale_bytes, mins};  // group 16: bpg 0
  l.e2m1 = kind == kE2m1Weights;
  l.step_groups = STEP / (l.bpg == 0 ? 16 : l.bpg * QB);
  l.step_count = l.stepped() ? l.groups / l.step_groups : 0;
  return l;
}

namespace {

// The mins of a pass of 2 * PAIRS x rows (see tile_interleaved_pairs' end), 16 lanes a vector:
// a group's 4 mins repeated 4 times, times each row's group sum spread over its 4 lanes.
template <typename S, int PAIRS>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"), optimize("fp-contract=off"))) inline void
add_pass_mins(const TileScales<S>& ts, const uint8_t* mins, int64_t groups, const XRow& first, float* out) {
  static_assert(PAIRS % 2 == 0, "4 x rows per vector");
  constexpr int V = PAIRS / 2;  // vectors of 4 x rows x RT weight rows
  const __m512i spread[2] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                             _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)};
  __m512 y[V];
  for (int v = 0; v < V; ++v) y[v] = _mm512_loadu_ps(out + 16 * v);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 m16 = _mm512_broadcast_f32x4(ts.values(mins + g * RT * sizeof(S), g, true));
    const float* xs = first.sums_by_group + g * first.stride;
    for (int v = 0; v < V; ++v) {
      // The pass's rows only: 4 sums for a pass of 4 (the next row's may be past the array's end).
      const __m512 sums = V == 1 ? _mm512_castps128_ps512(_mm_loadu_ps(xs))
                                 : _mm512_castps256_ps512(_mm256_loadu_ps(xs + 8 * (v / 2)));
      const __m512 x16 = _mm512_permutexvar_ps(spread[v % 2], sums);
      y[v] = _mm512_add_ps(y[v], _mm512_mul_ps(m16, x16));
    }
  }
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + 16 * v, y[v]);
}

// group_scales in both 256-bit halves.
template <typename S>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"), always_inline)) inline __m512 group_scales512(
    const TileScales<S>& ts, const uint8_t* p, int64_t g) {
  return _mm512_broadcast_f32x4(ts.values(p, g));
}

// x rows a and c's block b in the two 256-bit halves (x0: its first 16 inputs, x1: the last 16);
// returns their scales, a's in the low half.
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"), always_inline)) inline __m512 load_pair(
    const XRow& a, const XRow& c, int64_t b, __m512i& x0, __m512i& x1) {
  x0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + b * QB))),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q + b * QB)), 1);
  x1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + b * QB + 16))),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.q + b * QB + 16)), 1);
  return _mm512_insertf32x8(_mm512_set1_ps(a.scale[b]), _mm256_set1_ps(c.scale[b]), 1);
}

// The 2 * PAIRS rows' hsums (row u of the pass in out[u * RT .. + RT]), then their mins (at
// ``mins``, the tile's end): lane 4u + r of the vectors holds row u's result for weight row r, and
// each group adds min[r, g] * sum(x row u over g) to it, the product and the sum rounded
// separately, in group order: what finish_rows does for one row, 16 (x row, weight row) pairs a vector.
template <typename S, int PAIRS>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) inline void finish_pairs(
    const __m512 (*acc)[RT], const TileScales<S>& ts, const uint8_t* mins, const TileLayout& l, const XRow* x,
    float* out) {
  for (int i = 0; i < PAIRS; ++i) {
    __m256 lo[RT], hi[RT];
    for (int r = 0; r < RT; ++r) {
      lo[r] = _mm512_castps512_ps256(acc[i][r]);
      hi[r] = _mm512_extractf32x8_ps(acc[i][r], 1);
    }
    _mm_storeu_ps(out + (2 * i) * RT, hsum_rows(lo));
    _mm_storeu_ps(out + (2 * i + 1) * RT, hsum_rows(hi));
  }
  if (!l.mins) return;
  if constexpr (PAIRS % 2 == 0) {
    add_pass_mins<S, PAIRS>(ts, mins, l.groups, x[0], out);
  } else {  // a pass of 2 rows: row by row
    for (int u = 0; u < 2 * PAIRS; ++u)
      _mm_storeu_ps(out + u * RT, add_row_mins(ts, mins, l.groups, x[u].group_sums, _mm_loadu_ps(out + u * RT)));
  }
}

// A tile block's RT rows as the AVX-512 passes take them: row r's words in both 256-bit halves
// (tile_interleaved_pairs), or rows 2h and 2h + 1 one per half (tile_interleaved_row512). Int4 and
// int8 unpack rows from their bytes; E2M1 codes are looked up four rows at once, then widened
// from their lanes: the same words.
template <typename Block>
struct TileRows512 {
  const uint8_t* block;
  __attribute__((target("avx512f,avx512bw"), always_inline)) typename Block::Words512 row(int r) const {
    return Block::unpack512(block + r * Block::BYTES);
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) typename Block::Words512 pair(int h) const {
    return Block::unpack512_rows(block + 2 * h * Block::BYTES);
  }
};
template <>
struct TileRows512<E2m1Block> {
  E2m1Block::Looked512 looked;
  __attribute__((target("avx512f,avx512bw"), always_inline)) explicit TileRows512(const uint8_t* block)
      : looked(E2m1Block::look_up512(block)) {}
  __attribute__((target("avx512f,avx512bw"), always_inline)) E2m1Block::Words512 row(int r) const {
    return E2m1Block::row512(looked, r);
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) E2m1Block::Words512 pair(int h) const {
    return E2m1Block::pair512(looked, h);
  }
};

// Pairs of x rows in zmm registers: each 256-bit half of every vector holds one row's ymm
// operands (its x blocks, its scale products, its accumulators) and the weight words fill both
// halves, so one AVX-512 instruction does the two rows' ymm instructions, lane for lane: the same
// bits as tile_interleaved for each row. PAIRS x 2 rows per pass over the tile.
template <typename S, bool ONE_BLOCK, typename Block, int PAIRS>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) void tile_interleaved_pairs(
    const uint8_t* p, const TileLayout& l, const XRow* x, float* out) {
  const int64_t bpg = ONE_BLOCK ? 1 : l.bpg;
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m512 acc[PAIRS][RT];
  for (int i = 0; i < PAIRS; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm512_setzero_ps();
  // vpermilps permutes within 128-bit lanes, as lane() does: index r gives row r's scale product of
  // each half's own x row.
  const __m512i lane_of[RT] = {_mm512_set1_epi32(0), _mm512_set1_epi32(1), _mm512_set1_epi32(2), _mm512_set1_epi32(3)};
  int64_t b = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    const __m512 scales = group_scales512(ts, p, g);
    p += RT * sizeof(S);
    for (int64_t e = 0; e < bpg; ++e, ++b, p += RT * Block::BYTES) {
      prefetch_ahead<Block>(p);
      __m512i x0[PAIRS], x1[PAIRS];
      __m512 sx[PAIRS];
      for (int i = 0; i < PAIRS; ++i) sx[i] = _mm512_mul_ps(scales, load_pair(x[2 * i], x[2 * i + 1], b, x0[i], x1[i]));
      const TileRows512<Block> rows{p};
      for (int r = 0; r < RT; ++r) {
        const typename Block::Words512 w2 = rows.row(r);
        for (int i = 0; i < PAIRS; ++i)
          acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Block::dot512(w2, x0[i], x1[i])),
                                      _mm512_permutevar_ps(sx[i], lane_of[r]), acc[i][r]);
      }
    }
  }
  finish_pairs<S, PAIRS>(acc, ts, p, l, x, out);
}

// One x row against a tile with AVX-512 (decode): weight rows r and r + 1 in the two halves of
// each vector, the x block in both, so one instruction does the two rows' ymm arithmetic of
// tile_interleaved<..., 1>, lane for lane (the scale products picked per half): the same bits.
template <typename S, bool ONE_BLOCK, typename Block>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) void tile_interleaved_row512(
    const uint8_t* p, const TileLayout& l, const XRow* x, float* out) {
  const int64_t bpg = ONE_BLOCK ? 1 : l.bpg;
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m512 acc[RT / 2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i pick[RT / 2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)};
  int64_t b = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    const __m512 scales = group_scales512(ts, p, g);
    p += RT * sizeof(S);
    for (int64_t e = 0; e < bpg; ++e, ++b, p += RT * Block::BYTES) {
      prefetch_ahead<Block>(p);
      const __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + b * QB)));
      const __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + b * QB + 16)));
      const __m512 sx = _mm512_mul_ps(scales, _mm512_set1_ps(x->scale[b]));
      const TileRows512<Block> rows{p};
      for (int h = 0; h < RT / 2; ++h)
        acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Block::dot512(rows.pair(h), x0, x1)), _mm512_permutevar_ps(sx, pick[h]),
                                 acc[h]);
    }
  }
  const __m256 rows[RT] = {_mm512_castps512_ps256(acc[0]), _mm512_extractf32x8_ps(acc[0], 1),
                           _mm512_castps512_ps256(acc[1]), _mm512_extractf32x8_ps(acc[1], 1)};
  finish_rows<S>(ts, l.mins ? p : nullptr, l.groups, x->group_sums, rows, out);
}

// tile_interleaved_pairs for int8 in groups of 16: 2 * PAIRS x rows, each 256-bit half one row's
// ymm arithmetic of tile_interleaved_g16, lane for lane (both halves of a block, each with its scale).
template <typename S, int PAIRS>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) void tile_interleaved_g16_pairs(
    const uint8_t* p, const TileLayout& l, const XRow* x, float* out) {
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m512 acc[PAIRS][RT];
  for (int i = 0; i < PAIRS; ++i)
    for (int r = 0; r < RT; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i lane_of[RT] = {_mm512_set1_epi32(0), _mm512_set1_epi32(1), _mm512_set1_epi32(2), _mm512_set1_epi32(3)};
  for (int64_t b = 0; b < l.groups / 2; ++b) {
    const __m512 first = group_scales512(ts, p, 2 * b);
    const __m512 second = group_scales512(ts, p + RT * sizeof(S), 2 * b + 1);
    p += 2 * RT * sizeof(S);
    prefetch_ahead<Int8Block>(p);
    __m512i x0[PAIRS], x1[PAIRS];
    __m512 s0[PAIRS], s1[PAIRS];
    for (int i = 0; i < PAIRS; ++i) {
      const __m512 xd = load_pair(x[2 * i], x[2 * i + 1], b, x0[i], x1[i]);
      s0[i] = _mm512_mul_ps(first, xd);
      s1[i] = _mm512_mul_ps(second, xd);
    }
    for (int r = 0; r < RT; ++r) {
      const Int8Block::Words512 w = Int8Block::unpack512(p + r * QB);
      for (int i = 0; i < PAIRS; ++i) {
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w.lo, x0[i])),
                                    _mm512_permutevar_ps(s0[i], lane_of[r]), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w.hi, x1[i])),
                                    _mm512_permutevar_ps(s1[i], lane_of[r]), acc[i][r]);
      }
    }
    p += RT * QB;
  }
  finish_pairs<S, PAIRS>(acc, ts, p, l, x, out);
}

// tile_interleaved_row512 for int8 in groups of 16: weight rows r and r + 1 in the two halves, the
// block's halves scaled apart: tile_interleaved_g16<..., 1>'s arithmetic, lane for lane.
template <typename S>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) void tile_interleaved_g16_row512(
    const uint8_t* p, const TileLayout& l, const XRow* x, float* out) {
  const TileScales<S> ts(p, l);
  p += l.groups_offset();
  __m512 acc[RT / 2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i pick[RT / 2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)};
  for (int64_t b = 0; b < l.groups / 2; ++b) {
    const __m512 first = group_scales512(ts, p, 2 * b);
    const __m512 second = group_scales512(ts, p + RT * sizeof(S), 2 * b + 1);
    p += 2 * RT * sizeof(S);
    prefetch_ahead<Int8Block>(p);
    const __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + b * QB)));
    const __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q + b * QB + 16)));
    const __m512 xd = _mm512_set1_ps(x->scale[b]);
    const __m512 s0 = _mm512_mul_ps(first, xd), s1 = _mm512_mul_ps(second, xd);
    for (int h = 0; h < RT / 2; ++h) {
      const Int8Block::Words512 w = Int8Block::unpack512_rows(p + 2 * h * QB);
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w.lo, x0)), _mm512_permutevar_ps(s0, pick[h]), acc[h]);
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w.hi, x1)), _mm512_permutevar_ps(s1, pick[h]), acc[h]);
    }
    p += RT * QB;
  }
  const __m256 rows[RT] = {_mm512_castps512_ps256(acc[0]), _mm512_extractf32x8_ps(acc[0], 1),
                           _mm512_castps512_ps256(acc[1]), _mm512_extractf32x8_ps(acc[1], 1)};
  finish_rows<S>(ts, l.mins ? p : nullptr, l.groups, x->group_sums, rows, out);
}

// Whether `set_isa` lets AVX-512 code run (a cap below avx512 keeps AVX2 or the scalar code, for
// tests and A/B runs).
inline bool avx512_allowed() {
  return g_isa_cap.load(std::memory_order_relaxed) >= static_cast<int>(llk::Isa::kAvx512);
}

// x rows per pass over a tile: 8, 4, then 2, in zmm pairs with AVX-512 (F, VL, BW, DQ), 2 with AVX2's
// 16 registers.
inline bool use_avx512() {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  return avx512 && avx512_allowed();
}

#include "qgemm.h"  // many rows: x rounded per block, integer dot products (VNNI / AVX2 / scalar)

// Measured with benchmarks/kernels/qgemm_micro.py (and an expert's E2M1 tiles) at M = 1 .. 8:
// with AVX512-VNNI the many-row GEMM leads from 2 rows of x for int4 weights and from 3 for int8
// (E2M1 codes by 1.5-2x there; Q8_0, read a byte a weight, about even until 6); with AVX2 alone
// int4 weights from 3, int8 from 8. Below, the int16 passes: bound by the weight stream, they
// read a block once for all the rows.
int64_t qgemm_min_rows(bool int4) {
  const int64_t fixed = g_qgemm_min_rows.load(std::memory_order_relaxed);
  if (fixed > 0) return fixed;
  if (qgemm::variant() == qgemm::Variant::kVnni) return int4 ? 2 : 3;
  return int4 && qgemm::variant() == qgemm::Variant::kAvx2 ? 3 : 8;
}

constexpr int64_t MAX_PASS_ROWS = 8;  // the most x rows a tile variant takes in one pass

template <typename S>
struct TilePick {
  // Passes by x rows, most first, the last of 1: the first that fits the rows left is taken.
  std::array<std::pair<int64_t, InterleavedTileFn<S>>, 4> passes;
  int64_t by_group_from;  // passes of this many rows or more read the rows' group sums by group (add_pass_mins); 0: none
};

template <typename S, bool ONE_BLOCK, typename Block>
struct InterleavedTiles {
  static TilePick<S> pick() {
    if (use_avx512())
      return {{{{8, tile_interleaved_pairs<S, ONE_BLOCK, Block, 4>},
                {4, tile_interleaved_pairs<S, ONE_BLOCK, Block, 2>},
                {2, tile_interleaved_pairs<S, ONE_BLOCK, Block, 1>},
                {1, tile_interleaved_row512<S, ONE_BLOCK, Block>}}},
              4};
    const InterleavedTileFn<S> one = tile_interleaved<S, ONE_BLOCK, Block, 1>;
    return {{{{2, tile_interleaved<S, ONE_BLOCK, Block, 2>}, {1, one}, {1, one}, {1, one}}}, 0};
  }
};

template <typename S>
TilePick<S> pick_g16() {
  if (use_avx512()) {
    const InterleavedTileFn<S> one = tile_interleaved_g16_row512<S>;
    return {{{{4, tile_interleaved_g16_pairs<S, 2>}, {2, tile_interleaved_g16_pairs<S, 1>}, {1, one}, {1, one}}}, 4};
  }
  const InterleavedTileFn<S> one = tile_interleaved_g16<S, 1>;
  return {{{{2, tile_interleaved_g16<S, 2>}, {1, one}, {1, one}, {1, one}}}, 0};
}

template <typename S, typename Block>
TilePick<S> pick_blocks(const TileLayout& l) {
  return l.bpg == 1 ? InterleavedTiles<S, true, Block>::pick() : InterleavedTiles<S, false, Block>::pick();
}

template <typename S>
void interleaved_gemm_as(const QuantizedX& xq, const uint8_t* tiles, int64_t kind, int64_t group, bool mins, int64_t n,
                         float* out) {
  const TileLayout l = tile_layout(xq.k, group, kind, sizeof(S), mins);
  const auto [passes, by_group_from] = l.bpg == 0                ? pick_g16<S>()
                                       : kind == kInt4Weights   ? pick_blocks<S, Int4Block>(l)
                                       : kind == kE2m1Weights   ? pick_blocks<S, E2m1Block>(l)
                                                                 : pick_blocks<S, Int8Block>(l);
  TORCH_INTERNAL_ASSERT(passes[0].first <= MAX_PASS_ROWS);
  const int64_t m = xq.m, nb = xq.k / QB, tile_bytes = l.tile_bytes();
  std::vector<float> xsums(m * l.groups), by_group;
  if (mins) {
    for (int64_t r = 0; r < m; ++r) group_sums(xq, r, group, xsums.data() + r * l.groups);
    if (by_group_from > 0 && m >= by_group_from) {  // the passes read a group's sums of several rows together
      by_group.resize(l.groups * m);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < l.groups; ++g) by_group[g * m + r] = xsums[r * l.groups + g];
    }
  }
  at::parallel_for(0, (n + RT - 1) / RT, 4, [&](int64_t begin, int64_t end) {
    std::array<XRow, MAX_PASS_ROWS> rows_x;
    std::array<float, MAX_PASS_ROWS * RT> y;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = t * RT, rows = std::min(RT, n - j0);
      for (int64_t i = 0; i < m;) {
        size_t p = 0;
        while (passes[p].first > m - i) ++p;
        const auto& [pass, tile] = passes[p];
        for (int64_t u = 0; u < pass; ++u)
          rows_x[u] = XRow{xq.q.data() + (i + u) * xq.k, xq.scale.data() + (i + u) * nb, xsums.data() + (i + u) * l.groups};
        if (by_group_from > 0 && pass >= by_group_from && !by_group.empty())
          rows_x[0].sums_by_group = by_group.data() + i, rows_x[0].stride = m;
        tile(tiles + t * tile_bytes, l, rows_x.data(), y.data());
        for (int64_t u = 0; u < pass; ++u)
          for (int64_t r = 0; r < rows; ++r) out[(i + u) * n + j0 + r] = y[u * RT + r];
        i += pass;
      }
    }
  });
}

// packed_gemm on interleave_tiles' layout; scale_bytes: 4 float32 scales and mins, 2 float16, 1 stepped.
}  // namespace

void llk::quant::interleaved_gemm(const QuantizedX& xq, const uint8_t* tiles, int64_t kind, int64_t scale_bytes,
                                  int64_t group, bool mins, int64_t n, float* out) {
  const bool int4 = kind == kInt4Weights;
  if (xq.x != nullptr && xq.m >= qgemm_min_rows(int4))
    return qgemm::gemm(xq.x, xq.m, xq.k, tiles, kind, scale_bytes, group, mins, n, out);
  if (xq.q.size() != static_cast<size_t>(xq.m * xq.k))  // made at qgemm's sizes, the threshold moved since
    return interleaved_gemm(int16_rows(xq, int4), tiles, kind, scale_bytes, group, mins, n, out);
  if (scale_bytes == 2) interleaved_gemm_as<uint16_t>(xq, tiles, kind, group, mins, n, out);
  else if (scale_bytes == 1) interleaved_gemm_as<int8_t>(xq, tiles, kind, group, mins, n, out);
  else interleaved_gemm_as<float>(xq, tiles, kind, group, mins, n, out);
}

namespace {

// One step's values (``count`` scales or mins of a row) as step * ints, exactly. Each nonzero value
// is an odd integer times a power of two (read off its bits); over the common lowest power, the
// values are integers whose greatest common divisor G gives step = G * 2^low and ints = values /
// step. A GGUF K-quant's d * sc (d float16, sc an integer of at most 8 bits) factors so with
// |ints| <= |sc|.
bool step_values(const float* v, int64_t count, float* step, int8_t* ints) {
  constexpr int64_t MAX_COUNT = STEP / 16;
  uint32_t odd[MAX_COUNT];
  int power[MAX_COUNT];
  int low = INT32_MAX;  // the lowest power of two of any nonzero value
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    const uint32_t exponent = (bits >> 23) & 0xFF, fraction = bits & 0x7FFFFF;
    if (exponent == 0xFF) return false;  // inf, nan
    const uint32_t mantissa = exponent == 0 ? fraction : fraction | 0x800000;  // subnormal: no implicit bit
    if (mantissa == 0) {
      odd[i] = 0;
      continue;
    }
    const int zeros = __builtin_ctz(mantissa);
    odd[i] = mantissa >> zeros;
    power[i] = (exponent == 0 ? -149 : static_cast<int>(exponent) - 150) + zeros;
    low = std::min(low, power[i]);
  }
  if (low == INT32_MAX) {  // all zero
    *step = 0.f;
    std::memset(ints, 0, count);
    return true;
  }
  uint32_t whole[MAX_COUNT], g = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (odd[i] == 0) {
      whole[i] = 0;
      continue;
    }
    if (power[i] - low > 7) return false;  // 2^8 times another value's odd part: no int8 holds both
    whole[i] = odd[i] << (power[i] - low);  // < 2^31
    if (g == 0 || whole[i] % g != 0) g = std::gcd(g, whole[i]);  // mostly a divisor after the first two
  }
  int32_t q[MAX_COUNT];
  int32_t most = 0, least = 0;  // the ints with a positive step; Q6_K's span -128..127 with d of either sign
  for (int64_t i = 0; i < count; ++i) {
    const auto magnitude = whole[i] / g;
    if (magnitude > 128) return false;
    q[i] = v[i] < 0 ? -static_cast<int32_t>(magnitude) : static_cast<int32_t>(magnitude);
    most = std::max(most, q[i]);
    least = std::min(least, q[i]);
  }
  if (most > 127 && least < -127) return false;
  const int32_t sign = most > 127 ? -1 : 1;
  const float s = std::ldexp(static_cast<float>(sign) * static_cast<float>(g), low);
  for (int64_t i = 0; i < count; ++i) {
    if (static_cast<float>(sign * q[i]) * s != v[i]) return false;
    ints[i] = static_cast<int8_t>(sign * q[i]);
  }
  *step = s;
  return true;
}

}  // namespace

namespace llk::quant {

c10::optional<std::tuple<at::Tensor, at::Tensor>> step_scales(const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.is_contiguous(),
              "scales: contiguous float32 [n, k / group]");
  TORCH_CHECK(group >= 16 && STEP % group == 0, "group must be 16 or more and divide ", STEP);
  const int64_t n = scales.size(0), groups = scales.size(1), per_step = STEP / group;
  if (groups % per_step != 0) return c10::nullopt;
  auto ints = at::empty({n, groups}, at::kChar);
  auto steps = at::empty({n, groups / per_step}, at::kFloat);
  const float* v = scales.data_ptr<float>();
  int8_t* q = ints.data_ptr<int8_t>();
  float* st = steps.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, n * (groups / per_step), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && ok.load(std::memory_order_relaxed); ++i)
      if (!step_values(v + i * per_step, per_step, st + i, q + i * per_step)) ok = false;
  });
  if (!ok) return c10::nullopt;
  return std::make_tuple(ints, steps);
}

// kE2m1Values' first code of each int8 value (-1: none), by value + 128.
static const std::array<int8_t, 256>& e2m1_index() {
  static const std::array<int8_t, 256> index = [] {
    std::array<int8_t, 256> codes;
    codes.fill(-1);
    for (int c = 15; c >= 0; --c) codes[kE2m1Values[c] + 128] = static_cast<int8_t>(c);
    return codes;
  }();
  return index;
}

bool e2m1_codes(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight: contiguous int8");
  const std::array<int8_t, 256>& index = e2m1_index();
  const auto* q = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  std::atomic<bool> all{true};
  at::parallel_for(0, qweight.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && all.load(std::memory_order_relaxed); ++i)
      if (index[q[i] ^ 0x80] < 0) all.store(false, std::memory_order_relaxed);
  });
  return all.load();
}

// A packed int4 (uint8 [n, k / 2]) or int8 (int8 [n, k]) weight with its scales (and mins) [n, k /
// group] in the interleaved layout (uint8, flat): float32 or float16, or int8 with their float32
// steps [n, k / STEP] (step_scales; both or neither for the mins). Group: a multiple of 32, or 16
// for int8. e2m1: an int8 weight's blocks as kE2m1Values codes (each value must have one).
at::Tensor interleave_tiles(const at::Tensor& qweight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, int64_t group,
                               const c10::optional<at::Tensor>& scale_steps, const c10::optional<at::Tensor>& min_steps,
                               bool e2m1) {
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(!e2m1 || !int4, "E2M1 codes: an int8 weight");
  TORCH_CHECK((int4 || qweight.scalar_type() == at::kChar) && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight: contiguous uint8 (int4) or int8 [n, packed k]");
  const int64_t n = qweight.size(0), row_bytes = qweight.size(1), k = int4 ? 2 * row_bytes : row_bytes;
  TORCH_CHECK(((group % QB == 0) || (group == 16 && !int4)) && k % group == 0 && k % QB == 0,
              "interleaved tiles need a group that is a multiple of 32 (or int8's 16) dividing K");
  const bool stepped = scales.scalar_type() == at::kChar;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf || stepped) &&
                  scales.is_contiguous() && scales.numel() == n * (k / group),
              "scales: contiguous float32, float16 or int8 (stepped) [n, k / group]");
  TORCH_CHECK(!mins.has_value() || (mins->scalar_type() == scales.scalar_type() && mins->is_contiguous() &&
                                    mins->numel() == scales.numel()), "mins: like the scales");
  const auto steps_fit = [&](const c10::optional<at::Tensor>& t) {
    return t.has_value() && t->scalar_type() == at::kFloat && t->is_contiguous() && k % STEP == 0 &&
           STEP % group == 0 && t->numel() == n * (k / STEP);
  };
  TORCH_CHECK(stepped ? steps_fit(scale_steps) && (!mins.has_value() || steps_fit(min_steps))
                      : !scale_steps.has_value() && !min_steps.has_value(),
              "int8 scales (and mins) come with their float32 steps [n, k / ", STEP, "], others without");
  const int64_t sb = scales.element_size();
  const TileLayout l = tile_layout(k, group, e2m1 ? kE2m1Weights : int4 ? kInt4Weights : kInt8Weights, sb,
                                   mins.has_value());
  const int64_t tiles = (n + RT - 1) / RT, tile_bytes = l.tile_bytes(), bb = l.block_bytes;
  const int64_t src_bb = e2m1 ? QB : bb;  // a block's bytes in qweight
  auto out = at::zeros({tiles * tile_bytes}, at::kByte);
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint8_t* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const std::array<int8_t, 256>& index = e2m1_index();
  const auto put_block = [&](uint8_t* to, const uint8_t* from) {
    if (!e2m1) return static_cast<void>(std::memcpy(to, from, bb));
    for (int64_t i = 0; i < QB / 2; ++i) {
      const int8_t first = index[from[i] ^ 0x80], second = index[from[i + QB / 2] ^ 0x80];
      TORCH_CHECK(first >= 0 && second >= 0, "E2M1 codes: an int8 weight whose every value has one");
      to[i] = static_cast<uint8_t>(first | second << 4);
    }
  };
  const uint8_t* s = static_cast<const uint8_t*>(scales.data_ptr());
  const uint8_t* mn = mins.has_value() ? static_cast<const uint8_t*>(mins->data_ptr()) : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    uint8_t* tile = dst + (j / RT) * tile_bytes;
    const int64_t r = j % RT;
    for (int64_t g = 0; g < l.groups; ++g) {
      if (l.bpg == 0) {  // group 16: a block's two groups' scales, then its bytes
        uint8_t* block_start = tile + l.groups_offset() + (g / 2) * 2 * l.group_bytes();
        std::memcpy(block_start + ((g % 2) * RT + r) * sb, s + (j * l.groups + g) * sb, sb);
        if (g % 2 == 0) put_block(block_start + 2 * RT * sb + r * bb, q + j * row_bytes + (g / 2) * src_bb);
      } else {
        uint8_t* group_start = tile + l.groups_offset() + g * l.group_bytes();
        std::memcpy(group_start + r * sb, s + (j * l.groups + g) * sb, sb);
        for (int64_t e = 0; e < l.bpg; ++e)
          put_block(group_start + RT * sb + (e * RT + r) * bb, q + j * row_bytes + (g * l.bpg + e) * src_bb);
      }
      if (mn != nullptr) std::memcpy(tile + l.mins_offset() + (g * RT + r) * sb, mn + (j * l.groups + g) * sb, sb);
    }
    for (int64_t t = 0; t < l.steps(); ++t) {
      float* steps = reinterpret_cast<float*>(tile);
      steps[t * RT + r] = scale_steps->data_ptr<float>()[j * l.steps() + t];
      if (mn != nullptr) steps[(l.steps() + t) * RT + r] = min_steps->data_ptr<float>()[j * l.steps() + t];
    }
  }
  return out;
}

// x [M, K] @ W^T -> [M, n] for W in interleave_tiles' layout (the integer path of int4/int8_linear).
at::Tensor interleaved_linear(const at::Tensor& x_in, const at::Tensor& tiles, int64_t kind, int64_t n,
                                 int64_t group, int64_t scale_bytes, bool mins) {
  const bool int4 = kind == kInt4Weights;
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  const int64_t k = x_in.size(1);
  TORCH_CHECK(((group % QB == 0) || (group == 16 && !int4)) && k % group == 0 && k % QB == 0,
              "group must be a multiple of 32 (or int8's 16) dividing K");
  const TileLayout l = tile_layout(k, group, kind, scale_bytes, mins);
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.numel() == (n + RT - 1) / RT * l.tile_bytes(), "tiles do not match n, K and the group");
  const auto x = x_in.to(at::kFloat).contiguous();
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), x.size(0), k, /*nibble_order=*/int4);
  auto out = at::empty({x.size(0), n}, x.options());
  interleaved_gemm(xq, tiles.data_ptr<uint8_t>(), kind, scale_bytes, group, mins, n, out.data_ptr<float>());
  return out.to(x_in.scalar_type());
}
}  // namespace llk::quant

namespace {

#include "int8_gemm.h"  // per-channel int8: per-token int16 activations, exact int32/int64 sums

// ---- dequantized slabs for prefill --------------------------------------------------------------
void dequant_int4_rows(const uint8_t* q, const float* s, const float* mn, int64_t group, int64_t k, float* dst) {
  for (int64_t g = 0; g < k / group; ++g) {
    const float sg = s[g], mg = mn[g];
    const uint8_t* qg = q + g * group / 2;
    float* d = dst + g * group;
#pragma omp simd
    for (int64_t j = 0; j < group / 2; ++j) {
      d[2 * j] = sg * static_cast<float>(qg[j] & 0x0F) + mg;
      d[2 * j + 1] = sg * static_cast<float>(qg[j] >> 4) + mg;
    }
  }
}

void dequant_int8_rows(const int8_t* q, const float* s, const float* mn, int64_t group, int64_t k, float* dst) {
  for (int64_t g = 0; g < k / group; ++g) {
    const float sg = s[g], mg = mn ? mn[g] : 0.f;
#pragma omp simd
    for (int64_t j = g * group; j < (g + 1) * group; ++j) dst[j] = sg * static_cast<float>(q[j]) + mg;
  }
}

float fp8_value(uint8_t b) {
  const int e = (b >> 3) & 0x0F, mant = b & 0x07;
  const float v = e == 0 ? std::ldexp(static_cast<float>(mant), -9) : std::ldexp(1.f + mant / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

// y = x @ W^T with W dequantized SLAB rows at a time (the weight is never whole in fp32).
template <typename Dequant>
at::Tensor slab_gemm(const at::Tensor& x, int64_t n, int64_t k, Dequant dequant) {
  constexpr int64_t SLAB = 256;
  auto out = at::empty({x.size(0), n}, x.options());
  auto w = at::empty({std::min(SLAB, n), k}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += SLAB) {
    const int64_t rows = std::min(SLAB, n - n0);
    float* dst = w.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) dequant(n0 + j, dst + j * k);
    });
    out.narrow(1, n0, rows).copy_(at::mm(x, w.narrow(0, 0, rows).t()));
  }
  return out;
}

void check_weight(const at::Tensor& x, const at::Tensor& scales, int64_t k_from_weight) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_from_weight, "x must be [M, ", k_from_weight, "]");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              "scales must be contiguous float32 (or float16 for int4/int8)");
}

}  // namespace

namespace llk::quant {

void int8_per_channel_linear(const float* x, int64_t m, int64_t k, const int8_t* w, const at::Tensor& scales,
                             int64_t n, float* out) {
  int8g::linear(x, m, k, w, scales, n, out);
}

std::string set_isa(const std::string& name) {
  llk::Isa level;
  TORCH_CHECK(llk::parse_isa(name, &level), "unknown or not compiled ISA level: ", name);
  g_isa_cap.store(static_cast<int>(level), std::memory_order_relaxed);
  return name;
}

int64_t set_qgemm_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "qgemm_min_rows must be 0 (the default per kind) or at least 1");
  return g_qgemm_min_rows.exchange(rows);
}

std::string isa() {
  if (g_isa_cap.load(std::memory_order_relaxed) == static_cast<int>(llk::Isa::kGeneric)) return "avx2, scalar int8";
  return use_avx512() ? "avx512" : "avx2";
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t group, bool int_path) {
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2;
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(group % QB == 0 && k % group == 0, "int4 group must be a multiple of 32 dividing K");
  TORCH_CHECK(mins.is_contiguous(), "mins must be contiguous");
  const auto x = x_in.to(at::kFloat).contiguous();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const int64_t groups = k / group;
  at::Tensor out;
  if (int_path) {
    const QuantizedX xq = quantize_x(x.data_ptr<float>(), x.size(0), k, /*nibble_order=*/true);
    out = at::empty({x.size(0), n}, x.options());
    packed_gemm(xq, q, /*int4=*/true, scales, mins, group, n, out.data_ptr<float>());
  } else {
    const auto scales32 = scales.to(at::kFloat), mins32 = mins.to(at::kFloat);
    const float *s = scales32.data_ptr<float>(), *mn = mins32.data_ptr<float>();
    out = slab_gemm(x, n, k, [&](int64_t j, float* dst) {
      dequant_int4_rows(q + j * (k / 2), s + j * groups, mn + j * groups, group, k, dst);
    });
  }
  return out.to(x_in.scalar_type());
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, int64_t group, bool int_path) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "qweight must be contiguous int8");
  TORCH_CHECK(k % QB == 0 && (group == 16 || group % QB == 0) && k % group == 0,
              "int8 group must be 16 or a multiple of 32 dividing K");
  TORCH_CHECK(!mins.has_value() || mins->is_contiguous(), "mins must be contiguous");
  const auto x = x_in.to(at::kFloat).contiguous();
  const int8_t* q = qweight.data_ptr<int8_t>();
  const int64_t groups = k / group;
  at::Tensor out;
  if (int_path && int8g::per_channel(group, k, mins.has_value())) {
    out = at::empty({x.size(0), n}, x.options());
    int8g::linear(x.data_ptr<float>(), x.size(0), k, q, scales, n, out.data_ptr<float>());
  } else if (int_path) {
    const QuantizedX xq = quantize_x(x.data_ptr<float>(), x.size(0), k, /*nibble_order=*/false);
    out = at::empty({x.size(0), n}, x.options());
    packed_gemm(xq, reinterpret_cast<const uint8_t*>(q), /*int4=*/false, scales, mins.value_or(at::Tensor()), group,
                n, out.data_ptr<float>());
  } else {
    const auto scales32 = scales.to(at::kFloat);
    const auto mins32 = mins.has_value() ? mins->to(at::kFloat) : at::Tensor();
    const float* s = scales32.data_ptr<float>();
    const float* mn = mins32.defined() ? mins32.data_ptr<float>() : nullptr;
    out = slab_gemm(x, n, k, [&](int64_t j, float* dst) {
      dequant_int8_rows(q + j * k, s + j * groups, mn ? mn + j * groups : nullptr, group, k, dst);
    });
  }
  return out.to(x_in.scalar_type());
}

at::Tensor fp8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                         bool direct) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(k % 16 == 0, "fp8 kernel needs K divisible by 16");
  const auto x = x_in.to(at::kFloat).contiguous();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t m = x.size(0);
  at::Tensor out;
  if (direct) {
    out = at::empty({m, n}, x.options());
    const float* xp = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      float acc[MT];
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t m0 = 0; m0 < m; m0 += MT) {
          const int64_t rows = std::min(MT, m - m0);
          fp8_row_avx2(q + j * k, xp + m0 * k, k, rows, acc);
          for (int64_t i = 0; i < rows; ++i) o[(m0 + i) * n + j] = acc[i] * (s[j] * 256.f);
        }
      }
    });
  } else {
    float table[256];
    for (int b = 0; b < 256; ++b) table[b] = fp8_value(static_cast<uint8_t>(b));
    out = slab_gemm(x, n, k, [&](int64_t j, float* dst) {
      for (int64_t i = 0; i < k; ++i) dst[i] = table[q[j * k + i]] * s[j];
    });
  }
  return out.to(x_in.scalar_type());
}

}  // namespace llk::quant
