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
// relies on the headers that file includes and on its avx512_allowed(). kernels/quant_linear.py
// ``int_path_reference`` is the torch statement of the same arithmetic, bit for bit.

namespace int8g {

constexpr int64_t KC = 2048;        // inputs per int32 accumulation before a flush into int64
// Register tile: MR rows of x x NR rows of w = 12 int32 accumulators, 2 widened weight vectors, one
// x vector, one product: all 16 ymm registers. Each k step widens 2 weight vectors for 12 madd/add
// pairs. Fewer than MR rows or NR columns in all use the intrinsics version; a larger x's last
// rows or a weight's last columns take the full tile, overlapping the tile before (gemm below).
constexpr int64_t MR = 6, NR = 2;
// With AVX512-VNNI the tile is MR x NR512: 24 zmm accumulators of 16 int32 lanes, 4 widened weight
// vectors, one x vector (29 of 32 registers); vpdpwssd fuses the multiply-add and the add, so each
// instruction does 32 int16 multiply-adds where the AVX2 pair does 16 in two.
constexpr int64_t NR512 = 4;
constexpr int64_t NR_MAX = NR512;  // the sums array fits either tile
// Decode-shaped tiles (fewer than MR rows of x) are bound by the weight stream: each step asks for
// the bytes this far ahead in each of its weight rows, about 3 tiles ahead at K = 576 (m = 1 GEMV,
// 3072 x 576, Zen 5: 13.8 -> 27-33 GB/s on 1 thread, 23 -> 37-47 on 2; 512-4096 and 16384 tried).
constexpr int64_t PREFETCH_AHEAD = 8192;
constexpr int64_t PANEL_BYTES = 128 << 10;  // weight rows per pass over x: they stay in L2 while x streams

// x [m, k] rounded per row to int16, with the row's scale.
struct TokenX {
  int64_t m, k;
  std::vector<int16_t> q;    // [m, k]
  std::vector<float> scale;  // [m]
};

// The scalar variant (`set_isa("generic")`, quant_kernels.cpp): the same integers, summed in int64.
inline bool use_generic() { return g_isa_cap.load(std::memory_order_relaxed) == static_cast<int>(llk::Isa::kGeneric); }

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

// max |x[j]| over a row, k a multiple of 16 (max is exact: the same float as the scalar loop's; a
// NaN row gives garbage either way). std::fmax is a libm call per element that GCC does not
// vectorize: 4-5 % of an int8 batched step.
__attribute__((target("avx2"))) inline float amax_row_avx2(const float* x, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    b = _mm256_max_ps(b, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j + 8)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(a, b));
  float amax = 0.f;
  for (float v : lanes) amax = std::fmax(amax, v);
  return amax;
}

inline TokenX quantize_tokens(const float* x, int64_t m, int64_t k) {
  TokenX r{m, k, std::vector<int16_t>(m * k), std::vector<float>(m)};
  const bool generic = use_generic();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = x + i * k;
      float amax = 0.f;
      if (generic) {
        for (int64_t j = 0; j < k; ++j) amax = std::fmax(amax, std::fabs(xr[j]));
      } else {
        amax = amax_row_avx2(xr, k);
      }
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
                                                    int64_t sums[MR][NR_MAX]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) sums[i][j] = 0;
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = std::min(k, k0 + KC);
    __m256i acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t kk = k0; kk < k1; kk += 16) {
      __m256i wv[C];
      if (R < MR && (kk & 63) == 0)  // few rows of x (decode): bound by the weight stream, fetched ahead
        for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + kk + PREFETCH_AHEAD), _MM_HINT_T0);
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
// product; per 16 inputs 2 weight loads, 6 x loads, 12 vpmaddwd and 12 vpaddd, and a prefetch of
// each weight row PREFETCH_AHEAD ahead: with few rows of x (6-12) the tile otherwise waits
// on memory (6 rows, 3072 x 576: 149 -> 77-91 us a call); with many it costs nothing measurable.
// It leaves lanes[2 r + c] = the 8 int32 lanes of row r of x against weight row c over inputs
// [k0, k0 + kc), kc <= KC a multiple of 16 (x and w rows k long).
__attribute__((target("avx2"))) inline void tile_lanes_6x2_asm(const int16_t* x, const int8_t* w, int64_t k,
                                                               int64_t k0, int64_t kc, int32_t (*lanes)[8]) {
  static_assert(MR == 6 && NR == 2, "the assembly tile is 6 x 2");
  const int16_t* p0 = x + k0;
  const int16_t* p3 = x + 3 * k + k0;
  const int8_t* wp = w + k0;
  const int64_t x_stride = k * 2;
  int64_t n = kc / 16;
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
      "prefetcht0 %c[pf](%[w])\n\t"
      "prefetcht0 %c[pf](%[w],%[ws])\n\t"
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
      : [ws] "r"(k), [xs] "r"(x_stride), [out] "r"(&lanes[0][0]), [pf] "i"(PREFETCH_AHEAD)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
}

