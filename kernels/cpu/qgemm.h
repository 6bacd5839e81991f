// Many rows of x (prefill, a batched decode step) against a packed int4/int8 weight in
// interleave_tiles' layout, with int8 integer dot products as llama.cpp computes them: the
// activations are rounded once per row and per block of 32 inputs to q = round(x * LEVELS / max|x|)
// (round half to even) held as two int8 digits, q = 255 * hi + lo; every block is then one exact
// integer dot product (255 * dot(w, hi) + dot(w, lo)), scaled in float:
//     acc = fma(float(dot(w_block, q_block)), w_scale[group] * x_scale[block], acc)   (block order;
//                                                     int8 in groups of 16: each half block, in turn)
//     out = fma(min[group], sum(x over group), out)                                   (group order)
// (the sum of x exact in float). Two digits: int16's precision at int8's instructions (one digit,
// llama.cpp's Q8 activations, cost SmolLM2-135M Q4_1 +1.3 % perplexity). Why this path: the int16
// passes of quant_kernels.cpp recompute each weight block for every row with a float step per
// block, row and 8 lanes; here the weight is unpacked once per block of MR rows, each instruction
// does 64 (VNNI) or 32 (AVX2) multiply-adds, and the float step is one per block, row and 16 (8)
// weight rows: with VNNI a 64-row step computes from the packed bytes faster than from a float32
// copy (with AVX2 alone, int4 is about 0.7x of the copy's fp32 GEMM; docs/benchmarks.md).
//
// Layout of the products: each 32-bit lane holds 4 consecutive bytes of one weight row (the tile's
// natural order), so x goes to the lanes pre-arranged: int8 weights take x in input order; an int4
// lane's low nibbles are inputs 8j, 8j+2, 8j+4, 8j+6 and its high ones 8j+1 ... 8j+7, so each
// x block is stored as [those 16 for the low nibbles | 16 for the high] (nibble_lanes). Each
// 4-tile panel's lanes are summed per weight row by a transpose (row_sums).
// - AVX512-VNNI: vpdpbusd (u8 x s8 -> s32). int4 nibbles are the unsigned operand; int8 weights
//   are signed, so both digits go in as digit + 128 (unsigned), and -(128 * 257) * sum(w row)
//   is added once per block and panel for all the rows of x.
// - AVX2: int4 by vpmaddubsw (u8 x s8 -> s16, two products; |15 * 127 * 2| fits without
//   saturating), each digit's sums then weighed by 255 or 1 in one vpmaddwd; int8 weights by
//   vpmaddwd on q whole (int16, Int8X::q) against the weight widened to int16 (one instruction per
//   16 products, where the digits cost three per 32 each).
// - scalar (`set_isa("generic")`): the same integers in plain loops, the same float steps (std::fma).
// Overflow: |q| <= 32512, so an int4 block's sum is < 2^24 (exact as a float), an int8 block's
// < 2^28 (one float rounding, the same in every variant). Every variant gives every output the
// same bits, and no output depends on M, the row block, the thread or the panel.
// AMX-INT8 and AVX-VNNI (VEX) variants are not built: AMX CPUs have AVX512-VNNI, which runs here.
//
// Included by quant_kernels.cpp inside its namespace, after the tile layout, TileScales and
// avx512_allowed().

