// Quantized linear kernels for CPUs: y[m, n] = sum_k x[m, k] * w[n, k], with w in one of the packed
// formats of llmctl/layers/quantization/formats.py, read straight from the packed bytes (no float
// copy of the weight is made; the prefill path dequantizes one slab of rows at a time).
//
// Decode (few rows of x) is memory-bound: every weight byte is read once per step, so the kernels
// stream the packed rows and do the arithmetic in integers, like llama.cpp:
// - int4 and int8 weights: the activations are quantized per row and per block of 32 inputs, to
//   int16 for int4 weights (scale = max|x| / 32767) and to int8 for int8 weights (max|x| / 127),
//   round to nearest even; each 32-input block is one integer dot product (int4: nibbles widened
//   to s16, madd -> s32; int8: u8 x s8 -> s16 pairs -> s32, AVX2 maddubs/madd, AVX512-VNNI
//   dpbusd), scaled in float by weight-scale x activation-scale. An asymmetric weight's min adds
//   min * sum(x over the group), with the exact float sum of x.
// - fp8 (e4m3fn) weights: bytes become fp16 by moving the bit fields ((b & 0x80) << 8 | (b & 0x7f) << 7
//   is the same number times 2^-8, subnormals included), F16C converts to fp32, fp32 FMAs with x.
// Prefill (many rows) is compute-bound. fp8 then dequantizes a slab of weight rows to fp32 and
// multiplies it with at::mm (torch's BLAS), which re-uses each weight across all rows of x. int4 and
// int8 keep the integer path at every M, so that a row's result never depends on the batch it is in
// (batched == unbatched); their slab path, with exact float activations, is there on request.
//
// ISA: the AVX2+FMA+F16C code is the baseline; an AVX-512 (BW/VL + VNNI) variant of the int8 dot
// products is compiled with target attributes and chosen at run time by __builtin_cpu_supports.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if !defined(__x86_64__)
#error "the quantized CPU kernels need x86-64 (AVX2); other CPUs use the torch reference"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t QB = 32;  // activation quantization block (inputs)
constexpr int64_t MT = 4;   // rows of x that share one pass over a weight row

// ---- dynamic int8 activations ----------------------------------------------------------------
struct QuantizedX {
  int64_t m, k;
  std::vector<int8_t> q;     // [M, K] int8 (int8 weights), or empty
  std::vector<int16_t> q16;  // [M, K] int16 (int4 weights; each 32-block permuted to (even k..., odd k...)), or empty
  std::vector<float> scale;  // [M, K / 32]
  std::vector<float> sum16;  // [M, K / 16] exact float sums of x (natural order), for the mins
};

// wide: int16 activations (scale = max|x| / 32767), for int4 weights; else int8 (max|x| / 127).
QuantizedX quantize_x(const float* x, int64_t m, int64_t k, bool wide) {
  QuantizedX r{m, k, std::vector<int8_t>(wide ? 0 : m * k), std::vector<int16_t>(wide ? m * k : 0),
               std::vector<float>(m * k / QB), std::vector<float>(m * k / 16)};
  const float levels = wide ? 32767.f : 127.f;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < k / QB; ++b) {
        const float* xb = x + i * k + b * QB;
        float amax = 0.f, s0 = 0.f, s1 = 0.f;
        for (int j = 0; j < QB; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
        for (int j = 0; j < 16; ++j) s0 += xb[j];
        for (int j = 16; j < QB; ++j) s1 += xb[j];
        const float d = amax / levels, inv = amax > 0.f ? levels / amax : 0.f;
        r.scale[i * (k / QB) + b] = d;
        r.sum16[i * (k / 16) + 2 * b] = s0;
        r.sum16[i * (k / 16) + 2 * b + 1] = s1;
        for (int j = 0; j < QB; ++j) {
          if (wide) {
            const int src = j < 16 ? 2 * j : 2 * (j - 16) + 1;
            r.q16[i * k + b * QB + j] = static_cast<int16_t>(std::nearbyint(xb[src] * inv));
          } else {
            r.q[i * k + b * QB + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
          }
        }
      }
    }
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
constexpr int64_t RT = 4;

// One x row's quantized blocks, their scales and its exact group sums (for the mins).
struct XRow {
  const int8_t* q;
  const int16_t* q16;
  const float* scale;
  const float* group_sums;
};

using TileFn = void (*)(const uint8_t*, int64_t, const float*, const float*, int64_t, int64_t, XRow, float*);

template <int R>
__attribute__((target("avx2,fma"))) inline void add_mins(const float* mins, int64_t groups, const float* xs,
                                                         const __m256* acc, float* out) {
  float y[R];
  for (int r = 0; r < R; ++r) y[r] = hsum256(acc[r]);
  if (mins != nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int r = 0; r < R; ++r) y[r] += mins[r * groups + g] * xs[g];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = y[r];
}

// int4 weights against int16 activations: nibbles widened to 16 bits, madd with x (even inputs
// against the low nibbles, odd against the high), exact int32 sums (|sum| < 32 * 15 * 32767 < 2^24,
// so the float conversion is exact too). int8 activations cost ~1.4 % perplexity on SmolLM2 (the
// down projection's input has large outliers in a block); int16 makes the rounding negligible for
// about one more instruction per block.
template <int R>
__attribute__((target("avx2,fma"))) void int4_tile_avx2(const uint8_t* w, int64_t row_bytes, const float* scales,
                                                        const float* mins, int64_t groups, int64_t bpg, XRow x,
                                                        float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q16 + b * QB));
      const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q16 + b * QB + 16));
      const float xd = x.scale[b];
      for (int r = 0; r < R; ++r) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + b * 16));
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, xe), _mm256_madd_epi16(hi, xo));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scales[r * groups + g] * xd), acc[r]);
      }
    }
  }
  add_mins<R>(mins, groups, x.group_sums, acc, out);
}