__attribute__((target("avx2"))) inline void tile_sums_6x2_asm(const int16_t* x, const int8_t* w, int64_t k,
                                                              int64_t sums[MR][NR_MAX]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = 0;
  alignas(32) int32_t lanes[MR * NR][8];
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    tile_lanes_6x2_asm(x, w, k, k0, std::min(KC, k - k0), lanes);
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

// The full 6 x 2 tile of a row no longer than KC, written straight to out: the sums go from the
// int32 lanes to double (exact: |S| < 2^53) in vectors, then to float (the one rounding of
// float(double(S)), as the int64 path) and times xs[r] * ws[c] (rounded to float first, as there).
// Why: at K = 576 the int64 flush and the scalar stores of the tile above were a quarter of a
// decode step's int8 GEMM time (perf, 64 x 576 x 3072).
__attribute__((target("avx2"))) inline void tile_out_6x2_avx2(const int16_t* x, const int8_t* w, int64_t k,
                                                              const float* xs, float ws0, float ws1, float* out,
                                                              int64_t ldo) {
  alignas(32) int32_t lanes[MR * NR][8];
  tile_lanes_6x2_asm(x, w, k, 0, k, lanes);
  for (int i = 0; i < MR; i += 2) {
    __m256d both[2];  // per row: [col 0, col 0, col 1, col 1] partial sums, to be added in pairs
    for (int h = 0; h < 2; ++h) {
      // lane pairs in int32 (exact for k <= KC, as in the int64 path): [c0 01, c0 23, c1 01, c1 23 | c0 45, c0 67, c1 45, c1 67]
      const __m256i pairs = _mm256_hadd_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[2 * (i + h)])),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[2 * (i + h) + 1])));
      both[h] = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(pairs)),
                              _mm256_cvtepi32_pd(_mm256_extracti128_si256(pairs, 1)));
    }
    // [row i col 0, row i+1 col 0, row i col 1, row i+1 col 1], each the whole exact sum
    const __m256d total = _mm256_hadd_pd(both[0], both[1]);
    const __m128 scale = _mm_mul_ps(_mm_setr_ps(xs[i], xs[i + 1], xs[i], xs[i + 1]), _mm_setr_ps(ws0, ws0, ws1, ws1));
    const __m128 v = _mm_mul_ps(_mm256_cvtpd_ps(total), scale);
    const __m128 rows = _mm_shuffle_ps(v, v, _MM_SHUFFLE(3, 1, 2, 0));  // [i c0, i c1, i+1 c0, i+1 c1]
    _mm_storel_pi(reinterpret_cast<__m64*>(out + i * ldo), rows);
    _mm_storeh_pi(reinterpret_cast<__m64*>(out + (i + 1) * ldo), rows);
  }
}

