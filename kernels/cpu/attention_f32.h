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
    const int64_t first = llk::window_first(a.seq_lens[seq] - 1, a.window);  // the keys [first, seq_len)
    const int64_t len = a.seq_lens[seq] - first;
    const int64_t padded = (len + kScoreTile - 1) / kScoreTile * kScoreTile;
    const int32_t* table = a.block_tables + seq * a.max_blocks;
    const int64_t q_offset = (seq * a.num_q_heads + first_head * group) * D;
    for (int64_t i = 0; i < rows * D; ++i) qf[i] = load(a.q + q_offset + i) * a.scale;
    token_offsets(token_offset, table, a.block_size, first, len, padded, row, first_head * D);
    scores.resize(rows * padded);

    const float* tile_rows[kScoreTile];  // the tile's K rows (all the task's heads) as fp32
    const float* rows_of_tile[kScoreTile];
    const int64_t lines_per_row = (kv_len * static_cast<int64_t>(sizeof(C)) + 63) / 64;
    for (int64_t t0 = 0; t0 < padded; t0 += kScoreTile) {  // pass 1: scores
      PrefetchCursor ahead(a.k_cache, token_offset.data(), t0 + kPrefetchAhead,
                           std::min(t0 + kPrefetchAhead + kScoreTile, len), lines_per_row);
      const int64_t lines = ahead.share(rows);  // before each query head's tile
      for (int j = 0; j < kScoreTile; ++j)
        tile_rows[j] = widen_row(a.k_cache + token_offset[t0 + j], widened.data() + j * kv_len, kv_len);
      for (int64_t h = 0; h < a.heads_per_task; ++h) {
        for (int j = 0; j < kScoreTile; ++j) rows_of_tile[j] = tile_rows[j] + h * D;
        __m256 k_scales = _mm256_set1_ps(1.f);
        if constexpr (kIsCode<C>) k_scales = row_scales8<D>(a.k_scale, token_offset.data() + t0, h);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = h * group + g;
          ahead.issue(lines);
          __m256 tile = score_tile<D>(qf.data() + r * D, rows_of_tile);
          if constexpr (kIsCode<C>) tile = _mm256_mul_ps(tile, k_scales);
          _mm256_storeu_ps(scores.data() + r * padded + t0, tile);
        }
      }
    }
    if (a.softcap > 0.f)
      for (int64_t r = 0; r < rows; ++r) llk::softcap_scores(scores.data() + r * padded, len, a.softcap);
    for (int64_t r = 0; r < rows; ++r)
      inv_sum[r] = softmax_row(scores.data() + r * padded, len, llk::sink_of(a.sinks, first_head * group + r));

    std::fill(acc.begin(), acc.end(), 0.f);
    const float* chunk_rows[kValueChunk];
    for (int64_t t0 = 0; t0 < len; t0 += kValueChunk) {  // pass 2: weighted sum of V
      const int64_t n = std::min(kValueChunk, len - t0);
      for (int64_t j = 0; j < n; ++j)
        chunk_rows[j] = widen_row(a.v_cache + token_offset[t0 + j], widened.data() + j * kv_len, kv_len);
      PrefetchCursor ahead(a.v_cache, token_offset.data(), t0 + kPrefetchAhead,
                           std::min(t0 + kPrefetchAhead + kValueChunk, len), lines_per_row);
      const int64_t lines = ahead.share(rows);
      for (int64_t h = 0; h < a.heads_per_task; ++h)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = h * group + g;
          ahead.issue(lines);
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
// seq_len - q_len + j and sees cache tokens 0..position. One task = one sequence and one KV head.
// Its K is staged once, transposed to fp32 columns a vector of tokens wide (kt[t / N][d][t % N]),
// and its V rows as fp32 (bf16 widened exactly; 8-bit codes dequantized, code * its row's scale,
// as kernels/kv_quant.py's dequantize_per_token computes it in fp32). Then per query head, blocks
// of 8 query rows:
// - scores: 8 rows x one vector of tokens, d by d, one K load per 8 broadcast FMAs (a register
//   tile: the query rows share every K load);
// - the causal softmax of each row over its own prefix (later tokens get weight 0);
// - V: RP rows x CH vectors of dims in registers, one V load per RP FMAs.
// Why: the decode-style kernel it replaces ran each query row alone against every K and V row
// (a matrix-vector product per row): 7.2 ms a layer for 16 prompts x 128 tokens of the 246M
// Llama on a 2-core AMX Xeon, ~18 % of a bf16 prefill chunk (docs/benchmarks.md, "Prefill
// attention"). fp32 arithmetic throughout; the result of a query row depends only on its sequence.
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
  int64_t window = 0;  // sliding window (attention_window.h); 0: the whole context
  float softcap = 0.f;  // attention-logit soft cap; 0: none
  const float* sinks = nullptr;  // [num_q_heads] sink logits (attention_window.h); null: none
};

