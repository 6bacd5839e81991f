// Native CPU kernels, one translation unit (torch's headers dominate the build time):
//
// - paged decode attention, the fused counterpart of kernels/decode_attention.py;
// - RMSNorm with the residual add, SiLU-and-mul and rotary embedding, fused counterparts of
//   kernels/rms_norm.py, activation.py and rotary.py: one pass over memory instead of one per torch
//   op. They reproduce the references' rounding step by step (a bf16 result is rounded wherever the
//   torch reference produces a bf16 tensor), so they agree with them to the last bit or so.
//
// Paged decode attention:
// The torch reference gathers every sequence's K/V blocks into a padded tensor and then runs SDPA:
// the KV bytes cross memory three times. Here a task walks its sequence's block table and reads
// each K and V row once: pass 1 scores every query head against K (a KV head serves its whole GQA
// group), a softmax per head, pass 2 accumulates V. Work is spread over torch's own thread pool
// (at::parallel_for), so it never competes with a second OpenMP runtime.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LLMCTL_AVX512_BF16 1
#endif
#include <limits>
#include <vector>

namespace {

inline float load(const float* p) { return *p; }
inline float load(const double* p) { return static_cast<float>(*p); }
inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(const at::Half* p) { return static_cast<float>(*p); }

// exp for the softmax, written so the compiler vectorizes it (libm's expf is scalar): range
// reduction x = n ln2 + r, a degree-6 polynomial for e^r on |r| <= ln2/2, 2^n through the exponent
// bits. Relative error about 2e-7, i.e. within a couple of float ulps; inputs are <= 0 here.
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : x;  // e^-87 ~ 1.6e-38: underflows to ~0 like expf, stays a normal float
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Each of ``rows`` score rows of length ``len`` becomes exp(s - max) in place; inv_sum[r] gets
// 1 / (its sum), to scale the accumulated V once at the end.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv_sum) {
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
    inv_sum[r] = 1.f / sum;
  }
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src + i);
}

// One task = one sequence and a run of its KV heads (all of them when there are enough sequences
// to keep every thread busy). Reading all heads of a token reads its cache row front to back, and
// a block's rows are contiguous, so the hardware prefetcher streams each block. HEAD_DIM > 0 fixes
// head_dim at compile time (64, 128); 0 is the generic fallback.
template <typename T, int64_t HEAD_DIM>
void decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_q_heads,
            int64_t num_kv_heads, int64_t runtime_head_dim, int64_t block_size, int64_t max_blocks,
            float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;  // elements per token in the cache
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int64_t rows = heads_per_task * group;  // query heads of one task
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), kv(heads_per_task * head_dim), scores,
        inv_sum(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, first_head = (task % tasks_per_seq) * heads_per_task;
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      const int64_t q_offset = (seq * num_q_heads + first_head * group) * head_dim;
      for (int64_t i = 0; i < rows * head_dim; ++i) qf[i] = load(q + q_offset + i) * scale;
      scores.assign(rows * len, 0.f);
      const int64_t kv_offset = first_head * head_dim, kv_len = heads_per_task * head_dim;
      auto row_of = [&](const T* cache, int64_t t) {
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        return cache + slot * row + kv_offset;
      };

      for (int64_t t = 0; t < len; ++t) {  // pass 1: scores
        load_row(row_of(k_cache, t), kv.data(), kv_len);
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = qf.data() + r * head_dim;
          const float* kr = kv.data() + (r / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kr[d];
          scores[r * len + t] = dot;
        }
      }
      softmax_rows(scores.data(), rows, len, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {  // pass 2: weighted sum of V
        load_row(row_of(v_cache, t), kv.data(), kv_len);
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * len + t];
          const float* vr = kv.data() + (r / group) * head_dim;
          float* a = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
        }
      }
      T* o = out + q_offset;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) o[r * head_dim + d] = static_cast<T>(acc[r * head_dim + d] * inv_sum[r]);
    }
  });
}

#ifdef LLMCTL_AVX512_BF16
// bf16 caches on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later): the scores use
// vdpbf16ps on bf16 q and K directly (exact bf16 products, fp32 sums), V is widened to fp32 with
// a shift. One task = one sequence; its KV heads one after another, so a head's 4 x (D/16)
// accumulators of the V pass stay in registers. Same result as the generic path up to fp32
// summation order.
template <int64_t D>
void decode_avx512_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens, at::BFloat16* out,
                        int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads, int64_t block_size,
                        int64_t max_blocks, float scale) {
  static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int64_t kChunks = D / 32;  // 32 bf16 per vdpbf16ps
  constexpr int64_t kLanes = D / 16;   // 16 fp32 per zmm
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t row = num_kv_heads * D;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> acc(group * kLanes);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      scores.resize(group * len);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const at::BFloat16* qh = q + (seq * num_q_heads + h * group) * D;
        auto slot_row = [&](const at::BFloat16* cache, int64_t t) {
          const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
          return reinterpret_cast<const uint16_t*>(cache + slot * row + h * D);
        };
        for (int64_t g = 0; g < group; ++g) {  // pass 1: scores of each query head of the group
          __m512bh qv[kChunks];
          for (int64_t c = 0; c < kChunks; ++c)
            qv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(qh + g * D) + 32 * c);
          float* s = scores.data() + g * len;
          for (int64_t t = 0; t < len; ++t) {
            const uint16_t* kr = slot_row(k_cache, t);
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < kChunks; ++c)
              dot = _mm512_dpbf16_ps(dot, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            s[t] = _mm512_reduce_add_ps(dot) * scale;
          }
        }
        float inv_sum[64];
        softmax_rows(scores.data(), group, len, inv_sum);
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {  // pass 2: sum of V weighted by each head's p
          const uint16_t* vr = slot_row(v_cache, t);
          __m512 v[kLanes];
          for (int64_t l = 0; l < kLanes; ++l)
            v[l] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * l))), 16));
          for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t]);
            for (int64_t l = 0; l < kLanes; ++l) acc[g * kLanes + l] = _mm512_fmadd_ps(p, v[l], acc[g * kLanes + l]);
          }
        }
        at::BFloat16* o = out + (seq * num_q_heads + h * group) * D;
        for (int64_t g = 0; g < group; ++g) {
          alignas(64) float tmp[D];
          const __m512 inv = _mm512_set1_ps(inv_sum[g]);
          for (int64_t l = 0; l < kLanes; ++l) _mm512_store_ps(tmp + 16 * l, _mm512_mul_ps(acc[g * kLanes + l], inv));
          for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<at::BFloat16>(tmp[d]);
        }
      }
    }
  });
}
#endif