template <int R>
__attribute__((target("avx2,fma"))) void int8_tile_avx2(const uint8_t* w_bytes, int64_t row_bytes,
                                                        const float* scales, const float* mins, int64_t groups,
                                                        int64_t bpg, XRow x, float* out) {
  const int8_t* w = reinterpret_cast<const int8_t*>(w_bytes);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  auto block = [&](int64_t b, auto weight_scale) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QB));
    const __m256 xd = _mm256_set1_ps(x.scale[b]);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + b * QB));
      const __m256i dot =
          _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(weight_scale(r), xd), acc[r]);
    }
  };
  if (bpg == 0) {  // group 16: int32 lanes 0-3 hold inputs 0..15 of the block, lanes 4-7 inputs 16..31
    for (int64_t b = 0; b < groups / 2; ++b) {
      block(b, [&](int r) {
        const float* s = scales + r * groups + 2 * b;
        return _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0]));
      });
    }
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        block(b, [&](int r) { return _mm256_set1_ps(scales[r * groups + g]); });
      }
    }
  }
  add_mins<R>(mins, groups, x.group_sums, acc, out);
}

// out[m, n] for every n: tiles of RT weight rows in parallel, each against every row of x while the
// tile's bytes are in L1.
void tiled_gemm(const QuantizedX& xq, const uint8_t* w, int64_t row_bytes, const float* scales, const float* mins,
                int64_t group, int64_t n, const TileFn* tile_fns, float* out) {
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
        const XRow x{xq.q.data() + (xq.q.empty() ? 0 : i * xq.k), xq.q16.data() + (xq.q16.empty() ? 0 : i * xq.k), xq.scale.data() + i * nb, xsums.data() + i * groups};
        tile_fns[rows](w + j0 * row_bytes, row_bytes, scales + j0 * groups, mins ? mins + j0 * groups : nullptr,
                       groups, bpg, x, y);
        for (int64_t r = 0; r < rows; ++r) out[i * n + j0 + r] = y[r];
      }
    }
  });
}

// ---- AVX-512 (BW + VL + VNNI) ------------------------------------------------------------------
#define LLMCTL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