// row[0..D) *= s (a dequantized code row).
template <int64_t D>
inline void scale_row(float* row, float s) {
  const __m256 sv = _mm256_set1_ps(s);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), sv));
}

// fp32 vectors of the prefill tiles: 8 lanes (AVX2) or, where the namespace is compiled for it,
// 16 (AVX-512).
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // s[0..n) becomes exp(s - max), s[n..n_pad) 0; returns 1 / the sum (with the sink's share).
  // n_pad: a multiple of 8.
  static float softmax_prefix(float* s, int64_t n, int64_t n_pad, float sink) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_ps(static_cast<float>(n));
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    auto valid = [&](int64_t t) { return _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(t)), limit, _CMP_LT_OQ); };
    __m256 vmax = minus_inf;
    for (int64_t t = 0; t < n_pad; t += 8)
      vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + t), valid(t)));
    const __m256 vm = _mm256_set1_ps(hmax8(vmax));
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n_pad; t += 8) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm)), valid(t));
      _mm256_storeu_ps(s + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    return 1.f / llk::plus_sink(hsum8(vsum), _mm256_cvtss_f32(vm), sink);
  }
};
#ifdef LLK_ISA_HAS_AVX512
// exp8 (attention_tiles.h) on 16 lanes: the same operations lane by lane, 2^n by vscalefps.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n in one instruction (exact, as exp8's two products are)
}

struct Lanes16 {
  using V = __m512;
  static constexpr int64_t N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float softmax_prefix(float* s, int64_t n, int64_t n_pad, float sink) {  // as Lanes8's
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    auto valid = [&](int64_t t) -> __mmask16 { return t + 16 <= n ? 0xffff : t >= n ? 0 : (1u << (n - t)) - 1; };
    __m512 vmax = minus_inf;
    for (int64_t t = 0; t < n_pad; t += 16) vmax = _mm512_mask_max_ps(vmax, valid(t), vmax, _mm512_loadu_ps(s + t));
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n_pad; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(valid(t), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm)));
      _mm512_storeu_ps(s + t, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    return 1.f / llk::plus_sink(_mm512_reduce_add_ps(vsum), _mm512_cvtss_f32(vm), sink);
  }
};
using PrefillLanes = Lanes16;
#else
using PrefillLanes = Lanes8;
#endif

// A thread's buffers, reused from task to task.
struct PrefillScratch {
  std::vector<int64_t> token_offset;
  std::vector<float> kt, k_row, v_wide, qf, scores, inv_sum;
  std::vector<const float*> v_rows;
};