// Round through T: the value a torch op computing in fp32 and producing a T tensor would give.
template <typename T>
inline float through(float x) {
  return static_cast<float>(static_cast<T>(x));
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, Hq, D], cache [NB, BS, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes disagree");
  if (num_seqs == 0) return out;
#ifdef LLMCTL_AVX512_BF16
  if (q.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128) && num_q_heads / num_kv_heads <= 64 &&
      num_seqs >= at::get_num_threads()) {
    auto kernel = head_dim == 64 ? decode_avx512_bf16<64> : decode_avx512_bf16<128>;
    kernel(q.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(), value_cache.data_ptr<at::BFloat16>(),
           bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(), num_seqs, num_q_heads,
           num_kv_heads, block_size, bt.size(1), static_cast<float>(scale));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
             bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_seqs, num_q_heads,
             num_kv_heads, head_dim, block_size, bt.size(1), static_cast<float>(scale));
    };
    if (head_dim == 64) run(decode<scalar_t, 64>);
    else if (head_dim == 128) run(decode<scalar_t, 128>);
    else run(decode<scalar_t, 0>);
  });
  return out;
}

// ---- RMSNorm (+ residual) ------------------------------------------------------------------------
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "x [N, H], weight [H]");
  auto xc = x.contiguous();
  auto w = weight.contiguous().to(x.scalar_type());
  auto out = torch::empty_like(xc);
  auto new_residual = residual.has_value() ? torch::empty_like(xc) : xc;
  auto rc = residual.has_value() ? residual->contiguous() : xc;
  const int64_t rows = xc.size(0), hidden = xc.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = rc.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* hp = new_residual.data_ptr<scalar_t>();
    const bool add = residual.has_value();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> h(hidden);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        float sum = 0.f;
        for (int64_t i = 0; i < hidden; ++i) {
          float v = load(xp + base + i);
          if (add) {
            const scalar_t sum_t = static_cast<scalar_t>(v + load(rp + base + i));
            hp[base + i] = sum_t;
            v = static_cast<float>(sum_t);
          }
          h[i] = v;
          sum += v * v;
        }
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
        for (int64_t i = 0; i < hidden; ++i)
          op[base + i] = static_cast<scalar_t>(load(wp + i) * through<scalar_t>(h[i] * inv));
      }
    });
  });
  return {out, new_residual};
}

// ---- SiLU-and-mul -------------------------------------------------------------------------------
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x [N, 2 * d]");
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), d = xc.size(1) / 2;
  auto out = torch::empty({rows, d}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * d;
        const scalar_t* up = gate + d;
        scalar_t* o = op + r * d;
        for (int64_t i = 0; i < d; ++i) {
          const float g = load(gate + i);
          const float silu = through<scalar_t>(g / (1.f + fast_exp(-g)));
          o[i] = static_cast<scalar_t>(silu * load(up + i));
        }
      }
    });
  });
  return out;
}

// ---- rotary embedding (rotate-half layout) ------------------------------------------------------
torch::Tensor rotate(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin_cache) {
  // x [T, H, D] (any strides with a contiguous last dim) -> a new contiguous [T, H, D]
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [T, H, D] with a contiguous last dim");
  auto pos = positions.to(at::kLong).contiguous();
  auto cache = cos_sin_cache.to(at::kFloat).contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), rot = cache.size(1), half = rot / 2;
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float* cp = cache.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> cos_t(half), sin_t(half);
      for (int64_t t = begin; t < end; ++t) {
        const float* row = cp + pp[t] * rot;
        for (int64_t i = 0; i < half; ++i) {  // the reference casts cos/sin to the activations' dtype
          cos_t[i] = through<scalar_t>(row[i]);
          sin_t[i] = through<scalar_t>(row[half + i]);
        }
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* xi = xp + t * s0 + h * s1;
          scalar_t* o = op + (t * heads + h) * dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = load(xi + i), x2 = load(xi + half + i);
            o[i] = static_cast<scalar_t>(through<scalar_t>(x1 * cos_t[i]) + through<scalar_t>(-x2 * sin_t[i]));
            o[half + i] = static_cast<scalar_t>(through<scalar_t>(x2 * cos_t[i]) + through<scalar_t>(x1 * sin_t[i]));
          }
          for (int64_t i = rot; i < dim; ++i) o[i] = xi[i];
        }
      }
    });
  });
  return out;
}

// ---- KV store --------------------------------------------------------------------------------
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor slot_mapping) {
  // key/value [T, Hkv, D] (rows may be strided, last two dims contiguous), caches [NB, BS, Hkv, D]
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "K/V and cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = key.size(0), row = key_cache.size(2) * key_cache.size(3);
  auto copy = [&](const torch::Tensor& src, torch::Tensor& dst) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V into the paged cache through the slot mapping (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with optional fused residual add (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("rotate", &rotate, "Rotary embedding, rotate-half layout (CPU)");
}
