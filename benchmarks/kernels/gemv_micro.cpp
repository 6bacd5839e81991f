// Micro-benchmark of one quantized GEMV shape (benchmarks/kernels/gemv_micro.py builds and drives it):
// quant_kernels.cpp compiled in, timed in C++ (no Python per call), weights cycled through enough
// copies to leave the caches (or one copy: hot), and a plain read of the same bytes as the ceiling.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <chrono>

#include "../../kernels/cpu/quant_kernels.cpp"

namespace quantk = llk::quant;

namespace {

double now_ns() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Min ns of one GEMV (x quantized as the decode loop does, then the tiles) over reps calls,
// walking the copies in turn. layout "rows": qweight/scales/mins lists; "tiles": flat tile tensors.
double gemv_ns(const std::string& layout, bool int4, const torch::Tensor& x, std::vector<torch::Tensor> qweights,
               std::vector<torch::Tensor> scales, std::vector<torch::Tensor> mins, int64_t group, int64_t n,
               int64_t reps) {
  const int64_t k = x.size(1), m = x.size(0), copies = static_cast<int64_t>(qweights.size());
  auto out = torch::empty({m, n}, x.options());
  const int64_t scale_bytes = scales[0].element_size();  // float16 or float32 tiles
  double best = 1e30;
  for (int64_t i = 0; i < reps; ++i) {
    const int64_t c = i % copies;
    const double t0 = now_ns();
    const quantk::QuantizedX xq = quantk::quantize_x(x.data_ptr<float>(), m, k, int4);
    if (layout == "tiles")
      quantk::interleaved_gemm(xq, qweights[c].data_ptr<uint8_t>(), int4, scale_bytes, group, !mins.empty(), n,
                               out.data_ptr<float>());
    else
      quantk::packed_gemm(xq, static_cast<const uint8_t*>(qweights[c].data_ptr()), int4, scales[c],
                          mins.empty() ? torch::Tensor() : mins[c], group, n, out.data_ptr<float>());
    best = std::min(best, now_ns() - t0);
  }
  return best;
}

// Min ns to read every byte of one buffer (32-byte loads, split over the threads like the GEMV).
__attribute__((target("avx2"))) double read_ns(std::vector<torch::Tensor> bufs, int64_t reps) {
  double best = 1e30;
  volatile int sink = 0;
  for (int64_t i = 0; i < reps; ++i) {
    const auto& b = bufs[i % bufs.size()];
    const uint8_t* p = b.data_ptr<uint8_t>();
    const int64_t lines = b.numel() / 64;
    const double t0 = now_ns();
    at::parallel_for(0, lines, 256, [&](int64_t begin, int64_t end) {
      __m256i acc = _mm256_setzero_si256();
      for (int64_t l = begin; l < end; ++l) {
        acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + l * 64)));
        acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + l * 64 + 32)));
      }
      sink = sink + _mm256_extract_epi32(acc, 0);
    });
    best = std::min(best, now_ns() - t0);
  }
  return best;
}

double quantize_ns(const torch::Tensor& x, bool int4, int64_t reps) {
  double best = 1e30;
  for (int64_t i = 0; i < reps; ++i) {
    const double t0 = now_ns();
    const quantk::QuantizedX xq = quantk::quantize_x(x.data_ptr<float>(), x.size(0), x.size(1), int4);
    best = std::min(best, now_ns() - t0 + 0 * xq.q[0]);
  }
  return best;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_ns", &gemv_ns);
  m.def("read_ns", &read_ns);
  m.def("quantize_ns", &quantize_ns);
}