template <typename T, int64_t D, typename C = T>
void prefill_task(const PrefillArgs<T, C>& a, int64_t seq, int64_t h, PrefillScratch& s) {
  using L = PrefillLanes;
  using V = typename L::V;
  constexpr int64_t N = L::N, RS = 8, CH = 2, RP = N == 16 ? 8 : 4, DC = CH * N;
  static_assert(D % DC == 0 && RS % RP == 0, "head_dim must be a multiple of 2 vectors");
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t q_start = a.query_start[seq], q_len = a.query_start[seq + 1] - q_start, len = a.seq_lens[seq];
  if (q_len <= 0) return;
  const int64_t padded = (len + N - 1) / N * N;
  token_offsets(s.token_offset, a.block_tables + seq * a.max_blocks, a.block_size, len, len, a.num_kv_heads * D,
                h * D);
  const int64_t* offset = s.token_offset.data();

  s.kt.assign(D * padded, 0.f);  // kt[t / N][d][t % N]; tokens past len stay 0: finite scores, weight 0
  s.k_row.resize(D);
  s.v_rows.resize(len);
  if constexpr (!std::is_same_v<C, float>) s.v_wide.resize(len * D);
  float* kt = s.kt.data();
  for (int64_t t = 0; t < len; ++t) {
    const float* k = widen_row(a.k_cache + offset[t], s.k_row.data(), D);
    if constexpr (kIsCode<C>) scale_row<D>(s.k_row.data(), a.k_scale[offset[t] / D]);
    float* col = kt + (t / N) * D * N + t % N;
    for (int64_t d = 0; d < D; ++d) col[d * N] = k[d];
    if constexpr (std::is_same_v<C, float>) {
      s.v_rows[t] = a.v_cache + offset[t];
    } else {
      float* v = s.v_wide.data() + t * D;
      widen_row(a.v_cache + offset[t], v, D);
      if constexpr (kIsCode<C>) scale_row<D>(v, a.v_scale[offset[t] / D]);
      s.v_rows[t] = v;
    }
  }
  const float* const* v_rows = s.v_rows.data();

  s.qf.resize(RS * D);
  s.scores.resize(RS * padded);
  s.inv_sum.resize(RS);
  float* qf = s.qf.data();
  float* scores = s.scores.data();
  float* inv_sum = s.inv_sum.data();
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    const float sink = llk::sink_of(a.sinks, head);
    for (int64_t j0 = 0; j0 < q_len; j0 += RS) {
      const int64_t rows = std::min(RS, q_len - j0);
      const int64_t n_max = len - q_len + j0 + rows;  // tokens the block's last row sees
      for (int64_t r = 0; r < rows; ++r) {
        const T* q = a.q + ((q_start + j0 + r) * a.num_q_heads + head) * D;
        if constexpr (std::is_same_v<T, float>) std::copy(q, q + D, qf + r * D);
        else widen_row(q, qf + r * D, D);
        scale_row<D>(qf + r * D, a.scale);
      }
      std::fill(qf + rows * D, qf + RS * D, 0.f);
      const int64_t n_pad = (n_max + N - 1) / N * N;
      // A sliding window: row r sees [window_first(its position), its position]; tiles before the
      // block's first row's first key are skipped (t_begin = 0 without a window).
      const int64_t t_begin = llk::window_first(len - q_len + j0, a.window) / N * N;
      for (int64_t t0 = t_begin; t0 < n_max; t0 += N) {
        V acc[RS];
#pragma GCC unroll 8
        for (int64_t r = 0; r < RS; ++r) acc[r] = L::zero();
        const float* tile = kt + t0 * D;
        for (int64_t d = 0; d < D; ++d) {
          const V k = L::load(tile + d * N);
#pragma GCC unroll 8
          for (int64_t r = 0; r < RS; ++r) acc[r] = L::fmadd(L::set1(qf[r * D + d]), k, acc[r]);
        }
#pragma GCC unroll 8
        for (int64_t r = 0; r < RS; ++r) L::store(scores + r * padded + t0, acc[r]);
      }
      if (a.softcap > 0.f)
        for (int64_t r = 0; r < rows; ++r) llk::softcap_scores(scores + r * padded + t_begin, n_max - t_begin, a.softcap);
      for (int64_t r = 0; r < RS; ++r) {  // rows past `rows`: weight 0 everywhere
        float* s = scores + r * padded;
        if (r >= rows) {
          std::fill(s, s + n_pad, 0.f);
        } else if (a.window <= 0) {
          inv_sum[r] = L::softmax_prefix(s, len - q_len + j0 + r + 1, n_pad, sink);
        } else {  // keys before the window: -inf into the softmax (a weight below 1e-37), then exactly 0
          const int64_t pos = len - q_len + j0 + r, lo = llk::window_first(pos, a.window);
          std::fill(s + t_begin, s + lo, -std::numeric_limits<float>::infinity());
          inv_sum[r] = L::softmax_prefix(s + t_begin, pos + 1 - t_begin, n_pad - t_begin, sink);
          std::fill(s + t_begin, s + lo, 0.f);
        }
      }
      for (int64_t r0 = 0; r0 < rows; r0 += RP)
        for (int64_t d0 = 0; d0 < D; d0 += DC) {
          V acc[RP][CH];
          for (int64_t r = 0; r < RP; ++r)
            for (int64_t c = 0; c < CH; ++c) acc[r][c] = L::zero();
          const float* p = scores + r0 * padded;
          for (int64_t t = t_begin; t < n_max; ++t) {
            const float* v = v_rows[t] + d0;
            V vv[CH];
#pragma GCC unroll 4
            for (int64_t c = 0; c < CH; ++c) vv[c] = L::load(v + c * N);
#pragma GCC unroll 8
            for (int64_t r = 0; r < RP; ++r) {
              const V w = L::set1(p[r * padded + t]);
#pragma GCC unroll 4
              for (int64_t c = 0; c < CH; ++c) acc[r][c] = L::fmadd(w, vv[c], acc[r][c]);
            }
          }
          for (int64_t r = 0; r < RP && r0 + r < rows; ++r) {
            T* out = a.out + ((q_start + j0 + r0 + r) * a.num_q_heads + head) * D + d0;
            const V inv = L::set1(inv_sum[r0 + r]);
            alignas(64) float tmp[DC];
            for (int64_t c = 0; c < CH; ++c) L::store(tmp + c * N, L::mul(acc[r][c], inv));
            for (int64_t i = 0; i < DC; ++i) store(out + i, tmp[i]);
          }
        }
    }
  }
}

}  // namespace f32attn