namespace qgemm {

// Activation steps each side of zero: 127 * 255 + 127, the most two such digits hold (int16's
// precision: one int8 digit alone cost SmolLM2-135M Q4_1 +1.3 % perplexity on fables.txt).
constexpr float LEVELS = 32512.f;
constexpr int MR = 4;  // x rows per pass over a panel's block

// x [m, k] rounded per 32-input block to q (|q| <= LEVELS) held as two int8 digits,
// q = base * hi + lo: base 256 (lo in -128..127) for VNNI, where the combination is one shift;
// base 255 (both in -127..127) for AVX2 and the scalar code: the sign trick cannot negate -128.
// q is the same either way, and so is every integer dot product.
struct Int8X {
  int64_t m = 0, k = 0, groups = 0;
  bool lanes = false;        // the digits' blocks in nibble_lanes order
  int32_t base = 255;
  std::vector<int8_t> hi, lo;  // [m, k]: input order (int8 weights, the scalar variant) or nibble_lanes order
  std::vector<int16_t> q;      // [m, k]: q whole, in input order, instead of the digits (AVX2, int8 weights)
  // [m, k / QB, 4, 32] (AVX2, int4 weights): each block's 16-byte halves of hi, then of lo, each
  // twice over, so the panel's vpmaddubsw reads them from memory instead of holding broadcasts.
  std::vector<int8_t> doubled;
  std::vector<float> scale;  // [m, k / QB]
  std::vector<float> sums;   // [m, groups]: exact float sums of x over each weight group (for the mins)
};

// One 32-input block of int8 x in an int4 lane's order (see the top of this file).
inline void nibble_lanes(const int8_t* q, int8_t* out) {
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t) {
      out[4 * j + t] = q[8 * j + 2 * t];
      out[16 + 4 * j + t] = q[8 * j + 2 * t + 1];
    }
}

// One block's digits (base 255 or 256) from q in 4 vectors of 8, in input or nibble_lanes order.
__attribute__((target("avx2"))) inline __m256i digits_avx2(const __m256i* d, bool lanes) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(d[0], d[1]), _mm256_packs_epi32(d[2], d[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (!lanes) return ordered;
  const __m256i split = _mm256_shuffle_epi8(  // each 16 bytes: their evens, then their odds
      ordered, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3,
                                5, 7, 9, 11, 13, 15));
  return _mm256_permute4x64_epi64(split, _MM_SHUFFLE(3, 1, 2, 0));  // all evens, then all odds
}

// Int8X::doubled's 128 bytes of one block from its digits.
__attribute__((target("avx2"))) inline void double_halves(const int8_t* hi, const int8_t* lo, int8_t* out) {
  const int8_t* from[4] = {hi, hi + 16, lo, lo + 16};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j),
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from[j]))));
}

// The vector form of quantize's block: the same max, the same q (cvtps rounds half to even, as
// nearbyint in the default rounding mode), the same digits (floor by an exact float division).
__attribute__((target("avx2,fma"))) inline void quantize_block_avx2(const float* xb, int32_t base, bool lanes,
                                                                     float* scale, int8_t* hi, int8_t* lo,
                                                                     int16_t* whole) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax8 = _mm256_max_ps(_mm256_and_ps(v[i], abs_mask), amax8);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? LEVELS / amax : 0.f);
  *scale = amax / LEVELS;
  __m256i h[4], l[4];
  if (whole != nullptr) {  // |q| <= 32512: packs keeps it; the permute undoes its 128-bit interleave
    for (int i = 0; i < 4; ++i) h[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(whole + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(h[2 * i], h[2 * i + 1]), 0xD8));
    return;
  }
  for (int i = 0; i < 4; ++i) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    if (base == 256) {
      h[i] = _mm256_srai_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(128)), 8);
      l[i] = _mm256_sub_epi32(q, _mm256_slli_epi32(h[i], 8));
    } else {
      const __m256 shifted = _mm256_cvtepi32_ps(_mm256_add_epi32(q, _mm256_set1_epi32(127)));
      h[i] = _mm256_cvtps_epi32(_mm256_floor_ps(_mm256_div_ps(shifted, _mm256_set1_ps(255.f))));
      l[i] = _mm256_sub_epi32(q, _mm256_sub_epi32(_mm256_slli_epi32(h[i], 8), h[i]));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), digits_avx2(h, lanes));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), digits_avx2(l, lanes));
}

