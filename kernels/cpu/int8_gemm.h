// Per-output-channel int8 weights (one scale per weight row, group == K) against activations
// quantized PER TOKEN to int16 (scale = max|x row| / 32767, round half to even): the whole dot
// product of a row of x and a row of w is one exact integer S, so
//     out[m, n] = float(S) * (x_scale[m] * w_scale[n])
// with one float conversion per output. Why: a batched step (prefill, 64-way decode) is compute
// bound, and vpmaddwd does 16 int16 multiply-adds per instruction, two per cycle on Zen 3, where an
// fp32 FMA does 8; the integer sum also needs no float scaling per block. Because S is exact, a
// row's result depends neither on M nor on the tile, the thread or the code path (AVX2 or the
// scalar variant): batched == unbatched by construction.
//
// Overflow: each int32 lane of an accumulator sums K / 8 products of |w| <= 128 and |x| <= 32767;
// two lanes together stay under 2^31 for K <= KC = 2048, so the flush adds lane pairs in int32,
// then goes on in int64; longer rows flush every KC inputs. S converts to float through double
// (exact below 2^53, then one rounding).
//
// Included by quant_kernels.cpp inside its namespace (and so also compiled into decode_loop.cpp);
// relies on the headers that file includes. kernels/quant_linear.py ``int_path_reference`` is the
// torch statement of the same arithmetic, bit for bit.

namespace int8g {

constexpr int64_t KC = 2048;        // inputs per int32 accumulation before a flush into int64
// Register tile: MR rows of x x NR rows of w = 12 int32 accumulators, 2 widened weight vectors, one
// x vector, one product: all 16 ymm registers. Each k step widens 2 weight vectors for 12 madd/add
// pairs. Smaller edge tiles (rows or columns left over) use the intrinsics version.
constexpr int64_t MR = 6, NR = 2;
constexpr int64_t PANEL_BYTES = 128 << 10;  // weight rows per pass over x: they stay in L2 while x streams

// x [m, k] rounded per row to int16, with the row's scale.
struct TokenX {
  int64_t m, k;
  std::vector<int16_t> q;    // [m, k]
  std::vector<float> scale;  // [m]
};

// The scalar variant (LLMCTL_CPU_ISA=generic): the same integers, summed in int64.
inline bool use_generic() {
  static const bool generic = [] {
    const char* isa = std::getenv("LLMCTL_CPU_ISA");
    return isa != nullptr && std::string(isa) == "generic";
  }();
  return generic;
}

__attribute__((target("avx2"))) inline void round_row_avx2(const float* x, int64_t k, float inv, int16_t* q) {
  const __m256 s = _mm256_set1_ps(inv);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {  // cvtps rounds half to even (the default MXCSR mode), as nearbyint
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j), s));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8), s));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // |v| <= 32767: no saturation
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), packed);
  }
  for (; j < k; ++j) q[j] = static_cast<int16_t>(std::nearbyint(x[j] * inv));
}

inline TokenX quantize_tokens(const float* x, int64_t m, int64_t k) {
  TokenX r{m, k, std::vector<int16_t>(m * k), std::vector<float>(m)};
  const bool generic = use_generic();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = x + i * k;
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::fmax(amax, std::fabs(xr[j]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      r.scale[i] = amax / 32767.f;
      int16_t* q = r.q.data() + i * k;
      if (generic) {
        for (int64_t j = 0; j < k; ++j) q[j] = static_cast<int16_t>(std::nearbyint(xr[j] * inv));
      } else {
        round_row_avx2(xr, k, inv, q);
      }
    }
  });
  return r;
}

// The exact sums S[i][j] = sum_k x[i, k] * w[j, k] of an R x C tile (R <= MR, C <= NR rows), k a
// multiple of 16. Each k step widens C weight vectors once and uses them for all R rows of x.
template <int R, int C>
__attribute__((target("avx2"))) void tile_sums_avx2(const int16_t* x, const int8_t* w, int64_t k,
                                                    int64_t sums[MR][NR]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) sums[i][j] = 0;
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = std::min(k, k0 + KC);
    __m256i acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t kk = k0; kk < k1; kk += 16) {
      __m256i wv[C];
      for (int j = 0; j < C; ++j)
        wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + kk)));
      for (int i = 0; i < R; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * k + kk));
        for (int j = 0; j < C; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(wv[j], xv));
      }
    }
    // The flush: 8 int32 lanes -> 4 int64 lanes -> one int64, added to the tile's sums in memory
    // (int64 totals kept in registers across the loop would crowd out the accumulators).
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) {
        const __m256i lanes64 = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc[i][j])),
                                                 _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc[i][j], 1)));
        const __m128i pair = _mm_add_epi64(_mm256_castsi256_si128(lanes64), _mm256_extracti128_si256(lanes64, 1));
        sums[i][j] += _mm_cvtsi128_si64(pair) + _mm_extract_epi64(pair, 1);
      }
  }
}