// The AVX512-VNNI tile (R <= MR rows of x, C <= NR512 rows of w), k a multiple of 32: the same
// exact integers as the AVX2 tile. Each int32 lane sums 2 products per 32 inputs, so up to KC
// inputs it stays below 128 * 32767 * KC / 16 < 2^30 before the flush into int64.
template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_sums_vnni(const int16_t* x, const int8_t* w,
                                                                          int64_t k, int64_t sums[MR][NR_MAX]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) sums[i][j] = 0;
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = std::min(k, k0 + KC);
    __m512i acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t kk = k0; kk < k1; kk += 32) {
      __m512i wv[C];
      if (R < MR && (kk & 63) == 0)  // few rows of x (decode): bound by the weight stream, fetched ahead
        for (int j = 0; j < C; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * k + kk + PREFETCH_AHEAD), _MM_HINT_T0);
      for (int j = 0; j < C; ++j)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k + kk)));
      for (int i = 0; i < R; ++i) {
        const __m512i xv = _mm512_loadu_si512(x + i * k + kk);
        for (int j = 0; j < C; ++j) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < C; ++j) {
        const __m512i lanes64 = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[i][j])),
                                                 _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[i][j], 1)));
        sums[i][j] += _mm512_reduce_add_epi64(lanes64);
      }
  }
}