// ``vector``: the AVX2 block (the SIMD variants), else the plain loop (the scalar variant): the same
// bytes. ``whole``: q itself in Int8X::q instead of the digits; ``doubled``: Int8X::doubled beside
// them (the vector block only).
inline Int8X quantize(const float* x, int64_t m, int64_t k, int64_t group, bool mins, bool lanes, int32_t base,
                      bool vector, bool whole = false, bool doubled = false) {
  const int64_t nb = k / QB;
  Int8X r{m, k, k / group, lanes, base, {}, {}, {}, {}, std::vector<float>(m * nb), {}};
  if (whole) r.q.resize(m * k);
  else r.hi.resize(m * k), r.lo.resize(m * k);
  if (doubled) r.doubled.resize(4 * m * k);
  if (mins) r.sums.resize(m * r.groups);
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    int8_t hi[QB], lo[QB];
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = x + i * k;
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = xr + b * QB;
        const int64_t at = i * k + b * QB;
        if (vector) {
          if (whole) quantize_block_avx2(xb, base, lanes, &r.scale[i * nb + b], nullptr, nullptr, r.q.data() + at);
          else quantize_block_avx2(xb, base, lanes, &r.scale[i * nb + b], r.hi.data() + at, r.lo.data() + at, nullptr);
          if (doubled) double_halves(r.hi.data() + at, r.lo.data() + at, r.doubled.data() + 4 * at);
          continue;
        }
        float amax = 0.f;
        for (int j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float inv = amax > 0.f ? LEVELS / amax : 0.f;
        r.scale[i * nb + b] = amax / LEVELS;
        for (int j = 0; j < QB; ++j) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
          // floor((q + 127) / 255), or floor((q + 128) / 256): |hi| <= 127 for |q| <= 32512
          const int32_t high = (q + base / 2 + base * 128) / base - 128;
          hi[j] = static_cast<int8_t>(high);
          lo[j] = static_cast<int8_t>(q - base * high);
        }
        if (lanes) {
          nibble_lanes(hi, r.hi.data() + at);
          nibble_lanes(lo, r.lo.data() + at);
        } else {
          std::memcpy(r.hi.data() + at, hi, QB);
          std::memcpy(r.lo.data() + at, lo, QB);
        }
      }
      for (int64_t g = 0; mins && g < r.groups; ++g) {
        float s = 0.f;
        for (int64_t j = g * group; j < (g + 1) * group; ++j) s += xr[j];
        r.sums[i * r.groups + g] = s;
      }
    }
  });
  return r;
}

// A tile's pointers: group g's RT scales, block e of group g, the RT mins of group g. Groups of 16
// (bpg 0) pair up in a block: its two groups' scales, then its bytes.
struct TileView {
  const uint8_t* p;
  const TileLayout& l;
  const uint8_t* scales(int64_t g) const {
    if (l.bpg == 0) return p + l.groups_offset() + (g / 2) * 2 * l.group_bytes() + (g % 2) * RT * l.scale_bytes;
    return p + l.groups_offset() + g * l.group_bytes();
  }
  const uint8_t* block(int64_t g, int64_t e) const {
    if (l.bpg == 0) return scales(g - g % 2) + 2 * RT * l.scale_bytes;
    return scales(g) + RT * l.scale_bytes + e * RT * l.block_bytes;
  }
  const uint8_t* mins(int64_t g) const { return p + l.mins_offset() + g * RT * l.scale_bytes; }
};

// Where input j of a block sits in x.q's block (nibble_lanes is the inverse).
inline int lane_position(int j, bool lanes) {
  return !lanes ? j : (j % 2) * 16 + 4 * (j / 8) + (j % 8) / 2;
}