// The full 6 x 2 tile, the hot loop of a batched step, in assembly: GCC keeps only part of the 12
// accumulators of the intrinsics version in registers and spills the rest every k step. Here:
// ymm0-11 accumulate, ymm12/13 hold the two widened weight vectors, ymm14 one x vector, ymm15 the
// product; per 16 inputs 2 weight loads, 6 x loads, 12 vpmaddwd and 12 vpaddd.
__attribute__((target("avx2"))) inline void tile_sums_6x2_asm(const int16_t* x, const int8_t* w, int64_t k,
                                                              int64_t sums[MR][NR]) {
  static_assert(MR == 6 && NR == 2, "the assembly tile is 6 x 2");
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = 0;
  alignas(32) int32_t lanes[MR * NR][8];
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t steps = (std::min(k, k0 + KC) - k0) / 16;
    const int16_t* p0 = x + k0;
    const int16_t* p3 = x + 3 * k + k0;
    const int8_t* wp = w + k0;
    const int64_t x_stride = k * 2;
    int64_t n = steps;
    asm volatile(
        "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
        "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
        "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
        "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
        "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
        "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
        "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
        "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
        "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
        "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
        "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
        "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
        "1:\n\t"
        "vpmovsxbw (%[w]), %%ymm12\n\t"
        "vpmovsxbw (%[w],%[ws]), %%ymm13\n\t"
        "vmovdqu (%[p0]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm0, %%ymm0\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm1, %%ymm1\n\t"
        "vmovdqu (%[p0],%[xs]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm2, %%ymm2\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm3, %%ymm3\n\t"
        "vmovdqu (%[p0],%[xs],2), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm4, %%ymm4\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm5, %%ymm5\n\t"
        "vmovdqu (%[p3]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm6, %%ymm6\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm7, %%ymm7\n\t"
        "vmovdqu (%[p3],%[xs]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm8, %%ymm8\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm9, %%ymm9\n\t"
        "vmovdqu (%[p3],%[xs],2), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm10, %%ymm10\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\t"
        "vpaddd %%ymm15, %%ymm11, %%ymm11\n\t"
        "add $16, %[w]\n\t"
        "add $32, %[p0]\n\t"
        "add $32, %[p3]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        "vmovdqa %%ymm0, 0(%[out])\n\t"
        "vmovdqa %%ymm1, 32(%[out])\n\t"
        "vmovdqa %%ymm2, 64(%[out])\n\t"
        "vmovdqa %%ymm3, 96(%[out])\n\t"
        "vmovdqa %%ymm4, 128(%[out])\n\t"
        "vmovdqa %%ymm5, 160(%[out])\n\t"
        "vmovdqa %%ymm6, 192(%[out])\n\t"
        "vmovdqa %%ymm7, 224(%[out])\n\t"
        "vmovdqa %%ymm8, 256(%[out])\n\t"
        "vmovdqa %%ymm9, 288(%[out])\n\t"
        "vmovdqa %%ymm10, 320(%[out])\n\t"
        "vmovdqa %%ymm11, 352(%[out])\n\t"
        "vzeroupper\n\t"
        : [w] "+r"(wp), [p0] "+r"(p0), [p3] "+r"(p3), [n] "+r"(n)
        : [ws] "r"(k), [xs] "r"(x_stride), [out] "r"(&lanes[0][0])
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
    for (int i = 0; i < MR; ++i) {  // both rows' 8 lanes at once: one hadd in int32 (exact, KC <= 2048), then int64
      const __m256i h = _mm256_hadd_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[2 * i])),
                                          _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[2 * i + 1])));
      const __m256i q = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(h)),
                                         _mm256_cvtepi32_epi64(_mm256_extracti128_si256(h, 1)));
      const __m256i t = _mm256_add_epi64(q, _mm256_shuffle_epi32(q, 0x4E));  // lane 0: row 2i's sum, lane 2: 2i+1's
      sums[i][0] += _mm256_extract_epi64(t, 0);
      sums[i][1] += _mm256_extract_epi64(t, 2);
    }
  }
}