// The full 6 x 4 VNNI tile in assembly, for the reason the AVX2 tile has one: GCC keeps the
// intrinsics version's accumulators in memory. zmm0-23 accumulate (row r, weight c in 4r + c),
// zmm24-27 hold the 4 widened weight vectors, zmm28 one x vector; per 32 inputs 4 weight loads,
// 6 x loads, 24 vpdpwssd and the prefetches of the AVX2 tile (6 rows, 3072 x 576: 92.5 -> 39 us).
// It leaves lanes[4 r + c] = the 16 int32 lanes of row r of x against weight row c over inputs
// [k0, k0 + kc), kc <= KC a multiple of 32.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_lanes_6x4_vnni_asm(
    const int16_t* x, const int8_t* w, int64_t k, int64_t k0, int64_t kc, int32_t (*lanes)[16]) {
  static_assert(MR == 6 && NR512 == 4, "the assembly tile is 6 x 4");
  int64_t n = kc / 32;
  const int16_t* p0 = x + k0;
  const int16_t* p3 = x + 3 * k + k0;
  const int8_t* wp = w + k0;
  const int8_t* w3 = w + 3 * k + k0;
  const int64_t x_stride = k * 2;
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"
      "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
      "vpxord %%zmm2, %%zmm2, %%zmm2\n\t"
      "vpxord %%zmm3, %%zmm3, %%zmm3\n\t"
      "vpxord %%zmm4, %%zmm4, %%zmm4\n\t"
      "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"
      "vpxord %%zmm6, %%zmm6, %%zmm6\n\t"
      "vpxord %%zmm7, %%zmm7, %%zmm7\n\t"
      "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"
      "vpxord %%zmm9, %%zmm9, %%zmm9\n\t"
      "vpxord %%zmm10, %%zmm10, %%zmm10\n\t"
      "vpxord %%zmm11, %%zmm11, %%zmm11\n\t"
      "vpxord %%zmm12, %%zmm12, %%zmm12\n\t"
      "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
      "vpxord %%zmm14, %%zmm14, %%zmm14\n\t"
      "vpxord %%zmm15, %%zmm15, %%zmm15\n\t"
      "vpxord %%zmm16, %%zmm16, %%zmm16\n\t"
      "vpxord %%zmm17, %%zmm17, %%zmm17\n\t"
      "vpxord %%zmm18, %%zmm18, %%zmm18\n\t"
      "vpxord %%zmm19, %%zmm19, %%zmm19\n\t"
      "vpxord %%zmm20, %%zmm20, %%zmm20\n\t"
      "vpxord %%zmm21, %%zmm21, %%zmm21\n\t"
      "vpxord %%zmm22, %%zmm22, %%zmm22\n\t"
      "vpxord %%zmm23, %%zmm23, %%zmm23\n\t"
      "1:\n\t"
      "prefetcht0 %c[pf](%[w])\n\t"
      "prefetcht0 %c[pf](%[w],%[ws])\n\t"
      "prefetcht0 %c[pf](%[w],%[ws],2)\n\t"
      "prefetcht0 %c[pf](%[w3])\n\t"
      "vpmovsxbw (%[w]), %%zmm24\n\t"
      "vpmovsxbw (%[w],%[ws]), %%zmm25\n\t"
      "vpmovsxbw (%[w],%[ws],2), %%zmm26\n\t"
      "vpmovsxbw (%[w3]), %%zmm27\n\t"
      "vmovdqu64 (%[p0]), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm0\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm1\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm2\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm3\n\t"
      "vmovdqu64 (%[p0],%[xs]), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm4\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm5\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm6\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm7\n\t"
      "vmovdqu64 (%[p0],%[xs],2), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm8\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm9\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm10\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm11\n\t"
      "vmovdqu64 (%[p3]), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm12\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm13\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm14\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm15\n\t"
      "vmovdqu64 (%[p3],%[xs]), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm16\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm17\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm18\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm19\n\t"
      "vmovdqu64 (%[p3],%[xs],2), %%zmm28\n\t"
      "vpdpwssd %%zmm24, %%zmm28, %%zmm20\n\t"
      "vpdpwssd %%zmm25, %%zmm28, %%zmm21\n\t"
      "vpdpwssd %%zmm26, %%zmm28, %%zmm22\n\t"
      "vpdpwssd %%zmm27, %%zmm28, %%zmm23\n\t"
      "add $32, %[w]\n\t"
      "add $32, %[w3]\n\t"
      "add $64, %[p0]\n\t"
      "add $64, %[p3]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vmovdqa64 %%zmm0, 0(%[out])\n\t"
      "vmovdqa64 %%zmm1, 64(%[out])\n\t"
      "vmovdqa64 %%zmm2, 128(%[out])\n\t"
      "vmovdqa64 %%zmm3, 192(%[out])\n\t"
      "vmovdqa64 %%zmm4, 256(%[out])\n\t"
      "vmovdqa64 %%zmm5, 320(%[out])\n\t"
      "vmovdqa64 %%zmm6, 384(%[out])\n\t"
      "vmovdqa64 %%zmm7, 448(%[out])\n\t"
      "vmovdqa64 %%zmm8, 512(%[out])\n\t"
      "vmovdqa64 %%zmm9, 576(%[out])\n\t"
      "vmovdqa64 %%zmm10, 640(%[out])\n\t"
      "vmovdqa64 %%zmm11, 704(%[out])\n\t"
      "vmovdqa64 %%zmm12, 768(%[out])\n\t"
      "vmovdqa64 %%zmm13, 832(%[out])\n\t"
      "vmovdqa64 %%zmm14, 896(%[out])\n\t"
      "vmovdqa64 %%zmm15, 960(%[out])\n\t"
      "vmovdqa64 %%zmm16, 1024(%[out])\n\t"
      "vmovdqa64 %%zmm17, 1088(%[out])\n\t"
      "vmovdqa64 %%zmm18, 1152(%[out])\n\t"
      "vmovdqa64 %%zmm19, 1216(%[out])\n\t"
      "vmovdqa64 %%zmm20, 1280(%[out])\n\t"
      "vmovdqa64 %%zmm21, 1344(%[out])\n\t"
      "vmovdqa64 %%zmm22, 1408(%[out])\n\t"
      "vmovdqa64 %%zmm23, 1472(%[out])\n\t"
      "vzeroupper\n\t"
      : [w] "+r"(wp), [w3] "+r"(w3), [p0] "+r"(p0), [p3] "+r"(p3), [n] "+r"(n)
      : [ws] "r"(k), [xs] "r"(x_stride), [out] "r"(&lanes[0][0]), [pf] "i"(PREFETCH_AHEAD)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "memory", "cc");
}