// ---- scalar reference: tiles [t0, t1) for every row of x, in input order -------------------------
template <typename S>
__attribute__((optimize("fp-contract=off"))) void tiles_ref(const Int8X& x, const uint8_t* tiles, const TileLayout& l,
                                                             bool int4, int64_t t0, int64_t t1, int64_t n, float* out) {
  const int64_t nb = x.k / QB;
  for (int64_t t = t0; t < t1; ++t) {
    const TileView tile{tiles + t * l.tile_bytes(), l};
    const TileScales<S> ts(tile.p, l);
    for (int r = 0; r < RT && t * RT + r < n; ++r)
      for (int64_t i = 0; i < x.m; ++i) {
        const auto q = [&](int64_t at) -> int32_t {  // the digits, or q whole
          if (!x.q.empty()) return x.q[i * x.k + at];
          return x.base * x.hi[i * x.k + at] + x.lo[i * x.k + at];
        };
        float acc = 0.f;
        for (int64_t g = 0; g < l.groups; ++g) {
          const float ws = ts.value(tile.scales(g), g, r);
          for (int64_t e = 0; e < std::max<int64_t>(l.bpg, 1); ++e) {  // groups of 16: half a block each
            const int64_t b = l.bpg == 0 ? g / 2 : g * l.bpg + e;
            const int j0 = l.bpg == 0 ? 16 * static_cast<int>(g % 2) : 0, j1 = l.bpg == 0 ? j0 + 16 : QB;
            const uint8_t* w = tile.block(g, e) + r * l.block_bytes;
            int32_t dot = 0;
            for (int j = j0; j < j1; ++j) {
              const int32_t wj = int4 ? (w[j / 2] >> (4 * (j % 2))) & 15 : static_cast<int8_t>(w[j]);
              const int64_t at = b * QB + lane_position(j, x.lanes);
              dot += wj * q(at);
            }
            acc = std::fma(static_cast<float>(dot), ws * x.scale[i * nb + b], acc);
          }
        }
        for (int64_t g = 0; l.mins && g < l.groups; ++g)
          acc = std::fma(ts.value(tile.mins(g), g, r, true), x.sums[i * x.groups + g], acc);
        out[i * n + t * RT + r] = acc;
      }
  }
}