inline void tile_sums_generic(const int16_t* x, const int8_t* w, int64_t k, int64_t rows, int64_t cols,
                              int64_t sums[MR][NR]) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      int64_t s = 0;
      for (int64_t kk = 0; kk < k; ++kk) s += static_cast<int32_t>(x[i * k + kk]) * static_cast<int32_t>(w[j * k + kk]);
      sums[i][j] = s;
    }
}

using TileSumsFn = void (*)(const int16_t*, const int8_t*, int64_t, int64_t[MR][NR]);

template <int R, int... C>
constexpr std::array<TileSumsFn, NR + 1> tile_row(std::integer_sequence<int, C...>) {
  return {nullptr, tile_sums_avx2<R, C + 1>...};
}

inline const TileSumsFn* tile_table(int64_t rows) {
  static const std::array<std::array<TileSumsFn, NR + 1>, MR + 1> table = {
      std::array<TileSumsFn, NR + 1>{}, tile_row<1>(std::make_integer_sequence<int, NR>{}),
      tile_row<2>(std::make_integer_sequence<int, NR>{}), tile_row<3>(std::make_integer_sequence<int, NR>{}),
      tile_row<4>(std::make_integer_sequence<int, NR>{}), tile_row<5>(std::make_integer_sequence<int, NR>{}),
      tile_row<6>(std::make_integer_sequence<int, NR>{})};
  return table[rows].data();
}

// out [m, n] = x_q [m, k] @ w [n, k]^T, scaled. Threads split the weight rows (in tiles of NR); a
// thread walks its rows in panels of about PANEL_BYTES, and each panel meets every row of x, MR
// rows at a time (their int16 rows in L1 while the panel's tiles stream from L2).
template <typename S>
void gemm(const TokenX& xq, const int8_t* w, const S* w_scales, int64_t n, float* out) {
  const int64_t m = xq.m, k = xq.k, tiles = (n + NR - 1) / NR;
  const int64_t panel_tiles = std::max<int64_t>(1, PANEL_BYTES / (NR * k));
  const bool generic = use_generic();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t sums[MR][NR];
    for (int64_t p0 = begin; p0 < end; p0 += panel_tiles) {
      const int64_t p1 = std::min(end, p0 + panel_tiles);
      for (int64_t i = 0; i < m; i += MR) {
        const int64_t rows = std::min(MR, m - i);
        const int16_t* xt = xq.q.data() + i * k;
        for (int64_t t = p0; t < p1; ++t) {
          const int64_t j0 = t * NR, cols = std::min(NR, n - j0);
          const int8_t* wt = w + j0 * k;
          if (generic) tile_sums_generic(xt, wt, k, rows, cols, sums);
          else if (rows == MR && cols == NR) tile_sums_6x2_asm(xt, wt, k, sums);
          else tile_table(rows)[cols](xt, wt, k, sums);
          for (int64_t r = 0; r < rows; ++r) {
            const float xs = xq.scale[i + r];
            for (int64_t c = 0; c < cols; ++c)
              out[(i + r) * n + j0 + c] =
                  static_cast<float>(static_cast<double>(sums[r][c])) * (xs * to_float(w_scales[j0 + c]));
          }
        }
      }
    }
  });
}

// Whether a packed int8 weight takes this path: per output channel (group == K), symmetric.
inline bool per_channel(int64_t group, int64_t k, bool has_mins) { return group == k && !has_mins; }

// out [m, n] for x [m, k] float32, w [n, k] int8 with float32 or (exact) float16 scales [n].
inline void linear(const float* x, int64_t m, int64_t k, const int8_t* w, const at::Tensor& scales, int64_t n,
                   float* out) {
  TORCH_CHECK(k % 16 == 0, "per-channel int8 needs K divisible by 16");
  const TokenX xq = quantize_tokens(x, m, k);
  if (scales.scalar_type() == at::kHalf) gemm<uint16_t>(xq, w, static_cast<const uint16_t*>(scales.data_ptr()), n, out);
  else gemm<float>(xq, w, scales.data_ptr<float>(), n, out);
}

}  // namespace int8g
