// The fp32 attention tiles, AVX2+FMA intrinsics: a score tile (one query head against 8 key rows:
// 8 independent FMA chains, one transpose-sum), an 8-lane softmax, and a V chunk accumulated with
// the accumulator in registers. Shared by the paged attention kernels of the float module
// (attention_f32.h: fp32, bf16 and 8-bit code caches) and of the quantized-KV module
// (kv_quant_attention_isa.h: KIVI); each includes it inside its AVX2 (and AVX-512) namespaces,
// after fast_exp.h.

constexpr int64_t kScoreTile = 8;   // tokens per score tile (one ymm of scores)
constexpr int64_t kValueChunk = 16;  // tokens per V chunk
constexpr int64_t kPrefetchAhead = 32;  // tokens between a row's prefetch and its use

#include "prefetch_cursor.h"

// offset[t] = the cache row of token t of a sequence (elements), plus `extra`, for t < len; entries
// [len, padded) repeat token 0's (tiles past the end read a real row, whose score is then ignored).
inline void token_offsets(std::vector<int64_t>& offset, const int32_t* table, int64_t block_size, int64_t len,
                          int64_t padded, int64_t row, int64_t extra) {
  offset.resize(padded);
  for (int64_t t = 0; t < len; ++t)
    offset[t] = (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row + extra;
  for (int64_t t = len; t < padded; ++t) offset[t] = offset[0];
}

// The same for the `len` tokens from token `first` on (a sliding window's keys): offset[i] is token
// first + i's.
inline void token_offsets(std::vector<int64_t>& offset, const int32_t* table, int64_t block_size, int64_t first,
                          int64_t len, int64_t padded, int64_t row, int64_t extra) {
  if (first == 0) return token_offsets(offset, table, block_size, len, padded, row, extra);
  offset.resize(padded);
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = first + i;
    offset[i] = (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row + extra;
  }
  for (int64_t i = len; i < padded; ++i) offset[i] = offset[0];
}

// fast_exp (fast_exp.h) on 8 lanes. GCC leaves the scalar one unvectorized in the softmax
// loop, where it then took about half of a decode call.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), _mm256_set1_ps(2.f));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// s[0..len) becomes exp(s - max); returns 1 / its sum. s has room up to len rounded up to 8.
inline float softmax_row(float* s, int64_t len, float sink = -std::numeric_limits<float>::infinity()) {
  const int64_t whole = len / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < whole; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
  float m = hmax8(vmax);
  for (int64_t t = whole; t < len; ++t) m = s[t] > m ? s[t] : m;
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum8(vsum);
  for (int64_t t = whole; t < len; ++t) {
    s[t] = fast_exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / llk::plus_sink(sum, m, sink);
}

// v[j] = sum of the 8 lanes of a[j].
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of one query head (q, D floats, already scaled) against 8 key rows.
template <int64_t D>
inline __m256 score_tile(const float* q, const float* const* k) {
  __m256 acc[kScoreTile];
  for (int j = 0; j < kScoreTile; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int j = 0; j < kScoreTile; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + c), acc[j]);
  }
  return transpose_sum8(acc);
}

// acc[0..63] += sum over the chunk's tokens t of p[t] * v_t[0..63]; acc in registers throughout.
inline void accumulate_v64(float* acc, const float* p, const float* const* v, int64_t n, int64_t offset) {
  __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16),
         a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32), a5 = _mm256_loadu_ps(acc + 40),
         a6 = _mm256_loadu_ps(acc + 48), a7 = _mm256_loadu_ps(acc + 56);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_broadcast_ss(p + t);
    const float* r = v[t] + offset;
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
    a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
    a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
    a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
    a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
  }
  _mm256_storeu_ps(acc, a0), _mm256_storeu_ps(acc + 8, a1), _mm256_storeu_ps(acc + 16, a2);
  _mm256_storeu_ps(acc + 24, a3), _mm256_storeu_ps(acc + 32, a4), _mm256_storeu_ps(acc + 40, a5);
  _mm256_storeu_ps(acc + 48, a6), _mm256_storeu_ps(acc + 56, a7);
}