// ---- AVX-512 VNNI: panels of 4 tiles (16 weight rows) ------------------------------------------
// The 4 tiles' int32 lanes (lane 4r + j of tile t: row r, bytes 4j..4j+3) summed per row: lane 4r + t.
__attribute__((target("avx512f,avx512bw"))) inline __m512i row_sums(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

// An int8 tile block's two vectors (rows 0-1 | rows 2-3, 8 lanes a row) -> 4 lanes a row (lane 4r + j):
// with HALVES 1 the block's sums; with 2 (groups of 16) its first 16 inputs' in [0], the last 16's in [1].
template <int HALVES>
__attribute__((target("avx512f"))) inline std::array<__m512i, HALVES> rows_of_tile(__m512i e0, __m512i e1) {
  const __m512i first = _mm512_shuffle_i64x2(e0, e1, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512i second = _mm512_shuffle_i64x2(e0, e1, _MM_SHUFFLE(3, 1, 3, 1));
  if constexpr (HALVES == 1) return {_mm512_add_epi32(first, second)};
  else return {first, second};
}

// lane 4r + t <-> lane 4t + r (its own inverse): tile-major values to row_sums' order and back.
__attribute__((target("avx512f"))) inline __m512i transpose_index() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// The 4 tiles' RT values (group g's scales, or with `mins` its mins) at byte offset `at` of each, in
// row_sums' lane order.
template <typename S>
__attribute__((target("avx2,avx512f,f16c"))) inline __m512 panel_values(const TileScales<S>* ts, const uint8_t* const* p,
                                                                       int64_t at, int64_t g, bool mins, __m512i idx) {
  __m512 v = _mm512_castps128_ps512(ts[0].values(p[0] + at, g, mins));
  v = _mm512_insertf32x4(v, ts[1].values(p[1] + at, g, mins), 1);
  v = _mm512_insertf32x4(v, ts[2].values(p[2] + at, g, mins), 2);
  v = _mm512_insertf32x4(v, ts[3].values(p[3] + at, g, mins), 3);
  return _mm512_permutexvar_ps(idx, v);
}

// R rows of x (R <= MR) against one panel: the whole K, then the mins, stored in column order.
// HALVES 2: int8 in groups of 16, each block's halves scaled apart (first, then second).
template <typename S, bool INT4, int R, int HALVES = 1>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void panel_vnni(const Int8X& x, int64_t i0,
                                                                            const uint8_t* const* p,
                                                                            const TileLayout& l, float* out,
                                                                            int64_t ldo) {
  const int64_t nb = x.k / QB;
  const __m512i idx = transpose_index();
  const __m512i low4 = _mm512_set1_epi8(15), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const TileScales<S> ts[4] = {{p[0], l}, {p[1], l}, {p[2], l}, {p[3], l}};
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t off = l.groups_offset();  // byte offset of the group (then block) inside every tile of the panel
  for (int64_t g = 0, b = 0; g < l.groups; g += HALVES) {
    __m512 ws[HALVES];
    for (int h = 0; h < HALVES; ++h) ws[h] = panel_values<S>(ts, p, off + h * RT * l.scale_bytes, g + h, false, idx);
    off += HALVES * RT * l.scale_bytes;
    for (int64_t e = 0; e < (HALVES == 2 ? 1 : l.bpg); ++e, ++b, off += RT * l.block_bytes) {
      __m512i w[8];  // int4: tile t's low nibbles in w[t], high in w[4 + t]; int8: tile t's rows 0-1, 2-3 in w[2t], w[2t + 1]
      __m512i fix[HALVES];  // int8: -(128 * 257) * sum(w row) in row_sums' order, for the x + 128 of both digits
      for (int t = 0; t < 4; ++t) {
        if constexpr (INT4) {
          const __m512i raw = _mm512_loadu_si512(p[t] + off);
          w[t] = _mm512_and_si512(raw, low4);
          w[4 + t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        } else {
          for (int h = 0; h < 2; ++h) w[2 * t + h] = _mm512_loadu_si512(p[t] + off + 64 * h);
        }
      }
      if constexpr (!INT4) {
        std::array<__m512i, HALVES> s[4];
        for (int t = 0; t < 4; ++t)
          s[t] = rows_of_tile<HALVES>(_mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w[2 * t]),
                                      _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w[2 * t + 1]));
        for (int h = 0; h < HALVES; ++h) {
          const __m512i sum128 = row_sums(s[0][h], s[1][h], s[2][h], s[3][h]);  // 128 * sum(w row)
          fix[h] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(_mm512_slli_epi32(sum128, 8), sum128));
        }
      }
      for (int i = 0; i < R; ++i) {
        const int64_t at = (i0 + i) * x.k + b * QB;
        const int8_t* xh = x.hi.data() + at;
        const int8_t* xl = x.lo.data() + at;
        std::array<__m512i, HALVES> a[4];  // per tile: 256 * dot(w, hi) + dot(w, lo): the hi digit's sums shifted, then lo's added on
        if constexpr (INT4) {
          const auto half = [](const int8_t* p) {
            return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          };
          const __m512i h0 = half(xh), h1 = half(xh + 16), l0 = half(xl), l1 = half(xl + 16);
          for (int t = 0; t < 4; ++t) {
            const __m512i top = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[t], h0), w[4 + t], h1);
            a[t][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(top, 8), w[t], l0), w[4 + t], l1);
          }
        } else {
          const auto unsigned_x = [&](const int8_t* p) {
            return _mm512_xor_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), bias);
          };
          const __m512i uh = unsigned_x(xh), ul = unsigned_x(xl);
          for (int t = 0; t < 4; ++t) {
            __m512i e[2];
            for (int h = 0; h < 2; ++h) {
              const __m512i top = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uh, w[2 * t + h]);
              e[h] = _mm512_dpbusd_epi32(_mm512_slli_epi32(top, 8), ul, w[2 * t + h]);
            }
            a[t] = rows_of_tile<HALVES>(e[0], e[1]);
          }
        }
        const __m512 xs = _mm512_set1_ps(x.scale[(i0 + i) * nb + b]);
        for (int h = 0; h < HALVES; ++h) {
          __m512i sums = row_sums(a[0][h], a[1][h], a[2][h], a[3][h]);
          if constexpr (!INT4) sums = _mm512_add_epi32(sums, fix[h]);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(ws[h], xs), acc[i]);
        }
      }
    }
  }
  if (l.mins) {
    for (int64_t g = 0; g < l.groups; ++g) {
      const __m512 mn = panel_values<S>(ts, p, l.mins_offset() + g * RT * l.scale_bytes, g, true, idx);
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.sums[(i0 + i) * x.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + (i0 + i) * ldo, _mm512_permutexvar_ps(idx, acc[i]));
}

// ---- AVX2: panels of 2 tiles (8 weight rows) ----------------------------------------------------
// 8 rows' 8 lanes each -> [rows 0..7], each row's lanes summed.
__attribute__((target("avx2"))) inline __m256i row_totals_avx2(const __m256i* s) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// int8 weights: vpmaddwd on q whole (int16) against the weight widened to int16 once per block for
// all the rows of x: one multiply-add per 16 products, where two digits need a sign, a vpmaddubsw
// and a vpmaddwd each per 32. w: the panel's 8 rows' 32 values -> the 8 rows' sums in order;
// HALVES 2 (int8 in groups of 16): those of the block's first 16 inputs, then of its last 16.
// |128 * 32512 * 32| < 2^31.
template <int HALVES>
__attribute__((target("avx2"))) inline std::array<__m256i, HALVES> int8_panel_sums_avx2(const int16_t (*w)[QB],
                                                                                        const int16_t* q) {
  __m256i half[2], s[2][8];
  for (int h = 0; h < 2; ++h) {
    half[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * h));
    for (int r = 0; r < 8; ++r)
      s[h][r] = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w[r] + 16 * h)), half[h]);
  }
  if constexpr (HALVES == 2) return {row_totals_avx2(s[0]), row_totals_avx2(s[1])};
  for (int r = 0; r < 8; ++r) s[0][r] = _mm256_add_epi32(s[0][r], s[1][r]);
  return {row_totals_avx2(s[0])};
}