// The flush, one row's 4 accumulators together: a lane holds at most 2 * KC / 32 products, each
// |p| <= 128 * 32767, so < 2^29 and any 4 lanes sum exactly in int32. Transposing adds (within
// 128-bit lanes) leave [col 0, 1, 2, 3] sums of 4 lanes in each 128-bit lane.
__attribute__((target("avx512f,avx512bw"))) inline __m512i column_sums_6x4(const int32_t (*lanes)[16], int i) {
  const __m512i a0 = _mm512_load_si512(lanes[i * NR512]), a1 = _mm512_load_si512(lanes[i * NR512 + 1]);
  const __m512i a2 = _mm512_load_si512(lanes[i * NR512 + 2]), a3 = _mm512_load_si512(lanes[i * NR512 + 3]);
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_sums_6x4_vnni_asm(
    const int16_t* x, const int8_t* w, int64_t k, int64_t sums[MR][NR_MAX]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR512; ++j) sums[i][j] = 0;
  alignas(64) int32_t lanes[MR * NR512][16];
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    tile_lanes_6x4_vnni_asm(x, w, k, k0, std::min(KC, k - k0), lanes);
    // The 4 x 4 sums of each row go to int64 for the last adds.
    for (int i = 0; i < MR; ++i) {
      const __m512i c = column_sums_6x4(lanes, i);
      const __m512i wide = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(c)),
                                            _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(c, 1)));
      const __m256i four = _mm256_add_epi64(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64(wide, 1));
      __m256i* row = reinterpret_cast<__m256i*>(sums[i]);
      _mm256_storeu_si256(row, _mm256_add_epi64(_mm256_loadu_si256(row), four));
    }
  }
}

// The full 6 x 4 VNNI tile of a row no longer than KC, written straight to out, as
// tile_out_6x2_avx2: the column sums to double (exact), to float once, times xs[r] * ws[c].
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_out_6x4_vnni(
    const int16_t* x, const int8_t* w, int64_t k, const float* xs, __m128 ws, float* out, int64_t ldo) {
  alignas(64) int32_t lanes[MR * NR512][16];
  tile_lanes_6x4_vnni_asm(x, w, k, 0, k, lanes);
  for (int i = 0; i < MR; ++i) {
    const __m512i c = column_sums_6x4(lanes, i);  // [c0 c1 c2 c3] x 4, each < 2^31
    const __m512d wide = _mm512_add_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(c)),
                                       _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(c, 1)));
    const __m256d total = _mm256_add_pd(_mm512_castpd512_pd256(wide), _mm512_extractf64x4_pd(wide, 1));  // c0..c3
    const __m128 v = _mm_mul_ps(_mm256_cvtpd_ps(total), _mm_mul_ps(_mm_set1_ps(xs[i]), ws));
    _mm_storeu_ps(out + i * ldo, v);
  }
}

inline void tile_sums_generic(const int16_t* x, const int8_t* w, int64_t k, int64_t rows, int64_t cols,
                              int64_t sums[MR][NR_MAX]) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      int64_t s = 0;
      for (int64_t kk = 0; kk < k; ++kk) s += static_cast<int32_t>(x[i * k + kk]) * static_cast<int32_t>(w[j * k + kk]);
      sums[i][j] = s;
    }
}

using TileSumsFn = void (*)(const int16_t*, const int8_t*, int64_t, int64_t[MR][NR_MAX]);

template <template <int, int> class Tile, int R, int... C>
constexpr std::array<TileSumsFn, NR_MAX + 1> tile_row(std::integer_sequence<int, C...>) {
  return {nullptr, Tile<R, C + 1>::fn...};
}

template <template <int, int> class Tile, int64_t COLS>
const TileSumsFn* tile_table(int64_t rows) {
  using Cols = std::make_integer_sequence<int, COLS>;
  static const std::array<std::array<TileSumsFn, NR_MAX + 1>, MR + 1> table = {
      std::array<TileSumsFn, NR_MAX + 1>{}, tile_row<Tile, 1>(Cols{}), tile_row<Tile, 2>(Cols{}),
      tile_row<Tile, 3>(Cols{}), tile_row<Tile, 4>(Cols{}), tile_row<Tile, 5>(Cols{}), tile_row<Tile, 6>(Cols{})};
  return table[rows].data();
}

template <int R, int C>
struct Avx2Tile {
  static constexpr TileSumsFn fn = tile_sums_avx2<R, C>;
};
template <int R, int C>
struct VnniTile {
  static constexpr TileSumsFn fn = tile_sums_vnni<R, C>;
};

// The zmm tile where the CPU has AVX512-VNNI (and AVX512-BW for the widening), unless `set_isa`
// lowers the level (avx512_allowed, quant_kernels.cpp).
inline bool use_vnni() {
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vnni");
  return vnni && avx512_allowed();
}

