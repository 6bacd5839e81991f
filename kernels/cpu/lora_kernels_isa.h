// The per-ISA bodies of the multi-LoRA kernel (lora_kernels.cpp includes this file once per
// instruction set, each time in its own namespace under a `#pragma GCC target`, with kRows set).
// GCC vector extensions of 16 floats: one zmm on AVX-512, two ymm on AVX2, four xmm on x86-64,
// so the same loops keep their accumulators in registers on every variant. A row's sums run in
// the same order whatever block it is in: batched rows get the bits they get alone.

constexpr int64_t kRows = LLK_LORA_ROWS;  // rows a block computes at once (accumulators in registers)

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v16 load16(const at::BFloat16* p) {  // exact: a bf16 is the top half of its fp32
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline void store16(at::BFloat16* p, v16 v) {  // round to nearest even, NaN stays NaN
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const u16x16 h = __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), u16x16);
  std::memcpy(p, &h, sizeof h);
}

inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(at::BFloat16* p, float v) { *p = static_cast<at::BFloat16>(v); }  // nearest even

// s[j][c : c + 16] = scale * sum_i x[j][i] * a_t[i][c : c + 16] for j < NR rows (a_t: [in, ld]).
template <int NR, typename T>
inline void shrink_rows(const float* const* x, int64_t in, const T* a_t, int64_t ld, float scale, float* const* s,
                        int64_t c) {
  v16 acc[NR] = {};
  for (int64_t i = 0; i < in; ++i) {
    const v16 w = load16(a_t + i * ld + c);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[j] += x[j][i] * w;
  }
  for (int j = 0; j < NR; ++j) store16(s[j] + c, acc[j] * scale);
}

// out[j][c : c + 16] += sum_r s[j][r] * b_t[r][c : c + 16] for j < NR rows (b_t: [rank, ld]); the
// last chunk of a row narrower than 16 (`width`) goes element by element, in the same order.
template <int NR, typename T>
inline void expand_rows(const float* const* s, int64_t rank, const T* b_t, int64_t ld, T* const* out, int64_t c,
                        int64_t width) {
  if (width == 16) {
    v16 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = load16(out[j] + c);
    for (int64_t r = 0; r < rank; ++r) {
      const v16 w = load16(b_t + r * ld + c);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[j] += s[j][r] * w;
    }
    for (int j = 0; j < NR; ++j) store16(out[j] + c, acc[j]);
    return;
  }
  for (int j = 0; j < NR; ++j)
    for (int64_t k = c; k < c + width; ++k) {
      float acc = load1(out[j] + k);
      for (int64_t r = 0; r < rank; ++r) acc += s[j][r] * load1(b_t + r * ld + k);
      store1(out[j] + k, acc);
    }
}

// Calls fn.template operator()<NR>() for NR = n (1 <= n <= kRows): the row count as a constant.
template <typename Fn>
inline void with_rows(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: fn.template operator()<1>(); break;
    case 2: fn.template operator()<2>(); break;
    case 3: fn.template operator()<3>(); break;
    case 4: fn.template operator()<4>(); break;
#if LLK_LORA_ROWS > 4
    case 5: fn.template operator()<5>(); break;
    case 6: fn.template operator()<6>(); break;
    case 7: fn.template operator()<7>(); break;
    case 8: fn.template operator()<8>(); break;
#endif
  }
}

// Phase 1, one block of up to kRows rows of one group: every stack's rank-wide product, scaled.
template <typename T>
void shrink_block(const LoraCall<T>& call, const RowBlock& block, std::vector<float>& widened) {
  const int64_t in = call.in;
  const float* x[kRows];
  float* s[kRows];
  widened.resize(static_cast<size_t>(kRows * in));
  for (int64_t j = 0; j < block.n; ++j) {
    const int64_t row = call.rows[block.first + j];
    if constexpr (std::is_same_v<T, float>) {
      x[j] = call.x + row * call.x_stride;
    } else {
      for (int64_t i = 0; i < in; ++i) widened[j * in + i] = load1(call.x + row * call.x_stride + i);
      x[j] = widened.data() + j * in;
    }
    s[j] = call.shrunk + (block.first + j) * call.shrunk_width;
  }
  for (const LoraStackView<T>& st : call.stacks) {
    const T* a_t = st.a_t + block.slot * in * st.rank;
    const float scale = st.scale[block.slot];
    float* s_stack[kRows];
    for (int64_t j = 0; j < block.n; ++j) s_stack[j] = s[j] + st.shrunk_col;
    for (int64_t c = 0; c < st.rank; c += 16)
      with_rows(block.n, [&]<int NR>() { shrink_rows<NR, T>(x, in, a_t, st.rank, scale, s_stack, c); });
  }
}

// Phase 2, one stack's output columns [c0, c1) over every block: out += shrunk @ B^T.
template <typename T>
void expand_columns(const LoraCall<T>& call, const LoraStackView<T>& st, int64_t c0, int64_t c1) {
  for (const RowBlock& block : call.blocks) {
    const T* b_t = st.b_t + block.slot * st.rank * st.size;
    const float* s[kRows];
    T* out[kRows];
    for (int64_t j = 0; j < block.n; ++j) {
      s[j] = call.shrunk + (block.first + j) * call.shrunk_width + st.shrunk_col;
      out[j] = call.out + call.rows[block.first + j] * call.out_stride + st.offset;
    }
    for (int64_t c = c0; c < c1; c += 16) {
      const int64_t width = std::min<int64_t>(16, c1 - c);
      with_rows(block.n, [&]<int NR>() { expand_rows<NR, T>(s, st.rank, b_t, st.size, out, c, width); });
    }
  }
}