// int4: w[t][0..1], tile t's low nibbles of rows 0-1, 2-3; w[t][2..3] its high nibbles; xd: a block of
// Int8X::doubled. Each digit's products are summed in int16 first (|15 * 127 * 4| fits)
// -> [r0, r2, r4, r6 | r1, r3, r5, r7] (row_lanes' order).
__attribute__((target("avx2"))) inline __m256i int4_panel_sums_avx2(const __m256i (*w)[4], const int8_t* xd) {
  const __m256i ones = _mm256_set1_epi16(1), base = _mm256_set1_epi16(255);
  const __m256i* x = reinterpret_cast<const __m256i*>(xd);  // hi's halves, then lo's
  __m256i s[2][2];
  for (int t = 0; t < 2; ++t)
    for (int h = 0; h < 2; ++h) {
      __m256i digit[2];
      for (int d = 0; d < 2; ++d)
        digit[d] = _mm256_add_epi16(_mm256_maddubs_epi16(w[t][h], _mm256_loadu_si256(x + 2 * d)),
                                    _mm256_maddubs_epi16(w[t][2 + h], _mm256_loadu_si256(x + 2 * d + 1)));
      s[t][h] = _mm256_add_epi32(_mm256_madd_epi16(digit[0], base), _mm256_madd_epi16(digit[1], ones));
    }
  return _mm256_hadd_epi32(_mm256_hadd_epi32(s[0][0], s[0][1]), _mm256_hadd_epi32(s[1][0], s[1][1]));
}

