// The per-ISA body of the quantized-KV decode kernel. kv_quant_attention.cpp includes this file
// twice: in namespace `generic` (plain C++, any x86-64 or other CPU) and in namespace `avx2` under
// `#pragma GCC target("avx2,fma,f16c")` with LLK_KVQ_AVX2 defined, where the row helpers use
// intrinsics. The module picks one at run time (kernels/kv_quant_native.py, from the CPU flags).
//
// The cache is never dequantized as a whole: each (sequence, KV head) task decodes one K or V row
// (head_dim values) at a time into a small fp32 buffer and uses it for every query head of its GQA
// group at once. Accumulation is fp32 throughout.

#include "fast_exp.h"

// ---- row helpers -------------------------------------------------------------------------------
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef LLK_KVQ_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  sum = _mm_cvtss_f32(s);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += p * x
inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += p * x[i];
}

// A full-precision row (query, KIVI residual) to fp32.
inline void widen(const float* x, float* out, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
inline void widen(const at::BFloat16* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}
inline void widen(const at::Half* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// One float16 scale or zero (F16C where compiled in; c10's software conversion otherwise).
inline float half_value(at::Half h) {
#ifdef LLK_KVQ_AVX2
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// fp8 codes through the 256-entry table of their values (exact: every fp8 value is a float).
inline void fp8_row(const uint8_t* codes, const float* lut, float* out, int64_t n) {
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_i32gather_ps(lut, idx, 4));
  }
#endif
  for (; i < n; ++i) out[i] = lut[codes[i]];
}

inline void int8_row(const int8_t* codes, float* out, int64_t n) {
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)))));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(codes[i]);
}

// KIVI codes, packed little end first (kernels/kv_quant.py: pack_codes), to fp32 code values.
inline void unpack_row(const uint8_t* packed, int bits, float* out, int64_t n) {
  const int per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
  int64_t i = 0;
#ifdef LLK_KVQ_AVX2
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i shifts = _mm256_mullo_epi32(lanes, _mm256_set1_epi32(bits));
  const __m256i maskv = _mm256_set1_epi32(static_cast<int>(mask));
  for (; i + 8 <= n; i += 8) {  // 8 codes = bits bytes, read with a constant size (no memcpy call)
    uint32_t word = 0;
    if (bits == 2) {
      uint16_t half;
      std::memcpy(&half, packed + (i * bits >> 3), sizeof half);
      word = half;
    } else {
      std::memcpy(&word, packed + (i * bits >> 3), sizeof word);
    }
    const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), maskv);
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(v));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<float>((packed[i / per_byte] >> ((i % per_byte) * bits)) & mask);
}

#ifdef LLK_KVQ_AVX2
#include "attention_tiles.h"

