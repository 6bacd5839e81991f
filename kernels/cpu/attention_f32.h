// Paged attention in fp32 arithmetic, AVX2+FMA intrinsics, head_dim D = 64 or 128, fp32 or bf16
// caches (bf16 rows widened to fp32, exactly): decode, and prefill (a causal chunk of query tokens
// per sequence, its context already in the cache). Included by cpu_kernels_isa.h in its AVX2 and
// AVX-512 namespaces only.
//
// Why not the generic loops of decode_tasks: with -ffp-contract=off they multiply and add
// separately, each score is one serial chain of D/8 vector ops followed by a horizontal sum, and
// the V pass loads and stores its accumulator for every token. Here:
// - scores: 8 tokens at a time per query head, 8 independent FMA chains, one 8-way transpose-sum
//   that yields the 8 scores as one vector;
// - V pass: one query head's accumulator (8 vectors) stays in registers over a chunk of tokens
//   whose V rows all heads of the task share, so the chunk is read from L1 by the heads after the
//   first.
// Tokens are visited in cache order (a token's row holds every KV head), so a block streams front
// to back. The arithmetic per (sequence, head) does not depend on the batch, the task split or the
// thread: batched == unbatched. Results differ from the generic variant in summation order only.

namespace f32attn {

#include "attention_tiles.h"

// 8 codes as fp32 code values (the row's scale not applied), exactly:
// - int8: sign-extended and converted;
// - fp8 e5m2 is the upper byte of a float16;
// - fp8 e4m3 (bias 7) as float16 bits (bias 15): sign to bit 15, exponent and mantissa to bits
//   13..7, then times 2^8. Its subnormals land on float16 subnormals, which F16C converts
//   exactly. (Code 0x7f, e4m3fn's NaN, reads as 480; a stored row never holds it.)
inline __m256 code_values8(const Int8Code* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 code_values8(const Fp8E5m2Code* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(c, 8));
}
inline __m256 code_values8(const Fp8E4m3Code* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

// A cache row of n elements (a multiple of 8) as fp32: fp32 rows are read in place, bf16 rows are
// widened into ``buffer`` (exact: a bf16 value is the top half of its fp32), code rows become
// their code values there (the caller applies the row's scale).
template <typename T>
inline const float* widen_row(const T* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (kIsCode<T>) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(buffer + i, code_values8(src + i));
    return buffer;
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>, "fp32, bf16 or 8-bit code caches");
    for (int64_t i = 0; i < n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(buffer + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    return buffer;
  }
}

// Code caches: the scales of KV head `head` (relative to the task's first) of 8 tokens, from
// their offsets (task's first head at token_row * Hkv * D + first_head * D).
template <int64_t D>
inline __m256 row_scales8(const float* scales, const int64_t* offset, int64_t head) {
  return _mm256_setr_ps(scales[offset[0] / D + head], scales[offset[1] / D + head], scales[offset[2] / D + head],
                        scales[offset[3] / D + head], scales[offset[4] / D + head], scales[offset[5] / D + head],
                        scales[offset[6] / D + head], scales[offset[7] / D + head]);
}

// out[r] = acc[r] * inv_sum[r] for `rows` head rows of D, rounded to T.
template <typename T, int64_t D>
inline void store_rows(const float* acc, const float* inv_sum, int64_t rows, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(inv_sum[r]);
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), inv);
      if constexpr (std::is_same_v<T, float>) {
        _mm256_storeu_ps(out + r * D + d, v);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, v);
        for (int i = 0; i < 8; ++i) store(out + r * D + d + i, tmp[i]);
      }
    }
  }
}

