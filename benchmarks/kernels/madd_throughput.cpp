// How many vpmaddwd a core issues a cycle: the ceiling of the AVX2 many-row GEMM of packed weights
// (kernels/cpu/qgemm.h: per pair of inputs and row of x, a broadcast, a vpmaddwd, a vpaddd).
// Three loops, 12 or 8 independent chains each, so that latency does not bound them: vpmaddwd
// alone, the GEMM's broadcast + vpmaddwd + vpaddd, and one broadcast shared by two vpmaddwd (two
// panels of weight rows at once). Nanoseconds per vpmaddwd; times the clock, vpmaddwd a cycle.
//
//     g++ -O2 -mavx2 -o /tmp/madd_throughput benchmarks/kernels/madd_throughput.cpp && /tmp/madd_throughput
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

template <typename F>
double seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main() {
  constexpr long N = 100000000;
  __m256i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i w0 = _mm256_set1_epi16(3), w1 = _mm256_set1_epi16(5);
  volatile int x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const double alone = seconds([&] {
    for (long n = 0; n < N; ++n)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) {
        acc[i] = _mm256_madd_epi16(acc[i], w0);
        __asm__("" : "+x"(acc[i]));
      }
  });
  const double triple = seconds([&] {
    for (long n = 0; n < N; ++n)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        __m256i b = _mm256_set1_epi32(x[i]);
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(w0, b));
        __asm__("" : "+x"(acc[i]));
      }
  });
  const double shared = seconds([&] {
    for (long n = 0; n < N; ++n)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i b = _mm256_set1_epi32(x[i]);
        acc[2 * i] = _mm256_add_epi32(acc[2 * i], _mm256_madd_epi16(w0, b));
        acc[2 * i + 1] = _mm256_add_epi32(acc[2 * i + 1], _mm256_madd_epi16(w1, b));
        __asm__("" : "+x"(acc[2 * i]), "+x"(acc[2 * i + 1]));
      }
  });
  int sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm256_extract_epi32(acc[i], 0);
  std::printf("ns per vpmaddwd: alone %.3f, with a broadcast and a vpaddd %.3f, two sharing a broadcast %.3f (%d)\n",
              alone / (N * 12.0) * 1e9, triple / (N * 8.0) * 1e9, shared / (N * 8.0) * 1e9, sink & 1);
}