// KIVI at head_dim D (64 or 128), block size and value group multiples of 8: the float kernels'
// score tiles and V chunks (attention_tiles.h) over rows dequantized to fp32 once per token, as
// kernels/kv_quant.py's dequantize_kivi_keys / _values compute them (code * scale + zero), and
// shared by the GQA group's query heads; blocks in the residual window are read from the
// full-precision residual as they are (fp32 rows in place).
template <typename T, int64_t D>
void kivi_decode_task(const KvqArgs<T>& a, int64_t task, std::vector<float>& scratch) {
  const int64_t seq = task / a.num_kv_heads, h = task % a.num_kv_heads;
  const int64_t len = a.seq_lens[seq];
  const int64_t G = a.num_q_heads / a.num_kv_heads, bs = a.block_size, H = a.num_kv_heads;
  const int64_t packed = D * a.bits / 8, vgroups = D / a.value_group;
  T* out = a.out + (seq * a.num_q_heads + h * G) * D;
  const int64_t padded = (len + kScoreTile - 1) / kScoreTile * kScoreTile;
  scratch.resize(2 * G * D + G * padded + G + 2 * D + kValueChunk * D);
  float* qf = scratch.data();          // [G, D] query heads times the attention scale
  float* acc = qf + G * D;             // [G, D] sum of p * V
  float* scores = acc + G * D;         // [G, padded]
  float* inv_sum = scores + G * padded;  // [G]
  float* key_scale = inv_sum + G;      // [D] the block's per-channel key scale
  float* key_zero = key_scale + D;     // [D] and zero
  float* rows = key_zero + D;          // [kValueChunk, D] dequantized K or V rows
  widen(a.q + (seq * a.num_q_heads + h * G) * D, qf, G * D);
  for (int64_t i = 0; i < G * D; ++i) qf[i] *= a.scale;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t first_key = llk::window_first(len - 1, a.window), first_block = first_key / bs;

  // The fp32 row of token t of block b (a row of `rows` when it has to be dequantized or widened).
  auto residual_row = [&](const T* residual, int64_t slot, int64_t t, float* buffer) -> const float* {
    const T* src = residual + ((slot * bs + t) * H + h) * D;
    if constexpr (std::is_same_v<T, float>) return src;
    widen(src, buffer, D);
    return buffer;
  };

  const float* tile[kScoreTile];
  for (int64_t blk = first_block; blk < num_blocks; ++blk) {  // pass 1: scores
    const int64_t b = table[blk], first = blk * bs, n = std::min(bs, len - first);
    const int64_t slot = a.residual_table[b];
    if (slot < 0) {
      widen(a.kivi_k_scale + (b * H + h) * D, key_scale, D);
      widen(a.kivi_k_zero + (b * H + h) * D, key_zero, D);
    }
    for (int64_t t0 = 0; t0 < n; t0 += kScoreTile) {
      for (int64_t j = 0; j < kScoreTile; ++j) {
        const int64_t t = t0 + j;
        float* row = rows + j * D;
        if (t >= n) {
          tile[j] = tile[0];  // past the block's end: any real row, its score is not used
        } else if (slot >= 0) {
          tile[j] = residual_row(a.residual_k, slot, t, row);
        } else {
          unpack_row(a.k + ((b * bs + t) * H + h) * packed, a.bits, row, D);
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(row + d, _mm256_fmadd_ps(_mm256_loadu_ps(row + d), _mm256_loadu_ps(key_scale + d),
                                                      _mm256_loadu_ps(key_zero + d)));
          tile[j] = row;
        }
      }
      for (int64_t g = 0; g < G; ++g)
        _mm256_storeu_ps(scores + g * padded + first + t0, score_tile<D>(qf + g * D, tile));
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // over the keys [first_key, len); those before weigh 0
    float* s = scores + g * padded;
    if (a.softcap > 0.f) llk::softcap_scores(s + first_key, len - first_key, a.softcap);
    std::fill(s + first_block * bs, s + first_key, 0.f);
    inv_sum[g] = softmax_row(s + first_key, len - first_key);
  }

  std::fill(acc, acc + G * D, 0.f);
  const float* chunk[kValueChunk];
  for (int64_t blk = first_block; blk < num_blocks; ++blk) {  // pass 2: sum of p * V
    const int64_t b = table[blk], first = blk * bs, n = std::min(bs, len - first);
    const int64_t slot = a.residual_table[b];
    for (int64_t t0 = 0; t0 < n; t0 += kValueChunk) {
      const int64_t c = std::min(kValueChunk, n - t0);
      for (int64_t j = 0; j < c; ++j) {
        const int64_t t = t0 + j;
        float* row = rows + j * D;
        if (slot >= 0) {
          chunk[j] = residual_row(a.residual_v, slot, t, row);
          continue;
        }
        const int64_t r = (b * bs + t) * H + h;
        unpack_row(a.v + r * packed, a.bits, row, D);
        for (int64_t k = 0; k < vgroups; ++k) {
          const __m256 scale = _mm256_set1_ps(half_value(a.kivi_v_scale[r * vgroups + k]));
          const __m256 zero = _mm256_set1_ps(half_value(a.kivi_v_zero[r * vgroups + k]));
          for (int64_t d = k * a.value_group; d < (k + 1) * a.value_group; d += 8)
            _mm256_storeu_ps(row + d, _mm256_fmadd_ps(_mm256_loadu_ps(row + d), scale, zero));
        }
        chunk[j] = row;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t half = 0; half < D; half += 64)
          accumulate_v64(acc + g * D + half, scores + g * padded + first + t0, chunk, c, half);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
}
#endif

// ---- one (sequence, KV head) ---------------------------------------------------------------------
template <typename T>
void decode_task(const KvqArgs<T>& a, int64_t task, std::vector<float>& scratch) {
  const int64_t seq = task / a.num_kv_heads, h = task % a.num_kv_heads;
  const int64_t len = a.seq_lens[seq];
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads, bs = a.block_size, H = a.num_kv_heads;
  const int64_t packed = a.kind == kKivi ? D * a.bits / 8 : D;
  const int64_t vgroups = a.kind == kKivi ? D / a.value_group : 1;
  T* out = a.out + (seq * a.num_q_heads + h * G) * D;
  if (len <= 0) {
    for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(0.f);
    return;
  }
#ifdef LLK_KVQ_AVX2
  if (a.kind == kKivi && bs % kScoreTile == 0 && a.value_group % 8 == 0) {
    if (D == 64) return kivi_decode_task<T, 64>(a, task, scratch);
    if (D == 128) return kivi_decode_task<T, 128>(a, task, scratch);
  }
#endif
  scratch.resize(3 * G * D + D + G * len + G * vgroups + 2 * G);
  float* qf = scratch.data();        // [G, D] the group's query heads
  float* qs = qf + G * D;            // [G, D] KIVI: query * key scale of the current block
  float* acc = qs + G * D;           // [G, D] sum of p * V
  float* row = acc + G * D;          // [D] one dequantized K or V row
  float* scores = row + D;           // [G, len]
  float* zacc = scores + G * len;    // [G, vgroups] KIVI: sum of p * value zero
  float* qz = zacc + G * vgroups;    // [G] KIVI: query . key zero of the current block
  float* inv_sum = qz + G;           // [G]
  widen(a.q + (seq * a.num_q_heads + h * G) * D, qf, G * D);
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t first_key = llk::window_first(len - 1, a.window), first_block = first_key / bs;

  // pass 1: scores
  for (int64_t blk = first_block; blk < num_blocks; ++blk) {
    const int64_t b = table[blk], first = blk * bs, n = std::min(bs, len - first);
    const int64_t slot = a.residual_table != nullptr ? a.residual_table[b] : -1;
    if (slot >= 0) {  // KIVI block still in the residual window: full precision
      for (int64_t t = 0; t < n; ++t) {
        widen(a.residual_k + ((slot * bs + t) * H + h) * D, row, D);
        for (int64_t g = 0; g < G; ++g) scores[g * len + first + t] = dot(qf + g * D, row, D) * a.scale;
      }
    } else if (a.kind == kKivi) {  // k = code * scale[d] + zero[d]: fold the scale into q once per block
      const at::Half* ks = a.kivi_k_scale + (b * H + h) * D;
      const at::Half* kz = a.kivi_k_zero + (b * H + h) * D;
      widen(kz, row, D);
      for (int64_t g = 0; g < G; ++g) qz[g] = dot(qf + g * D, row, D);
      widen(ks, row, D);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = qf[g * D + d] * row[d];
      for (int64_t t = 0; t < n; ++t) {
        unpack_row(a.k + ((b * bs + t) * H + h) * packed, a.bits, row, D);
        for (int64_t g = 0; g < G; ++g) scores[g * len + first + t] = (dot(qs + g * D, row, D) + qz[g]) * a.scale;
      }
    } else {  // per-token scale
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = (b * bs + t) * H + h;
        if (a.kind == kFp8) fp8_row(a.k + r * D, a.lut, row, D);
        else int8_row(reinterpret_cast<const int8_t*>(a.k) + r * D, row, D);
        const float s = a.k_scale[r] * a.scale;
        for (int64_t g = 0; g < G; ++g) scores[g * len + first + t] = dot(qf + g * D, row, D) * s;
      }
    }
  }

  // softmax per query head over the keys [first_key, len); those before weigh 0
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * len;
    if (a.softcap > 0.f) llk::softcap_scores(s + first_key, len - first_key, a.softcap);
    for (int64_t t = first_block * bs; t < first_key; ++t) s[t] = 0.f;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = first_key; t < len; ++t) mx = std::max(mx, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = first_key; t < len; ++t) {
      s[t] = fast_exp(s[t] - mx);
      sum += s[t];
    }
    inv_sum[g] = 1.f / sum;
  }

  // pass 2: sum of p * V
  std::fill(acc, acc + G * D, 0.f);
  std::fill(zacc, zacc + G * vgroups, 0.f);
  for (int64_t blk = first_block; blk < num_blocks; ++blk) {
    const int64_t b = table[blk], first = blk * bs, n = std::min(bs, len - first);
    const int64_t slot = a.residual_table != nullptr ? a.residual_table[b] : -1;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t r = (b * bs + t) * H + h;
      if (slot >= 0) {
        widen(a.residual_v + ((slot * bs + t) * H + h) * D, row, D);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * len + first + t], row, acc + g * D, D);
      } else if (a.kind == kKivi) {  // v = code * scale[group] + zero[group]
        unpack_row(a.v + r * packed, a.bits, row, D);
        const at::Half* vs = a.kivi_v_scale + r * vgroups;
        const at::Half* vz = a.kivi_v_zero + r * vgroups;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + first + t];
          for (int64_t k = 0; k < vgroups; ++k) {
            const int64_t off = k * a.value_group;
            axpy(p * half_value(vs[k]), row + off, acc + g * D + off, a.value_group);
            zacc[g * vgroups + k] += p * half_value(vz[k]);
          }
        }
      } else {
        if (a.kind == kFp8) fp8_row(a.v + r * D, a.lut, row, D);
        else int8_row(reinterpret_cast<const int8_t*>(a.v) + r * D, row, D);
        const float s = a.v_scale[r];
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * len + first + t] * s, row, acc + g * D, D);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      const float zero = a.kind == kKivi ? zacc[g * vgroups + d / a.value_group] : 0.f;
      out[g * D + d] = static_cast<T>((acc[g * D + d] + zero) * inv_sum[g]);
    }
}