// Natural row order (r0..r7) -> int4_panel_sums_avx2's (lane L holds row 0, 2, 4, 6, 1, 3, 5, 7) and back.
__attribute__((target("avx2"))) inline __m256 row_lanes(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
__attribute__((target("avx2"))) inline __m256 natural_rows(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename S, bool INT4, int R, int HALVES = 1>
__attribute__((target("avx2,fma,f16c"))) void panel_avx2(const Int8X& x, int64_t i0, const uint8_t* const* p,
                                                          const TileLayout& l, float* out, int64_t ldo) {
  const int64_t nb = x.k / QB;
  const __m256i low4 = _mm256_set1_epi8(15);
  const TileScales<S> ts[2] = {{p[0], l}, {p[1], l}};
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t off = l.groups_offset();
  for (int64_t g = 0, b = 0; g < l.groups; g += HALVES) {
    __m256 ws[HALVES];
    for (int h = 0; h < HALVES; ++h) {
      const int64_t at = off + h * RT * l.scale_bytes;
      ws[h] = _mm256_set_m128(ts[1].values(p[1] + at, g + h), ts[0].values(p[0] + at, g + h));
      if constexpr (INT4) ws[h] = row_lanes(ws[h]);
    }
    off += HALVES * RT * l.scale_bytes;
    for (int64_t e = 0; e < (HALVES == 2 ? 1 : l.bpg); ++e, ++b, off += RT * l.block_bytes) {
      __m256i w[2][4];
      alignas(32) int16_t wide[2 * RT][QB];
      for (int t = 0; t < 2; ++t) {
        if constexpr (INT4) {
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[t] + off + 32 * h));
            w[t][h] = _mm256_and_si256(raw, low4);
            w[t][2 + h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          }
        } else {
          for (int r = 0; r < RT; ++r)
            for (int h = 0; h < 2; ++h)
              _mm256_store_si256(reinterpret_cast<__m256i*>(wide[t * RT + r] + 16 * h),
                                 _mm256_cvtepi8_epi16(_mm_loadu_si128(
                                     reinterpret_cast<const __m128i*>(p[t] + off + 32 * r + 16 * h))));
        }
      }
      for (int i = 0; i < R; ++i) {
        const int64_t at = (i0 + i) * x.k + b * QB;
        const __m256 xs = _mm256_set1_ps(x.scale[(i0 + i) * nb + b]);
        if constexpr (INT4) {
          const __m256i sums = int4_panel_sums_avx2(w, x.doubled.data() + 4 * at);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws[0], xs), acc[i]);
        } else {
          const auto sums = int8_panel_sums_avx2<HALVES>(wide, x.q.data() + at);
          for (int h = 0; h < HALVES; ++h)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h]), _mm256_mul_ps(ws[h], xs), acc[i]);
        }
      }
    }
  }
  if (l.mins) {
    for (int64_t g = 0; g < l.groups; ++g) {
      const int64_t at = l.mins_offset() + g * RT * l.scale_bytes;
      __m256 mn = _mm256_set_m128(ts[1].values(p[1] + at, g, true), ts[0].values(p[0] + at, g, true));
      if constexpr (INT4) mn = row_lanes(mn);
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.sums[(i0 + i) * x.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (i0 + i) * ldo, INT4 ? natural_rows(acc[i]) : acc[i]);
}

enum class Variant { kScalar, kAvx2, kVnni };

inline Variant variant() {
  if (g_isa_cap.load(std::memory_order_relaxed) == static_cast<int>(llk::Isa::kGeneric)) return Variant::kScalar;
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vnni");
  return vnni && avx512_allowed() ? Variant::kVnni : Variant::kAvx2;
}

using PanelFn = void (*)(const Int8X&, int64_t, const uint8_t* const*, const TileLayout&, float*, int64_t);

template <typename S, bool INT4, int HALVES>
std::array<PanelFn, MR + 1> panel_fns_of(bool vnni) {
  if (vnni)
    return {nullptr, panel_vnni<S, INT4, 1, HALVES>, panel_vnni<S, INT4, 2, HALVES>, panel_vnni<S, INT4, 3, HALVES>,
            panel_vnni<S, INT4, 4, HALVES>};
  return {nullptr, panel_avx2<S, INT4, 1, HALVES>, panel_avx2<S, INT4, 2, HALVES>, panel_avx2<S, INT4, 3, HALVES>,
          panel_avx2<S, INT4, 4, HALVES>};
}

// The panel kernels by rows of x; int8 in groups of 16 scales each block's halves apart.
template <typename S, bool INT4>
std::array<PanelFn, MR + 1> panel_fns(bool vnni, bool group16) {
  if constexpr (INT4) return panel_fns_of<S, true, 1>(vnni);
  else return group16 ? panel_fns_of<S, false, 2>(vnni) : panel_fns_of<S, false, 1>(vnni);
}

template <typename S, bool INT4>
void gemm_as(const float* xf, int64_t m, int64_t k, const uint8_t* tiles, int64_t group, bool mins, int64_t n,
             float* out) {
  const Variant v = variant();
  const TileLayout l = tile_layout(k, group, INT4, sizeof(S), mins);
  const Int8X x = quantize(xf, m, k, group, mins, INT4 && v != Variant::kScalar, v == Variant::kVnni ? 256 : 255,
                           v != Variant::kScalar, !INT4 && v == Variant::kAvx2, INT4 && v == Variant::kAvx2);
  const int64_t tiles_n = (n + RT - 1) / RT, tile_bytes = l.tile_bytes();
  if (v == Variant::kScalar) {
    at::parallel_for(0, tiles_n, 4, [&](int64_t t0, int64_t t1) { tiles_ref<S>(x, tiles, l, INT4, t0, t1, n, out); });
    return;
  }
  const bool vnni = v == Variant::kVnni;
  const int64_t per_panel = vnni ? 4 : 2, panels = n / (per_panel * RT);  // whole panels; the rest: scalar
  const std::array<PanelFn, MR + 1> fns = panel_fns<S, INT4>(vnni, group == 16);
  at::parallel_for(0, panels + 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pi = begin; pi < end; ++pi) {
      const int64_t t0 = pi * per_panel;
      if (pi == panels) {  // the last tiles that make no whole panel
        if (t0 < tiles_n) tiles_ref<S>(x, tiles, l, INT4, t0, tiles_n, n, out);
        continue;
      }
      const uint8_t* p[4];
      for (int t = 0; t < per_panel; ++t) p[t] = tiles + (t0 + t) * tile_bytes;
      for (int64_t i0 = 0; i0 < m; i0 += MR)
        fns[std::min<int64_t>(MR, m - i0)](x, i0, p, l, out + t0 * RT, n);
    }
  });
}

template <bool INT4>
void gemm_of(const float* x, int64_t m, int64_t k, const uint8_t* tiles, int64_t scale_bytes, int64_t group, bool mins,
             int64_t n, float* out) {
  if (scale_bytes == 2) gemm_as<uint16_t, INT4>(x, m, k, tiles, group, mins, n, out);
  else if (scale_bytes == 1) gemm_as<int8_t, INT4>(x, m, k, tiles, group, mins, n, out);
  else gemm_as<float, INT4>(x, m, k, tiles, group, mins, n, out);
}

inline void gemm(const float* x, int64_t m, int64_t k, const uint8_t* tiles, bool int4, int64_t scale_bytes,
                 int64_t group, bool mins, int64_t n, float* out) {
  if (int4) gemm_of<true>(x, m, k, tiles, scale_bytes, group, mins, n, out);
  else gemm_of<false>(x, m, k, tiles, scale_bytes, group, mins, n, out);
}

}  // namespace qgemm
