// fp32 GEMM for linear layers whose weight was packed once at load into panels of 16 output
// columns: w_packed[p, k, c] = w[16 p + c, k] (zero past the last column). Computes
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), the torch reference being
// kernels/fp32_linear.py (pack_panels, fp32_linear_torch).
//
// Why not torch's GEMM: on an AMD Zen 3 (AVX2+FMA), MKL reaches ~90 GFLOP/s per core on 1024^3 but
// only ~58-64 at decode shapes (M <= 64 rows against 1024 x 5,632 or x 32,000), where OpenBLAS gets
// ~78: a step of a batched decode is almost all of these products. Here the packed panel makes every
// k step two aligned loads of w per row tile, with 12 accumulators (6 rows x 16 columns in AVX2)
// kept in registers; tails of few rows take several panels at once so that the FMA latency stays
// covered at M = 1..5 too. Work is split over output panels with at::parallel_for (torch's pool).
//
// Batch invariance (batched == unbatched, bitwise): see gemm_kernels_isa.h; every variant below,
// the scalar one included, computes each output element with the same sequence of FMAs.
//
// Run-time ISA dispatch (isa.h): the variants compiled in `#pragma GCC target` regions, `set_isa`
// (from kernels/cpu_features.py) picks one. The AVX-512
// variant: one zmm per panel, 6 rows x 4 panels = 24 accumulators (measured on a Zen 5 against
// 8 x 3 and 7 x 4: 8 x 3 reached 164-167 GFLOP/s a core, 6 x 4 185-193, as oneDNN's prepacked
// kernel; docs/benchmarks.md); the tests compare it bitwise with the generic one.
//
// Declared in gemm_kernels.h (the decode loop calls llk::gemm::linear; bindings.cpp binds it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gemm_kernels.h"
#include "isa.h"

#ifdef LLK_X86_VARIANTS
#include <immintrin.h>
#endif

// Only the explicit FMAs fuse, so every variant (the scalar one included) does the same arithmetic.
#pragma GCC optimize("fp-contract=off")

namespace {

struct GemmArgs {
  const float* x;  // [m, ldx], rows of the input
  const float* w;  // [ceil(n / 16), k, 16], packed panels
  const float* bias;  // [n] or null
  float* y;        // [m, ldy]
  int64_t m, n, k, ldx, ldy;
};

constexpr int64_t KC = 256;  // K block: 16 KiB of a panel, kept in L1 across a block of rows
constexpr int64_t MC = 144;  // rows a K block of x keeps in L2 (144 x 256 x 4 B = 144 KiB)
// k steps ahead that a tile prefetches its panel (2 KiB): a decode step streams the packed weight
// from memory, and a panel's next K block follows its current one.
constexpr int64_t PREFETCH_K = 32;
// Every AHEAD_EVERY k steps a tile also asks for one line of the block its group reads next, into
// L2. Why: of a block's row tiles only the first reads the weights from memory, so at decode
// shapes (64 rows: 11 tiles) the weight stream came in bursts, one tile in 11 waiting on memory
// with the rest idle; spread over the tiles, the next block arrives while the current one is
// computed (2-core Zen 3, 64 x 1024 -> 5632, 40 interleaved pairs: median 1.05-1.06x, faster in
// 34-36 of 40; prefill shapes unchanged; docs/benchmarks.md, "fp32 GEMM").
constexpr int64_t AHEAD_EVERY = 8;

namespace generic {
using V = float;
constexpr int VW = 1, CHAINS = 64, ROWS = 4, GROUP = 1;
inline V vzero() { return 0.f; }
inline V vload(const float* p) { return *p; }
inline V vbcast(const float* p) { return *p; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
inline void vstore(float* p, V v) { *p = v; }
inline void prefetch(const float* p) { __builtin_prefetch(p); }
inline void prefetch_l2(const float* p) { __builtin_prefetch(p, 0, 2); }
#include "gemm_kernels_isa.h"
}  // namespace generic

#ifdef LLK_X86_VARIANTS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using V = __m256;
constexpr int VW = 8, CHAINS = 12, ROWS = 6, GROUP = 6;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
#include "gemm_kernels_isa.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
using V = __m512;
constexpr int VW = 16, CHAINS = 24, ROWS = 6, GROUP = 12;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
#include "gemm_kernels_isa.h"
}  // namespace avx512
#pragma GCC pop_options
#endif

enum class Variant { kGeneric, kAvx2, kAvx512 };
Variant g_isa = Variant::kGeneric;

}  // namespace