// T = float or at::BFloat16 (query and output); C = the cache's elements: T, or 8-bit codes, whose
// per-(token, KV head) scales multiply a score (K) and a softmax weight (V). fp32 arithmetic.
template <typename T, int64_t D, typename C = T>
void decode_tasks(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * D;  // elements per token in the cache
  const int64_t tasks_per_seq = a.num_kv_heads / a.heads_per_task;
  const int64_t rows = a.heads_per_task * group;  // query heads of one task
  const int64_t kv_len = a.heads_per_task * D;    // elements of a token's row this task reads
  std::vector<float> qf(rows * D), acc(rows * D), inv_sum(rows), scores;
  std::vector<float> widened(std::is_same_v<C, float> ? 0 : std::max(kScoreTile, kValueChunk) * kv_len);
  float weights[kValueChunk];  // code caches: a chunk's softmax weights times its V scales
  std::vector<int64_t> token_offset;  // t -> the token's row in the cache (elements), plus the task's first head
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / tasks_per_seq, first_head = (task % tasks_per_seq) * a.heads_per_task;
    const int64_t len = a.seq_lens[seq];
    const int64_t padded = (len + kScoreTile - 1) / kScoreTile * kScoreTile;
    const int32_t* table = a.block_tables + seq * a.max_blocks;
    const int64_t q_offset = (seq * a.num_q_heads + first_head * group) * D;
    for (int64_t i = 0; i < rows * D; ++i) qf[i] = load(a.q + q_offset + i) * a.scale;
    token_offsets(token_offset, table, a.block_size, len, padded, row, first_head * D);
    scores.resize(rows * padded);

    const float* tile_rows[kScoreTile];  // the tile's K rows (all the task's heads) as fp32
    const float* rows_of_tile[kScoreTile];
    for (int64_t t0 = 0; t0 < padded; t0 += kScoreTile) {  // pass 1: scores
      for (int64_t t = t0 + kPrefetchAhead; t < std::min(t0 + kPrefetchAhead + kScoreTile, len); ++t)
        prefetch_row(a.k_cache + token_offset[t], kv_len * sizeof(C));
      for (int j = 0; j < kScoreTile; ++j)
        tile_rows[j] = widen_row(a.k_cache + token_offset[t0 + j], widened.data() + j * kv_len, kv_len);
      for (int64_t h = 0; h < a.heads_per_task; ++h) {
        for (int j = 0; j < kScoreTile; ++j) rows_of_tile[j] = tile_rows[j] + h * D;
        __m256 k_scales = _mm256_set1_ps(1.f);
        if constexpr (kIsCode<C>) k_scales = row_scales8<D>(a.k_scale, token_offset.data() + t0, h);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = h * group + g;
          __m256 tile = score_tile<D>(qf.data() + r * D, rows_of_tile);
          if constexpr (kIsCode<C>) tile = _mm256_mul_ps(tile, k_scales);
          _mm256_storeu_ps(scores.data() + r * padded + t0, tile);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) inv_sum[r] = softmax_row(scores.data() + r * padded, len);

    std::fill(acc.begin(), acc.end(), 0.f);
    const float* chunk_rows[kValueChunk];
    for (int64_t t0 = 0; t0 < len; t0 += kValueChunk) {  // pass 2: weighted sum of V
      const int64_t n = std::min(kValueChunk, len - t0);
      for (int64_t j = 0; j < n; ++j)
        chunk_rows[j] = widen_row(a.v_cache + token_offset[t0 + j], widened.data() + j * kv_len, kv_len);
      for (int64_t t = t0 + kPrefetchAhead; t < std::min(t0 + kPrefetchAhead + kValueChunk, len); ++t)
        prefetch_row(a.v_cache + token_offset[t], kv_len * sizeof(C));
      for (int64_t h = 0; h < a.heads_per_task; ++h)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = h * group + g;
          const float* p = scores.data() + r * padded + t0;
          if constexpr (kIsCode<C>) {
            for (int64_t j = 0; j < n; ++j) weights[j] = p[j] * a.v_scale[token_offset[t0 + j] / D + h];
            p = weights;
          }
          for (int64_t half = 0; half < D; half += 64)
            accumulate_v64(acc.data() + r * D + half, p, chunk_rows, n, h * D + half);
        }
    }
    store_rows<T, D>(acc.data(), inv_sum.data(), rows, a.out + q_offset);
  }
}

