// Paged decode attention for CPUs: the fused counterpart of kernels/decode_attention.py's torch
// reference (same arguments, same result up to rounding).
//
// The torch reference gathers every sequence's K/V blocks into a padded tensor and then runs SDPA:
// the KV bytes cross memory three times. Here a task walks its sequence's block table and reads
// each K and V row once: pass 1 scores every query head against K (a KV head serves its whole GQA
// group), a softmax per head, pass 2 accumulates V. Work is spread over torch's own thread pool
// (at::parallel_for), so it never competes with a second OpenMP runtime.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
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
      for (int64_t r = 0; r < rows; ++r) {  // softmax, one row per query head
        float* s = scores.data() + r * len;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