// One tile of sums: the variant's full tile or an edge tile from its table.
struct TileKernel {
  int64_t cols;  // weight rows per tile
  bool generic, vnni;
  void operator()(const int16_t* x, const int8_t* w, int64_t k, int64_t rows, int64_t n_cols,
                  int64_t sums[MR][NR_MAX]) const {
    if (generic) tile_sums_generic(x, w, k, rows, n_cols, sums);
    else if (vnni && rows == MR && n_cols == NR512) tile_sums_6x4_vnni_asm(x, w, k, sums);
    else if (vnni) tile_table<VnniTile, NR512>(rows)[n_cols](x, w, k, sums);
    else if (rows == MR && n_cols == NR) tile_sums_6x2_asm(x, w, k, sums);
    else tile_table<Avx2Tile, NR>(rows)[n_cols](x, w, k, sums);
  }
};

inline TileKernel tile_kernel(int64_t k) {
  const bool generic = use_generic(), vnni = !generic && k % 32 == 0 && use_vnni();
  return {vnni ? NR512 : NR, generic, vnni};
}

// out [m, n] = x_q [m, k] @ w [n, k]^T, scaled. Threads split the weight rows (in tiles of the variant's width); a
// thread walks its rows in panels of about PANEL_BYTES, and each panel meets every row of x, MR
// rows at a time (their int16 rows in L1 while the panel's tiles stream from L2).
template <typename S>
void gemm(const TokenX& xq, const int8_t* w, const S* w_scales, int64_t n, float* out) {
  const int64_t m = xq.m, k = xq.k;
  const TileKernel tile = tile_kernel(k);
  const int64_t tiles = (n + tile.cols - 1) / tile.cols;
  const int64_t panel_tiles = std::max<int64_t>(1, PANEL_BYTES / (tile.cols * k));
  // Full tiles of rows no longer than KC go straight to out (tile_out_6x2_avx2, tile_out_6x4_vnni).
  const bool fused_6x2 = !tile.generic && !tile.vnni && k <= KC, fused_6x4 = tile.vnni && k <= KC;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t sums[MR][NR_MAX];
    for (int64_t p0 = begin; p0 < end; p0 += panel_tiles) {
      const int64_t p1 = std::min(end, p0 + panel_tiles);
      for (int64_t i0 = 0; i0 < m; i0 += MR) {
        // A last block of fewer than MR rows (or tile.cols columns) moves back to overlap the one
        // before it, so that it takes the full tile, and writes only its own rows and columns
        // (the overlap's sums are exact integers: the same whichever tile computes them).
        const int64_t i = (i0 + MR > m && m >= MR) ? m - MR : i0, rows = std::min(MR, m - i);
        const int16_t* xt = xq.q.data() + i * k;
        for (int64_t t = p0; t < p1; ++t) {
          const int64_t j0 = (t + 1 == tiles && n >= tile.cols) ? n - tile.cols : t * tile.cols;
          const int64_t cols = std::min(tile.cols, n - j0);
          if (fused_6x4 && rows == MR && cols == NR512 && i == i0 && j0 == t * NR512) {
            const __m128 ws = _mm_setr_ps(to_float(w_scales[j0]), to_float(w_scales[j0 + 1]),
                                          to_float(w_scales[j0 + 2]), to_float(w_scales[j0 + 3]));
            tile_out_6x4_vnni(xt, w + j0 * k, k, xq.scale.data() + i, ws, out + i * n + j0, n);
            continue;
          }
          if (fused_6x2 && rows == MR && cols == NR && i == i0 && j0 == t * NR) {
            tile_out_6x2_avx2(xt, w + j0 * k, k, xq.scale.data() + i, to_float(w_scales[j0]),
                              to_float(w_scales[j0 + 1]), out + i * n + j0, n);
            continue;
          }
          tile(xt, w + j0 * k, k, rows, cols, sums);
          for (int64_t r = i0 - i; r < rows; ++r) {
            const float xs = xq.scale[i + r];
            for (int64_t c = t * tile.cols - j0; c < cols; ++c)
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