// Causal prefill / extend over the paged cache, the counterpart of paged_prefill_attention_torch:
// chunk i is query rows [query_start[i], query_start[i + 1]) of a sequence whose seq_lens[i] tokens
// are all in the cache (this chunk's K/V stored already); query j sits at position
// seq_len - q_len + j and sees cache tokens 0..position. One task = one sequence and one KV head:
// for each query token, the same score tiles and V pass as decode, over its causal prefix. bf16
// caches: the head's K and V are widened to fp32 once per task (each query re-reads them); 8-bit
// code caches (C a code type): dequantized there once, code * its row's scale, as
// kernels/kv_quant.py's dequantize_per_token computes it in fp32.
template <typename T, typename C = T>
struct PrefillArgs {
  const T* q;  // [num_tokens, num_q_heads, D]
  const C* k_cache;
  const C* v_cache;
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* seq_lens;
  T* out;  // [num_tokens, num_q_heads, D]
  int64_t num_q_heads, num_kv_heads, block_size, max_blocks;
  float scale;
  const float* k_scale = nullptr;  // codes only: [NB, BS, Hkv]
  const float* v_scale = nullptr;
};

// row[0..D) *= s (a dequantized code row).
template <int64_t D>
inline void scale_row(float* row, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), sv));
}

template <typename T, int64_t D, typename C = T>
void prefill_task(const PrefillArgs<T, C>& a, int64_t seq, int64_t h) {
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * D;
  const int64_t q_start = a.query_start[seq], q_len = a.query_start[seq + 1] - q_start, len = a.seq_lens[seq];
  if (q_len <= 0) return;
  const int64_t padded = (len + kScoreTile - 1) / kScoreTile * kScoreTile;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  std::vector<int64_t> token_offset;  // t -> the token's K/V row of head h in k_base / v_base
  token_offsets(token_offset, table, a.block_size, len, padded, row, h * D);
  const float* k_base;
  const float* v_base;
  std::vector<float> k_wide, v_wide;
  if constexpr (std::is_same_v<C, float>) {
    k_base = a.k_cache, v_base = a.v_cache;
  } else {
    k_wide.resize(len * D), v_wide.resize(len * D);
    for (int64_t t = 0; t < len; ++t) {
      widen_row(a.k_cache + token_offset[t], k_wide.data() + t * D, D);
      widen_row(a.v_cache + token_offset[t], v_wide.data() + t * D, D);
      if constexpr (kIsCode<C>) {
        scale_row<D>(k_wide.data() + t * D, a.k_scale[token_offset[t] / D]);
        scale_row<D>(v_wide.data() + t * D, a.v_scale[token_offset[t] / D]);
      }
      token_offset[t] = t * D;
    }
    for (int64_t t = len; t < padded; ++t) token_offset[t] = 0;
    k_base = k_wide.data(), v_base = v_wide.data();
  }
  std::vector<float> qf(group * D), acc(group * D), inv_sum(group), scores(group * padded);
  const float* rows_of_tile[kScoreTile];
  const float* chunk_rows[kValueChunk];
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t n = len - q_len + j + 1;  // tokens this query sees
    const int64_t n_padded = (n + kScoreTile - 1) / kScoreTile * kScoreTile;
    const T* qrow = a.q + ((q_start + j) * a.num_q_heads + h * group) * D;
    for (int64_t i = 0; i < group * D; ++i) qf[i] = load(qrow + i) * a.scale;
    for (int64_t t0 = 0; t0 < n_padded; t0 += kScoreTile) {
      for (int jj = 0; jj < kScoreTile; ++jj) rows_of_tile[jj] = k_base + token_offset[t0 + jj];
      for (int64_t g = 0; g < group; ++g)
        _mm256_storeu_ps(scores.data() + g * padded + t0, score_tile<D>(qf.data() + g * D, rows_of_tile));
    }
    for (int64_t g = 0; g < group; ++g) inv_sum[g] = softmax_row(scores.data() + g * padded, n);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t0 = 0; t0 < n; t0 += kValueChunk) {
      const int64_t c = std::min(kValueChunk, n - t0);
      for (int64_t jj = 0; jj < c; ++jj) chunk_rows[jj] = v_base + token_offset[t0 + jj];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t half = 0; half < D; half += 64)
          accumulate_v64(acc.data() + g * D + half, scores.data() + g * padded + t0, chunk_rows, c, half);
    }
    store_rows<T, D>(acc.data(), inv_sum.data(), group, a.out + ((q_start + j) * a.num_q_heads + h * group) * D);
  }
}

}  // namespace f32attn
