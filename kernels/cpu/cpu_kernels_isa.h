// The per-ISA bodies of the native CPU kernels. cpu_kernels.cpp includes this file once per
// instruction set (generic x86-64, AVX2+FMA, AVX-512), each time inside its own namespace and
// under a `#pragma GCC target`, so the compiler vectorizes the same loops for each ISA and the
// module picks one at run time from the CPU's flags. No -march=native: one build runs anywhere.
//
// Everything here works on raw pointers over a range of rows/tasks; the threading
// (at::parallel_for) and the tensor checks live in cpu_kernels.cpp, outside the target regions.
// Storage types: float, at::BFloat16 (read and rounded with bit operations, which vectorize) and
// at::Half (generic variant only). Arithmetic is fp32; with -ffp-contract=off a product and a sum
// round separately, as torch's elementwise ops do, so rotary and the residual add match torch bit
// for bit; sums over a row (RMSNorm, attention dots) differ from torch in order only.

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  const uint32_t bits = static_cast<uint32_t>(p->x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(const at::Half* p) { return static_cast<float>(*p); }

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  p->x = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}
inline void store(at::Half* p, float v) { *p = static_cast<at::Half>(v); }

// Round through T: the value a torch op computing in fp32 and producing a T tensor would give.
template <typename T>
inline float through(float x) {
  T t;
  store(&t, x);
  return load(&t);
}

#include "fast_exp.h"

// Each of ``rows`` score rows of length ``len`` becomes exp(s - max) in place; inv_sum[r] gets
// 1 / (its sum, with the sink's share of query head first_head + r), to scale the accumulated V
// once at the end.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv_sum, const float* sinks,
                         int64_t first_head) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = fast_exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[r] = 1.f / llk::plus_sink(sum, m, llk::sink_of(sinks, first_head + r));
  }
}

// A cache row as fp32: fp32 caches are read in place, others are widened into ``buffer``.
template <typename T>
inline const float* row_as_float(const T* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = load(src + i);
    return buffer;
  }
}

// Paged decode attention over tasks [begin, end). One task = one sequence and a run of its KV
// heads (all of them when there are enough sequences to keep every thread busy). Pass 1 scores
// every query head of the run against each K row (a KV head serves its whole GQA group), a
// softmax per head, pass 2 accumulates V. Reading all heads of a token reads its cache row front
// to back, and a block's rows are contiguous, so the hardware prefetcher streams each block.
// HEAD_DIM > 0 fixes head_dim at compile time (64, 128); 0 is the generic fallback.
template <typename T, int64_t HEAD_DIM>
void decode_tasks(const DecodeArgs<T>& a, int64_t begin, int64_t end) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : a.head_dim;
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * head_dim;  // elements per token in the cache
  const int64_t tasks_per_seq = a.num_kv_heads / a.heads_per_task;
  const int64_t rows = a.heads_per_task * group;  // query heads of one task
  const int64_t kv_len = a.heads_per_task * head_dim;
  std::vector<float> qf(rows * head_dim), acc(rows * head_dim), kv(kv_len), scores, inv_sum(rows);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / tasks_per_seq, first_head = (task % tasks_per_seq) * a.heads_per_task;
    const int64_t first = llk::window_first(a.seq_lens[seq] - 1, a.window);  // the keys [first, seq_len)
    const int64_t len = a.seq_lens[seq] - first;
    const int32_t* table = a.block_tables + seq * a.max_blocks;
    const int64_t q_offset = (seq * a.num_q_heads + first_head * group) * head_dim;
    for (int64_t i = 0; i < rows * head_dim; ++i) qf[i] = load(a.q + q_offset + i) * a.scale;
    scores.assign(rows * len, 0.f);
    const int64_t kv_offset = first_head * head_dim;
    auto row_of = [&](const T* cache, int64_t i) {  // key first + i
      const int64_t t = first + i;
      const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size;
      return cache + slot * row + kv_offset;
    };
    for (int64_t t = 0; t < len; ++t) {  // pass 1: scores
      const float* k = row_as_float(row_of(a.k_cache, t), kv.data(), kv_len);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qf.data() + r * head_dim;
        const float* kr = k + (r / group) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kr[d];
        scores[r * len + t] = dot;
      }
    }
    if (a.softcap > 0.f) llk::softcap_scores(scores.data(), rows * len, a.softcap);
    softmax_rows(scores.data(), rows, len, inv_sum.data(), a.sinks, first_head * group);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < len; ++t) {  // pass 2: weighted sum of V
      const float* v = row_as_float(row_of(a.v_cache, t), kv.data(), kv_len);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * len + t];
        const float* vr = v + (r / group) * head_dim;
        float* out = acc.data() + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p * vr[d];
      }
    }
    T* o = a.out + q_offset;
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = inv_sum[r];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) store(o + r * head_dim + d, acc[r * head_dim + d] * inv);
    }
  }
}

#ifdef LLK_ISA_HAS_AVX2
#include "attention_f32.h"
#endif

template <typename T>
void decode_range(const DecodeArgs<T>& a, int64_t begin, int64_t end) {
#ifdef LLK_ISA_HAS_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {  // the intrinsics kernel
    if (a.head_dim == 64) return f32attn::decode_tasks<T, 64>(a, begin, end);
    if (a.head_dim == 128) return f32attn::decode_tasks<T, 128>(a, begin, end);
  }
#endif
  if (a.head_dim == 64) decode_tasks<T, 64>(a, begin, end);
  else if (a.head_dim == 128) decode_tasks<T, 128>(a, begin, end);
  else decode_tasks<T, 0>(a, begin, end);
}