// Two 32-input blocks per step: int32 lanes 0-7 belong to block b, lanes 8-15 to block b + 1.
LLMCTL_AVX512 inline __m512 pair_scales(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

LLMCTL_AVX512 void int8_row_avx512(const int8_t* w, const float* scales, int64_t group, const QuantizedX& xq,
                                   int64_t m0, int64_t rows, float* acc) {
  const int64_t nb = xq.k / QB;
  __m512 a[MT];
  __m256 tail[MT];
  for (int i = 0; i < MT; ++i) a[i] = _mm512_setzero_ps(), tail[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i wv = _mm512_loadu_si512(w + b * QB);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    const __m512i wabs = _mm512_abs_epi8(wv);  // -128 -> 0x80 = 128 as u8
    // int32 lane j covers inputs 4j..4j+3 of the 64: groups of 16 inputs are 4 lanes wide
    __m512 ws;
    if (group == 16) {
      ws = _mm512_set_ps(scales[2 * b + 3], scales[2 * b + 3], scales[2 * b + 3], scales[2 * b + 3],
                         scales[2 * b + 2], scales[2 * b + 2], scales[2 * b + 2], scales[2 * b + 2],
                         scales[2 * b + 1], scales[2 * b + 1], scales[2 * b + 1], scales[2 * b + 1],
                         scales[2 * b], scales[2 * b], scales[2 * b], scales[2 * b]);
    } else {
      ws = pair_scales(scales[b * QB / group], scales[(b + 1) * QB / group]);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = m0 + i;
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + r * xq.k + b * QB);
      const __m512i xs = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);  // x * sign(w)
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, xs);
      const __m512 xd = pair_scales(xq.scale[r * nb + b], xq.scale[r * nb + b + 1]);
      a[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, xd), a[i]);
    }
  }
  for (; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * QB));
    const __m256i wabs = _mm256_abs_epi8(wv);
    const __m256 ws = group == 16 ? _mm256_set_m128(_mm_set1_ps(scales[2 * b + 1]), _mm_set1_ps(scales[2 * b]))
                                  : _mm256_set1_ps(scales[b * QB / group]);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = m0 + i;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * xq.k + b * QB));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(xv, wv));
      tail[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(xq.scale[r * nb + b])),
                                tail[i]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_reduce_add_ps(a[i]) + hsum256(tail[i]);
}

// ---- dispatch ---------------------------------------------------------------------------------
enum class Isa { avx2, avx512_vnni };

Isa detect_isa() {
  __builtin_cpu_init();
  const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                    __builtin_cpu_supports("avx512vnni");
  return vnni ? Isa::avx512_vnni : Isa::avx2;
}

Isa g_isa = detect_isa();

using IntRowFn = void (*)(const void*, const float*, int64_t, const QuantizedX&, int64_t, int64_t, float*);

template <typename T, void (*F)(const T*, const float*, int64_t, const QuantizedX&, int64_t, int64_t, float*)>
void erase(const void* w, const float* s, int64_t g, const QuantizedX& x, int64_t m0, int64_t rows, float* acc) {
  F(static_cast<const T*>(w), s, g, x, m0, rows, acc);
}

// out[m, n] for every n in parallel: row_fn(weight row n) gives the integer-path dot products.
void int_gemm(const QuantizedX& xq, const uint8_t* w, int64_t row_bytes, const float* scales, const float* mins,
              int64_t group, int64_t n, IntRowFn row_fn, float* out) {
  const int64_t m = xq.m, groups = xq.k / group;
  std::vector<float> xsums;
  if (mins != nullptr) {
    xsums.resize(m * groups);
    for (int64_t r = 0; r < m; ++r) group_sums(xq, r, group, xsums.data() + r * groups);
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float acc[MT];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t m0 = 0; m0 < m; m0 += MT) {
        const int64_t rows = std::min(MT, m - m0);
        row_fn(w + j * row_bytes, scales + j * groups, group, xq, m0, rows, acc);
        for (int64_t i = 0; i < rows; ++i) {
          float y = acc[i];
          if (mins != nullptr) {
            const float* mn = mins + j * groups;
            const float* xs = xsums.data() + (m0 + i) * groups;
            for (int64_t g = 0; g < groups; ++g) y += mn[g] * xs[g];
          }
          out[(m0 + i) * n + j] = y;
        }
      }
    }
  });
}

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
torch::Tensor slab_gemm(const torch::Tensor& x, int64_t n, int64_t k, Dequant dequant) {
  constexpr int64_t SLAB = 256;
  auto out = torch::empty({x.size(0), n}, x.options());
  auto w = torch::empty({std::min(SLAB, n), k}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += SLAB) {
    const int64_t rows = std::min(SLAB, n - n0);
    float* dst = w.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) dequant(n0 + j, dst + j * k);
    });
    out.narrow(1, n0, rows).copy_(torch::mm(x, w.narrow(0, 0, rows).t()));
  }
  return out;
}

void check_weight(const torch::Tensor& x, const torch::Tensor& scales, int64_t k_from_weight) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k_from_weight, "x must be [M, ", k_from_weight, "]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous(), "scales must be contiguous float32");
}