namespace llk::gemm {

std::vector<std::string> compiled_isas() {
#ifdef LLK_X86_VARIANTS
  return {"generic", "avx2", "avx512"};
#else
  return {"generic"};
#endif
}

// `avx512bf16` (a level of kernels/cpu_features.py) runs the avx512 variant: no bf16 here.
std::string set_isa(const std::string& name) {
  llk::Isa level;
  TORCH_CHECK(llk::parse_isa(name, &level), "fp32 GEMM: no kernel variant for ISA '", name, "'");
  g_isa = level >= llk::Isa::kAvx512 ? Variant::kAvx512 : level == llk::Isa::kAvx2 ? Variant::kAvx2 : Variant::kGeneric;
  return name;
}

}  // namespace llk::gemm

namespace {

void gemm_panels(const GemmArgs& a, int64_t p0, int64_t p1) {
#ifdef LLK_X86_VARIANTS
  if (g_isa == Variant::kAvx512) return avx512::gemm_panels(a, p0, p1);
  if (g_isa == Variant::kAvx2) return avx2::gemm_panels(a, p0, p1);
#endif
  generic::gemm_panels(a, p0, p1);
}

// y[m, :n] = x[m, :k] @ w^T (+ bias) for m < rows, w packed as [ceil(n / 16), k, 16]; rows of x
// and y at strides ldx and ldy. Spread over torch's threads by output panels.
void gemm(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t n, int64_t k,
          const float* bias, float* y, int64_t ldy) {
  if (rows == 0) return;
  const GemmArgs a{x, packed, bias, y, rows, n, k, ldx, ldy};
  // About 64 K multiply-adds per task at least (the pool's wake-up costs microseconds); the split
  // itself never changes a result.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k * 16));
  at::parallel_for(0, (n + 15) / 16, grain, [&](int64_t p0, int64_t p1) { gemm_panels(a, p0, p1); });
}

// Outputs of at least REUSE_MIN_BYTES come from a small cache of freed output buffers instead of
// torch's allocator. Why: a prefill step's outputs are large (2,048 rows x 5,632 columns = 46 MB
// for a 246M Llama's gate-up), glibc serves each from a fresh mmap and unmaps it when freed, so every
// layer page-faults the whole buffer in again (measured on a 2-core Zen 3: ~250,000 faults and
// 0.8 s of system time in an 11 s prefill step of 2,048 tokens, most of them this one output). A
// buffer freed goes back here (at most REUSE_MAX_BYTES held, the rest returned to the system) and
// the next output of that size takes it already mapped. Contents are never read before written.
constexpr size_t REUSE_MIN_BYTES = size_t(1) << 21;
constexpr size_t REUSE_MAX_BYTES = size_t(256) << 20;

class OutputBuffers {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> hold(mu_);
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].first == bytes) {
          void* p = free_[i].second;
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          held_ -= bytes;
          return p;
        }
    }
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, 64, bytes) == 0, "fp32 GEMM: out of memory for a ", bytes, "-byte output");
    return p;
  }
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> hold(mu_);
      if (held_ + bytes <= REUSE_MAX_BYTES) {
        free_.emplace_back(bytes, p);
        held_ += bytes;
        return;
      }
    }
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;
  size_t held_ = 0;
};

// Never destroyed: a tensor may outlive static destruction at interpreter exit.
OutputBuffers& output_buffers() {
  static OutputBuffers* buffers = new OutputBuffers();
  return *buffers;
}

at::Tensor empty_output(const std::vector<int64_t>& shape, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  if (bytes < REUSE_MIN_BYTES) return at::empty(shape, options);
  void* p = output_buffers().take(bytes);
  return at::from_blob(p, shape, [bytes](void* q) { output_buffers().give(q, bytes); }, options);
}

// x [..., K] (fp32) times the packed weight of `n` output columns -> [..., n].
}  // namespace

namespace llk::gemm {

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "fp32 GEMM: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "fp32 GEMM: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "fp32 GEMM: the weight must be packed as [panels, K, 16] (kernels/fp32_linear.py pack_panels)");
  const int64_t k = packed.size(1);
  TORCH_CHECK(x.size(-1) == k, "fp32 GEMM: input has ", x.size(-1), " features, the weight ", k);
  TORCH_CHECK(n > 0 && (n + 15) / 16 == packed.size(0), "fp32 GEMM: ", n, " columns do not fit ",
              packed.size(0), " panels");
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = empty_output(out_shape, x.options());
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "fp32 GEMM: bias must be float32 [", n, "]");
    bias_c = bias->contiguous();
  }
  ::gemm(x2.data_ptr<float>(), x2.size(0), k, packed.data_ptr<float>(), n, k,
         bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>(), n);
  return y;
}

}  // namespace llk::gemm