#ifdef LLK_ISA_HAS_AVX2
// Decode attention over 8-bit codes (C = Int8Code, Fp8E4m3Code, Fp8E5m2Code), head_dim 64 or 128
// (the caller checks): the intrinsics kernel with the rows' scales applied.
template <typename T, typename C>
void decode_codes_range(const DecodeArgs<T, C>& a, int64_t begin, int64_t end) {
  if (a.head_dim == 64) f32attn::decode_tasks<T, 64, C>(a, begin, end);
  else f32attn::decode_tasks<T, 128, C>(a, begin, end);
}
#endif

// Quantize-on-store for the 8-bit KV formats, as kernels/kv_quant.py's quantize_per_token rounds:
// scale = amax / qmax, code = x / scale (scale 0: x / 1) rounded to the code type (int8: to
// nearest even, clamped to +-127; fp8: torch's own conversion). Tokens [begin, end) of x
// [tokens, heads, D] (token stride x_stride floats, heads contiguous) go to rows slot * heads + h
// of codes [*, D] and scales; slot < 0 is skipped.
template <typename C>
inline C to_code(float v) {
  if constexpr (std::is_same_v<C, Int8Code>) {
    const float r = std::nearbyint(v);
    return C{static_cast<int8_t>(r < -127.f ? -127.f : (r > 127.f ? 127.f : r))};
  } else if constexpr (std::is_same_v<C, Fp8E4m3Code>) {
    return C{c10::Float8_e4m3fn(v).x};
  } else {
    return C{c10::Float8_e5m2(v).x};
  }
}

template <typename C>
void quantize_rows(const float* x, int64_t x_stride, int64_t heads, int64_t D, const int64_t* slots, float qmax,
                   C* codes, float* scales, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const float* src = x + t * x_stride + h * D;
      const int64_t out_row = slots[t] * heads + h;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
      const float scale = amax / qmax;
      const float divisor = scale > 0.f ? scale : 1.f;
      C* out = codes + out_row * D;
      for (int64_t d = 0; d < D; ++d) out[d] = to_code<C>(src[d] / divisor);
      scales[out_row] = scale;
    }
  }
}

// RMSNorm of rows [begin, end), with the residual add first when ``res`` is set: the add rounds
// to T (new_res), the norm runs in fp32, rounds to T, then scales by the weight, as HF does.
template <typename T>
void rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* new_res, int64_t begin, int64_t end,
                   int64_t hidden, float eps) {
  std::vector<float> h(hidden);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t base = r * hidden;
    float sum = 0.f;
    if (res != nullptr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = through<T>(load(x + base + i) + load(res + base + i));
        store(new_res + base + i, v);
        h[i] = v;
        sum += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = load(x + base + i);
        h[i] = v;
        sum += v * v;
      }
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) store(out + base + i, load(w + i) * through<T>(h[i] * inv));
  }
}

#ifdef LLK_ISA_HAS_AVX512
// 16 lanes of bf16 as fp32 (exact), and back rounded as store() rounds (nearest even, NaN 0x7fc0).
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512i bf16_bits16(__m512 v) {  // the rounded bf16 in the low half of each lane
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}
inline __m512 through16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
#endif

// SiLU(gate) * up over rows [begin, end) of x = [gate | up]; SiLU is rounded to T before the
// multiply, as F.silu(gate) * up rounds it.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t begin, int64_t end, int64_t d) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * 2 * d;
    const T* up = gate + d;
    T* o = out + r * d;
    int64_t i = 0;
#ifdef LLK_ISA_HAS_AVX512
    // bf16 in explicit 16-lane steps: the auto-vectorized loop spent most of its time converting
    // to and from bf16 (141 against 92 us for fp32 at 64 x 5,632 on a 2-core AMX Xeon; this: see
    // docs/benchmarks.md, "Elementwise kernels"). Same operations; exp16 fuses its multiply-adds.
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      for (; i + 16 <= d; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = f32attn::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        store16(o + i, _mm512_mul_ps(through16(silu), load16(up + i)));
      }
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < d; ++j) {
      const float g = load(gate + j);
      store(o + j, through<T>(g / (1.f + fast_exp(-g))) * load(up + j));
    }
  }
}

// Rotate-half rotary embedding of tokens [begin, end): x [T, H, D] with strides (s0, s1, 1), out a
// contiguous [T, H, D]; cos/sin are rounded to T first, as the reference casts them.
template <typename T>
void rotate_rows(const T* x, int64_t s0, int64_t s1, const int64_t* positions, const float* cache, T* out,
                 int64_t begin, int64_t end, int64_t heads, int64_t dim, int64_t rot) {
  const int64_t half = rot / 2;
  std::vector<float> cos_t(half), sin_t(half);
  for (int64_t t = begin; t < end; ++t) {
    const float* row = cache + positions[t] * rot;
    for (int64_t i = 0; i < half; ++i) {
      cos_t[i] = through<T>(row[i]);
      sin_t[i] = through<T>(row[half + i]);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const T* xi = x + t * s0 + h * s1;
      T* o = out + (t * heads + h) * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(xi + i), x2 = load(xi + half + i);
        store(o + i, through<T>(x1 * cos_t[i]) + through<T>(-x2 * sin_t[i]));
        store(o + half + i, through<T>(x2 * cos_t[i]) + through<T>(x1 * sin_t[i]));
      }
      for (int64_t i = rot; i < dim; ++i) o[i] = xi[i];
    }
  }
}