torch::Tensor int4_linear(const torch::Tensor& x_in, const torch::Tensor& qweight, const torch::Tensor& scales,
                          const torch::Tensor& mins, int64_t group, bool int_path) {
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2;
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(group % QB == 0 && k % group == 0, "int4 group must be a multiple of 32 dividing K");
  const auto x = x_in.to(torch::kFloat).contiguous();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float *s = scales.data_ptr<float>(), *mn = mins.data_ptr<float>();
  const int64_t groups = k / group;
  torch::Tensor out;
  if (int_path) {
    // every ISA: the int16-activation AVX2 tiles (AVX-512 would not make this memory-bound loop faster)
    const QuantizedX xq = quantize_x(x.data_ptr<float>(), x.size(0), k, /*wide=*/true);
    out = torch::empty({x.size(0), n}, x.options());
    static constexpr TileFn tiles[] = {nullptr, int4_tile_avx2<1>, int4_tile_avx2<2>, int4_tile_avx2<3>,
                                       int4_tile_avx2<4>};
    tiled_gemm(xq, q, k / 2, s, mn, group, n, tiles, out.data_ptr<float>());
  } else {
    out = slab_gemm(x, n, k, [&](int64_t j, float* dst) {
      dequant_int4_rows(q + j * (k / 2), s + j * groups, mn + j * groups, group, k, dst);
    });
  }
  return out.to(x_in.scalar_type());
}

torch::Tensor int8_linear(const torch::Tensor& x_in, const torch::Tensor& qweight, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& mins, int64_t group, bool int_path) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == torch::kChar && qweight.is_contiguous(), "qweight must be contiguous int8");
  TORCH_CHECK(k % QB == 0 && (group == 16 || group % QB == 0) && k % group == 0,
              "int8 group must be 16 or a multiple of 32 dividing K");
  const auto x = x_in.to(torch::kFloat).contiguous();
  const int8_t* q = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  const int64_t groups = k / group;
  torch::Tensor out;
  if (int_path) {
    const QuantizedX xq = quantize_x(x.data_ptr<float>(), x.size(0), k, /*wide=*/false);
    out = torch::empty({x.size(0), n}, x.options());
    const auto* w = reinterpret_cast<const uint8_t*>(q);
    if (g_isa == Isa::avx512_vnni) {
      int_gemm(xq, w, k, s, mn, group, n, erase<int8_t, int8_row_avx512>, out.data_ptr<float>());
    } else {
      static constexpr TileFn tiles[] = {nullptr, int8_tile_avx2<1>, int8_tile_avx2<2>, int8_tile_avx2<3>,
                                         int8_tile_avx2<4>};
      tiled_gemm(xq, w, k, s, mn, group, n, tiles, out.data_ptr<float>());
    }
  } else {
    out = slab_gemm(x, n, k, [&](int64_t j, float* dst) {
      dequant_int8_rows(q + j * k, s + j * groups, mn ? mn + j * groups : nullptr, group, k, dst);
    });
  }
  return out.to(x_in.scalar_type());
}

torch::Tensor fp8_linear(const torch::Tensor& x_in, const torch::Tensor& qweight, const torch::Tensor& scales,
                         bool direct) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  check_weight(x_in, scales, k);
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  TORCH_CHECK(k % 16 == 0, "fp8 kernel needs K divisible by 16");
  const auto x = x_in.to(torch::kFloat).contiguous();
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t m = x.size(0);
  torch::Tensor out;
  if (direct) {
    out = torch::empty({m, n}, x.options());
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

std::string isa_name() { return g_isa == Isa::avx512_vnni ? "avx512_vnni" : "avx2"; }

// Tests force each available path in turn; "avx512_vnni" only where the CPU has it.
void set_isa(const std::string& name) {
  if (name == "avx2") {
    g_isa = Isa::avx2;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(detect_isa() == Isa::avx512_vnni, "this CPU lacks AVX512-VNNI");
    g_isa = Isa::avx512_vnni;
  } else {
    TORCH_CHECK(false, "unknown ISA ", name);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "x @ dequant(int4)^T from the packed nibbles");
  m.def("int8_linear", &int8_linear, "x @ dequant(int8)^T from the packed bytes");
  m.def("fp8_linear", &fp8_linear, "x @ dequant(fp8 e4m3)^T from the packed bytes");
  m.def("isa", &isa_name, "the instruction set the int4/int8 dot products use");
  m.def("best_isa", [] { return detect_isa() == Isa::avx512_vnni ? std::string("avx512_vnni") : std::string("avx2"); });
  m.def("set_isa", &set_isa, "force an instruction set (tests)");
}
