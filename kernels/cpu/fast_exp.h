// fast_exp: included inside each ISA namespace of the native kernels (cpu_kernels_isa.h,
// kv_quant_attention_isa.h), so each variant compiles it for its own instruction set.

// exp for softmax and SiLU, written so the compiler vectorizes it (libm's expf is scalar): range
// reduction x = n ln2 + r, a degree-6 polynomial for e^r on |r| <= ln2/2, 2^n through the exponent
// bits (as 2^(n-1) * 2, so n = 128 still overflows to inf like expf). Relative error about 2e-7,
// i.e. within a couple of float ulps; results below e^-86 (~4e-38) come out as e^-86.
inline float fast_exp(float x) {
  x = x < -86.f ? -86.f : (x > 89.f ? 89.f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);  // in [-124, 128]
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;
  float half_scale;
  std::memcpy(&half_scale, &bits, sizeof half_scale);
  return p * half_scale * 2.f;
}
