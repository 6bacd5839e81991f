// Many rows of x (prefill, a batched decode step, an MoE expert's tokens) against a packed
// int4/int8 weight in interleave_tiles' layout, with integer dot products as llama.cpp computes
// them: the activations are rounded once per row and per block of 32 inputs to
// q = round(x * LEVELS / max|x|) (round half to even); every block is then one exact integer dot
// product, scaled in float:
//     acc = fma(float(dot(w_block, q_block)), w_scale[group] * x_scale[block], acc)   (block order;
//                                                     int8 in groups of 16: each half block, in turn)
//     out = fma(min[group], sum(x over group), out)                                   (group order)
// (the sum of x exact in float). q has int16's precision (one int8 digit, llama.cpp's Q8
// activations, cost SmolLM2-135M Q4_1 +1.3 % perplexity): VNNI takes it as two int8 digits,
// q = 256 * hi + lo, AVX2 whole. Why this path: the int16 passes of quant_kernels.cpp recompute
// each weight block for every row with a float step per block, row and 8 lanes; here the weight
// is unpacked once for many rows of x and the float step is one per block, row and 16 (8) weight
// rows: a 64-row step computes from the packed bytes about as fast as from a float32 copy (AVX2)
// or faster (VNNI; docs/benchmarks.md).
//
// Layout of the products (VNNI): a tile's 32-bit lane holds 4 consecutive bytes of one weight row, so
// x goes to the lanes pre-arranged: int8 weights take x in input order; an int4 lane's low nibbles
// are inputs 8j, 8j+2, 8j+4, 8j+6 and its high ones 8j+1 ... 8j+7, so each x block is stored as
// [those 16 for the low nibbles | 16 for the high] (nibble_lanes).
// - AVX512-VNNI: vpdpbusd (u8 x s8 -> s32), rows in lanes. Each 4-tile panel (16 weight rows) is
//   prepared once for all the rows of x (prepare_panel512): per block, 8 vectors that hold, in
//   lane 4r + t, row r of tile t's 4 bytes that meet x's dword c, and the block's scales as
//   floats. Per row of x and digit, 8 vpdpbusd with x's dword broadcast by the load leave each
//   weight row's block sum in its own lane, with no reductions (8 rows of x a pass). Weights are
//   the unsigned operand: int4 nibbles as they are, int8 weights as w + 128, with 128 * sum(q)
//   over the block taken off (Int8X::qsum128).
// - AVX2: x as q whole (int16, Int8X::q) and the weight widened to int16 once per panel for all
//   the rows of x, transposed so each weight row's dot product builds up in its own int32 lane:
//   one vpmaddwd per 16 products and no reductions (panel_avx2).
// - scalar (`set_isa("generic")`): the same integers in plain loops, the same float steps (std::fma).
// int8 values held as E2M1 codes (TileLayout::e2m1) are looked up into those int8 values where a
// variant reads the bytes (e2m1_rows512, e2m1_row_avx2, tiles_ref), then are int8 weights.
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
constexpr int MR = 8;       // x rows per pass over a panel's block (VNNI)
constexpr int MR_AVX2 = 8;  // x rows per pass over a widened panel's block (AVX2)
constexpr int64_t X_BLOCK_BYTES = 128 << 10;  // x (int16) a block of rows holds (AVX2)

// Rows a block of Int8X::q holds: m, or m + 8 where m is a multiple of 16. A row's block is one
// 64-byte line, so with blocks m lines apart and m a multiple of 64 a pass of 8 rows over a span
// of blocks reads from only 8 of L1's 64 sets; a stride of 8 (mod 16) lines spreads 8 blocks' rows
// over all of them (2-4 % at 256 rows on a Zen 3).
inline int64_t padded_rows(int64_t m) { return m % 16 == 0 ? m + 8 : m; }

// x [m, k] rounded per 32-input block to q (|q| <= LEVELS), held whole (AVX2) or as two int8
// digits, q = base * hi + lo: base 256 (lo in -128..127) for VNNI, where the combination is one
// shift; base 255 (both in -127..127) for the scalar code. q is the same either way, and so is
// every integer dot product.
struct Int8X {
  int64_t m = 0, k = 0, groups = 0;
  bool lanes = false;        // the digits' blocks in nibble_lanes order
  int32_t base = 255;
  // [k / QB, block_rows, QB], block-major (a block's rows of x side by side: rows K apart share L1
  // sets when K is a multiple of 2,048, and a pass of rows reads them at fixed offsets): the digits
  // in input order (int8 weights, the scalar variant) or nibble_lanes order
  std::vector<int8_t> hi, lo;
  // [k / QB, block_rows, QB]: q whole instead of the digits (AVX2), block-major, in pair order: within each span
  // of `pairs` inputs (4: int8 weights, 8: int4), the first half's inputs each followed by its
  // partner in the second half (0, 2, 1, 3 or 0, 4, 1, 5, 2, 6, 3, 7), the pairs the widened weight
  // holds (widen_block_avx2).
  std::vector<int16_t> q;
  int pairs = 0;
  int64_t block_rows = 0;     // rows a block of q and scale holds (m, or m + 8: see padded_rows)
  std::vector<float> scale;  // [k / QB, block_rows]: a block's rows side by side
  std::vector<float> sums;   // [m, groups]: exact float sums of x over each weight group (for the mins)
  // [k / QB * halves, block_rows]: 128 * sum(q) over each block (halves 1) or half block (2), which
  // VNNI takes off int8 weights' sums as it multiplies them unsigned, w + 128 (input-order digits only)
  std::vector<int32_t> qsum128;
  int halves = 1;
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

// The vector form of quantize's block: the same max, the same q (cvtps rounds half to even, as
// nearbyint in the default rounding mode), q whole in pair order or its base-256 digits.
__attribute__((target("avx2,fma"))) inline void quantize_block_avx2(const float* xb, bool lanes,
                                                                     float* scale, int8_t* hi, int8_t* lo,
                                                                     int16_t* whole, int pairs,
                                                                     int32_t* qsum128 = nullptr, int halves = 1,
                                                                     int64_t qsum_stride = 0) {
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
    const __m256i order = pairs == 8 ? _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7) : _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
    for (int i = 0; i < 4; ++i)
      h[i] = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), order);
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(whole + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(h[2 * i], h[2 * i + 1]), 0xD8));
    return;
  }
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {  // base 256 (VNNI): hi = floor((q + 128) / 256)
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    h[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], _mm256_set1_epi32(128)), 8);
    l[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(h[i], 8));
  }
  if (qsum128 != nullptr) {  // 128 * sum(q): each half (inputs 0-15, 16-31) or the whole block
    alignas(32) int32_t half[2][8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(half[0]), _mm256_add_epi32(q[0], q[1]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(half[1]), _mm256_add_epi32(q[2], q[3]));
    int32_t sum[2] = {0, 0};
    for (int s = 0; s < 2; ++s)
      for (int j = 0; j < 8; ++j) sum[s] += half[s][j];
    if (halves == 2) qsum128[0] = 128 * sum[0], qsum128[qsum_stride] = 128 * sum[1];
    else qsum128[0] = 128 * (sum[0] + sum[1]);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), digits_avx2(h, lanes));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), digits_avx2(l, lanes));
}

// ``vector``: the AVX2 block (the SIMD variants; digits only in base 256, VNNI's), else the plain
// loop (the scalar variant). ``pairs`` (4 or 8, the vector block only): q itself in Int8X::q, in
// that pair order, instead of the digits.
inline Int8X quantize(const float* x, int64_t m, int64_t k, int64_t group, bool mins, bool lanes, int32_t base,
                      bool vector, int pairs = 0) {
  const int64_t nb = k / QB;
  Int8X r{m, k, k / group, lanes, base, {}, {}, {}, pairs, padded_rows(m), {}, {}, {}, group < QB ? 2 : 1};
  r.scale.resize(r.block_rows * nb);
  if (pairs != 0) r.q.resize(r.block_rows * k);
  else r.hi.resize(r.block_rows * k), r.lo.resize(r.block_rows * k);
  const bool qsums = vector && pairs == 0 && !lanes;  // VNNI's int8 weights
  if (qsums) r.qsum128.resize(r.block_rows * nb * r.halves);
  if (mins) r.sums.resize(m * r.groups);
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    int8_t hi[QB], lo[QB];
    for (int64_t i = begin; i < end; ++i) {
      const float* xr = x + i * k;
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = xr + b * QB;
        const int64_t at = (b * r.block_rows + i) * QB;
        if (vector) {
          float* scale = &r.scale[b * r.block_rows + i];
          if (pairs != 0)
            quantize_block_avx2(xb, lanes, scale, nullptr, nullptr, r.q.data() + at, pairs);
          else
            quantize_block_avx2(xb, lanes, scale, r.hi.data() + at, r.lo.data() + at, nullptr, 0,
                                qsums ? &r.qsum128[b * r.halves * r.block_rows + i] : nullptr, r.halves, r.block_rows);
          continue;
        }
        float amax = 0.f;
        for (int j = 0; j < QB; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float inv = amax > 0.f ? LEVELS / amax : 0.f;
        r.scale[b * r.block_rows + i] = amax / LEVELS;
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
// (bpg 0) pair up in a block: its two groups' scales, then its bytes. The layout's offsets are
// taken once here, not per block: the widening asks for every block of every panel.
struct TileView {
  const uint8_t* p;
  int64_t bpg, group_bytes, scale_row_bytes, block_row_bytes;
  const uint8_t *groups, *min_values;
  TileView(const uint8_t* tile, const TileLayout& l)
      : p(tile),
        bpg(l.bpg),
        group_bytes(l.group_bytes()),
        scale_row_bytes(RT * l.scale_bytes),
        block_row_bytes(RT * l.block_bytes),
        groups(tile + l.groups_offset()),
        min_values(tile + l.mins_offset()) {}
  const uint8_t* scales(int64_t g) const {
    if (bpg == 0) return groups + (g / 2) * 2 * group_bytes + (g % 2) * scale_row_bytes;
    return groups + g * group_bytes;
  }
  const uint8_t* block(int64_t g, int64_t e) const {
    if (bpg == 0) return scales(g - g % 2) + 2 * scale_row_bytes;
    return scales(g) + scale_row_bytes + e * block_row_bytes;
  }
  const uint8_t* mins(int64_t g) const { return min_values + g * scale_row_bytes; }
};

// Where input j of a block sits in x's block: nibble_lanes' order, pair order, or input order.
inline int lane_position(int j, const Int8X& x) {
  if (x.lanes) return (j % 2) * 16 + 4 * (j / 8) + (j % 8) / 2;
  if (x.pairs == 0) return j;
  const int half = x.pairs / 2, at = j % x.pairs;
  return j - at + (at < half ? 2 * at : 2 * (at - half) + 1);
}

// ---- scalar reference: tiles [t0, t1) for every row of x, in input order -------------------------
template <typename S>
__attribute__((optimize("fp-contract=off"))) void tiles_ref(const Int8X& x, const uint8_t* tiles, const TileLayout& l,
                                                             bool int4, int64_t t0, int64_t t1, int64_t n, float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const TileView tile{tiles + t * l.tile_bytes(), l};
    const TileScales<S> ts(tile.p, l);
    for (int r = 0; r < RT && t * RT + r < n; ++r)
      for (int64_t i = 0; i < x.m; ++i) {
        const auto q = [&](int64_t at) -> int32_t {  // the digits, or q whole
          const int64_t j = (at / QB * x.block_rows + i) * QB + at % QB;
          return x.q.empty() ? x.base * x.hi[j] + x.lo[j] : x.q[j];
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
              const int32_t wj = int4     ? (w[j / 2] >> (4 * (j % 2))) & 15
                                 : l.e2m1 ? kE2m1Values[(w[j % 16] >> (4 * (j / 16))) & 15]
                                          : static_cast<int8_t>(w[j]);
              const int64_t at = b * QB + lane_position(j, x);
              dot += wj * q(at);
            }
            acc = std::fma(static_cast<float>(dot), ws * x.scale[b * x.block_rows + i], acc);
          }
        }
        for (int64_t g = 0; l.mins && g < l.groups; ++g)
          acc = std::fma(ts.value(tile.mins(g), g, r, true), x.sums[i * x.groups + g], acc);
        out[i * n + t * RT + r] = acc;
      }
  }
}

// ---- AVX-512 VNNI: panels of 4 tiles (16 weight rows), rows in lanes --------------------------
// Each block of the panel is transposed once for all the rows of x (prepare_panel512) into 8 vectors
// W[c]: lane 4r + t holds row r of tile t's 4 weight bytes that meet x's dword c (its inputs
// 4c .. 4c+3 in x's order). Per row of x and digit, 8 vpdpbusd with x's dword broadcast from memory
// leave each weight row's block sum in its own int32 lane, with no reductions; the lanes' order
// (4r + t) is undone at the store. int8 weights go in unsigned, as w + 128, and 128 * sum(q) over
// the block (Int8X::qsum128) is taken off.

// The in-lane 4 x 4 transpose of dwords (dwords_by_row's, in zmm): out[j] lane 4L + t = in[t] lane
// 4L + j. (Values, not arrays: GCC keeps an array whose address is taken on the stack, and a zmm
// store reloaded at once stalls the block.)
__attribute__((target("avx512f"), always_inline)) inline void transpose_in_lanes(__m512i i0, __m512i i1, __m512i i2,
                                                                                __m512i i3, __m512i* out) {
  const __m512i a01l = _mm512_unpacklo_epi32(i0, i1), a01h = _mm512_unpackhi_epi32(i0, i1);
  const __m512i a23l = _mm512_unpacklo_epi32(i2, i3), a23h = _mm512_unpackhi_epi32(i2, i3);
  out[0] = _mm512_unpacklo_epi64(a01l, a23l);
  out[1] = _mm512_unpackhi_epi64(a01l, a23l);
  out[2] = _mm512_unpacklo_epi64(a01h, a23h);
  out[3] = _mm512_unpackhi_epi64(a01h, a23h);
}

// lane 4r + t <-> lane 4t + r (its own inverse): tile-major values to the lanes' order and back.
__attribute__((target("avx512f"))) inline __m512i transpose_index() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// The 4 tiles' RT values (group g's scales, or with `mins` its mins) at byte offset `at` of each, in
// the lanes' order.
template <typename S>
__attribute__((target("avx2,avx512f,f16c"))) inline __m512 panel_values(const TileScales<S>* ts, const uint8_t* const* p,
                                                                       int64_t at, int64_t g, bool mins, __m512i idx) {
  __m512 v = _mm512_castps128_ps512(ts[0].values(p[0] + at, g, mins));
  v = _mm512_insertf32x4(v, ts[1].values(p[1] + at, g, mins), 1);
  v = _mm512_insertf32x4(v, ts[2].values(p[2] + at, g, mins), 2);
  v = _mm512_insertf32x4(v, ts[3].values(p[3] + at, g, mins), 3);
  return _mm512_permutexvar_ps(idx, v);
}

// A tile block's RT rows of kE2m1Values codes (16 bytes a row) as an int8 block's two vectors: rows
// 0-1 and rows 2-3, each row's 32 values in input order, looked up in `book` (16 bytes, in every
// 128-bit lane).
__attribute__((target("avx512f,avx512bw"))) inline void e2m1_rows512(const uint8_t* p, __m512i book, __m512i& rows01,
                                                                    __m512i& rows23) {
  const __m512i raw = _mm512_loadu_si512(p), low4 = _mm512_set1_epi8(15);
  const __m512i lo = _mm512_shuffle_epi8(book, _mm512_and_si512(raw, low4));  // 128-bit lane r: row r's inputs 0-15
  const __m512i hi = _mm512_shuffle_epi8(book, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));  // 16-31
  rows01 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
  rows23 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
}

// One block of the panel (at byte offset `off` of each tile) as W[0..7] (see above), unsigned.
template <bool INT4>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void panel_block512(const uint8_t* const* p,
                                                                                     int64_t off, const TileLayout& l,
                                                                                     __m512i* w) {
  const auto load = [&](int t, int64_t at) { return _mm512_loadu_si512(p[t] + off + at); };
  if constexpr (INT4) {  // a tile's 4 rows of 16 bytes: lane 4r + j, the nibbles of x's dwords j and 4 + j
    __m512i bytes[4];
    transpose_in_lanes(load(0, 0), load(1, 0), load(2, 0), load(3, 0), bytes);
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; ++j) {
      w[j] = _mm512_and_si512(bytes[j], low4);
      w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(bytes[j], 4), low4);
    }
    return;
  }
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i book = _mm512_xor_si512(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Values))), bias);
  __m512i first[4], second[4];  // per tile, each row's dwords 0-3, and 4-7
  for (int t = 0; t < 4; ++t) {  // rows 0-1 | rows 2-3, 32 bytes a row
    __m512i r01, r23;
    if (l.e2m1) {
      e2m1_rows512(p[t] + off, book, r01, r23);
    } else {
      r01 = _mm512_xor_si512(load(t, 0), bias);
      r23 = _mm512_xor_si512(load(t, 64), bias);
    }
    first[t] = _mm512_shuffle_i64x2(r01, r23, _MM_SHUFFLE(2, 0, 2, 0));
    second[t] = _mm512_shuffle_i64x2(r01, r23, _MM_SHUFFLE(3, 1, 3, 1));
  }
  transpose_in_lanes(first[0], first[1], first[2], first[3], w);
  transpose_in_lanes(second[0], second[1], second[2], second[3], w + 4);
}

// acc + dot(w, x's 4 bytes at `at` in every lane), the bytes broadcast by the load ({1to16}): GCC
// emits a vpbroadcastd of its own instead, which takes a vector pipe (on a Zen 5, it halves the rate).
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dpbusd_broadcast(__m512i acc, __m512i w,
                                                                                             const int8_t* at) {
  using dword = int32_t __attribute__((may_alias));
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const dword*>(at)));
  return acc;
}

// Per row of x, the exact block sums over x's dwords [C0, C1) (the lanes' order): 256 * dot(w, hi)
// + dot(w, lo), less qsum128 (int8). |dot(w + 128, hi)| <= 32 * 255 * 128 < 2^21, so the shifted
// sum stays below 2^30.
template <int R, int C0, int C1, bool INT4>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void block_sums512(const Int8X& x, int64_t at,
                                                                                const __m512i* w, const int32_t* fix,
                                                                                __m512i* s) {
  const int8_t* hi = x.hi.data() + at;  // the block's rows side by side: every address a fixed offset
  const int8_t* lo = x.lo.data() + at;
  for (int i = 0; i < R; ++i) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int c = C0; c < C1; ++c)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = dpbusd_broadcast(s[i], w[c], hi + i * QB + 4 * c);
  for (int i = 0; i < R; ++i) s[i] = _mm512_slli_epi32(s[i], 8);
#pragma GCC unroll 8
  for (int c = C0; c < C1; ++c)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = dpbusd_broadcast(s[i], w[c], lo + i * QB + 4 * c);
  if constexpr (!INT4)
    for (int i = 0; i < R; ++i) s[i] = _mm512_sub_epi32(s[i], _mm512_set1_epi32(fix[i]));
}

// A prepared panel's storage, one vector's 64 bytes (the type the code built without AVX-512 names).
struct alignas(64) Vec512 {
  uint8_t bytes[64];
};

// Vectors a prepared block holds: W[0..7], then its HALVES groups' scales.
template <int HALVES>
constexpr int64_t kPreparedBlock = 8 + HALVES;

// The vectors a prepared panel of layout `l` takes: its blocks, then one per group for the mins.
inline int64_t prepared_vectors(const TileLayout& l, int64_t k, int halves) {
  return k / QB * (8 + halves) + (l.mins ? l.groups : 0);
}

// A panel prepared once for all the passes of R rows of x: per block, W[0..7] and the scales of its
// HALVES groups as floats (8 + HALVES vectors, in the lanes' order), then each group's mins (`mins`).
// Read from the thread's buffer, the block's vectors cost the passes one load each, and the
// transpose and the scale conversions are done once per panel rather than once per pass.
template <typename S, bool INT4, int HALVES>
__attribute__((target("avx512f,avx512bw,f16c"))) void prepare_panel512(const uint8_t* const* p, const TileLayout& l,
                                                                      Vec512* prepared) {
  __m512i* out = reinterpret_cast<__m512i*>(prepared);
  const __m512i idx = transpose_index();
  const TileScales<S> ts[4] = {{p[0], l}, {p[1], l}, {p[2], l}, {p[3], l}};
  int64_t off = l.groups_offset();  // byte offset of the group (then block) inside every tile of the panel
  for (int64_t g = 0; g < l.groups; g += HALVES) {
    __m512 ws[HALVES];
    for (int h = 0; h < HALVES; ++h) ws[h] = panel_values<S>(ts, p, off + h * RT * l.scale_bytes, g + h, false, idx);
    off += HALVES * RT * l.scale_bytes;
    for (int64_t e = 0; e < (HALVES == 2 ? 1 : l.bpg); ++e, off += RT * l.block_bytes, out += kPreparedBlock<HALVES>) {
      __m512i w[8];
      panel_block512<INT4>(p, off, l, w);
      for (int c = 0; c < 8; ++c) _mm512_store_si512(out + c, w[c]);
      for (int h = 0; h < HALVES; ++h) _mm512_store_ps(reinterpret_cast<float*>(out + 8 + h), ws[h]);
    }
  }
  for (int64_t g = 0; l.mins && g < l.groups; ++g, ++out)
    _mm512_store_ps(reinterpret_cast<float*>(out),
                    panel_values<S>(ts, p, l.mins_offset() + g * RT * l.scale_bytes, g, true, idx));
}

// R rows of x (R <= MR) against one prepared panel: the whole K, then the mins, stored in column
// order. HALVES 2: int8 in groups of 16, each block's halves scaled apart (first, then second).
template <bool INT4, int R, int HALVES = 1>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void panel_vnni(const Int8X& x, int64_t i0,
                                                                       const Vec512* prepared, const TileLayout& l,
                                                                       float* out, int64_t ldo) {
  const __m512i* panel = reinterpret_cast<const __m512i*>(prepared);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t blocks = x.k / QB;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i* w = panel + b * kPreparedBlock<HALVES>;
    const float* xs = x.scale.data() + b * x.block_rows + i0;
    const int32_t* fix = INT4 ? nullptr : x.qsum128.data() + b * HALVES * x.block_rows + i0;
    const int64_t row0 = (b * x.block_rows + i0) * QB;
    __m512i s[R];
    for (int h = 0; h < HALVES; ++h) {
      if constexpr (HALVES == 1) block_sums512<R, 0, 8, INT4>(x, row0, w, fix, s);
      else if (h == 0) block_sums512<R, 0, 4, INT4>(x, row0, w, fix, s);
      else block_sums512<R, 4, 8, INT4>(x, row0, w, fix + x.block_rows, s);
      const __m512 ws = _mm512_load_ps(reinterpret_cast<const float*>(w + 8 + h));
      for (int i = 0; i < R; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(ws, _mm512_set1_ps(xs[i])), acc[i]);
    }
  }
  const float* mins = reinterpret_cast<const float*>(panel + blocks * kPreparedBlock<HALVES>);
  for (int64_t g = 0; l.mins && g < l.groups; ++g) {
    const __m512 mn = _mm512_load_ps(mins + 16 * g);
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.sums[(i0 + i) * x.groups + g]), acc[i]);
  }
  const __m512i idx = transpose_index();
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + (i0 + i) * ldo, _mm512_permutexvar_ps(idx, acc[i]));
}

// ---- AVX2: panels of 2 tiles (8 weight rows), rows in lanes ------------------------------------
// The panel's weight is widened once, for all the rows of x, to int16 pairs transposed so that one
// vector holds the 8 weight rows' values of one pair of inputs (the pair x.q holds side by side):
// per row of x and pair, one broadcast of x's pair, one vpmaddwd and one vpaddd leave each weight
// row's dot product in its own int32 lane, with no reductions. Lanes hold the rows in the order
// 0, 2, 4, 6, 1, 3, 5, 7 (row_lanes), undone at the store.

// Natural row order (r0..r7) -> the lanes' (lane L holds row 0, 2, 4, 6, 1, 3, 5, 7) and back.
__attribute__((target("avx2"))) inline __m256 row_lanes(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
__attribute__((target("avx2"))) inline __m256 natural_rows(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Four vectors of two rows' 4 dwords each (rows 0|1, 2|3, 4|5, 6|7 in the 128-bit halves) -> v[j]:
// dword j of the 8 rows, in row_lanes' order.
__attribute__((target("avx2"))) inline void dwords_by_row(__m256i a, __m256i b, __m256i c, __m256i d, __m256i* v) {
  const __m256i ab_lo = _mm256_unpacklo_epi32(a, b), ab_hi = _mm256_unpackhi_epi32(a, b);
  const __m256i cd_lo = _mm256_unpacklo_epi32(c, d), cd_hi = _mm256_unpackhi_epi32(c, d);
  v[0] = _mm256_unpacklo_epi64(ab_lo, cd_lo);
  v[1] = _mm256_unpackhi_epi64(ab_lo, cd_lo);
  v[2] = _mm256_unpacklo_epi64(ab_hi, cd_hi);
  v[3] = _mm256_unpackhi_epi64(ab_hi, cd_hi);
}

// 16 bytes of a row and the same 16 of the next (`stride` bytes on), in the two 128-bit halves.
__attribute__((target("avx2"))) inline __m256i two_rows(const uint8_t* row0, int64_t stride) {
  return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(row0 + stride),
                             reinterpret_cast<const __m128i*>(row0));
}

// One block of the panel's two tiles (t0, t1: its bytes in each) -> 16 vectors, vector p: the 8 rows'
// int16 pair p. int4 (16 bytes a row): dword j of a row is inputs 8j .. 8j+7, one per nibble, so the
// 16-bit words' nibble c pair inputs (8j + c, 8j + 4 + c): pair 4j + c. int8 (32 bytes a row): dword
// j of a half is inputs 4j .. 4j+3, the words' low bytes pair (4j, 4j + 2), their high bytes
// (4j + 1, 4j + 3): pairs 2j and 2j + 1.
template <bool INT4>
__attribute__((target("avx2"))) inline void widen_block_avx2(const uint8_t* t0, const uint8_t* t1, __m256i* w) {
  __m256i v[4];
  if constexpr (INT4) {
    dwords_by_row(two_rows(t0, 16), two_rows(t0 + 32, 16), two_rows(t1, 16), two_rows(t1 + 32, 16), v);
    const __m256i nibble = _mm256_set1_epi16(15);
    for (int j = 0; j < 4; ++j) {
      w[4 * j] = _mm256_and_si256(v[j], nibble);
      w[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), nibble);
      w[4 * j + 2] = _mm256_and_si256(_mm256_srli_epi16(v[j], 8), nibble);
      w[4 * j + 3] = _mm256_srli_epi16(v[j], 12);
    }
    return;
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t at = 16 * half;
    dwords_by_row(two_rows(t0 + at, 32), two_rows(t0 + 64 + at, 32), two_rows(t1 + at, 32), two_rows(t1 + 64 + at, 32),
                  v);
    for (int j = 0; j < 4; ++j) {
      w[8 * half + 2 * j] = _mm256_srai_epi16(_mm256_slli_epi16(v[j], 8), 8);
      w[8 * half + 2 * j + 1] = _mm256_srai_epi16(v[j], 8);
    }
  }
}

// One row's block of kE2m1Values codes -> its 32 int8 values in input order.
__attribute__((target("avx2"))) inline void e2m1_row_avx2(const uint8_t* codes, uint8_t* values) {
  __m128i lo, hi;
  E2m1Block::values(codes, lo, hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(values), lo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(values + 16), hi);
}

// The first block of group g (groups of 16: two groups a block).
inline int64_t first_block(const TileLayout& l, int64_t g) { return l.bpg == 0 ? g / 2 : g * l.bpg; }

// Groups [g0, g1) of the panel: its blocks widened, 16 vectors a block in block order, and its 8
// rows' scales of each group as floats in row_lanes' order (once a span, not once per rows of x).
template <typename S, bool INT4>
__attribute__((target("avx2,f16c"))) void widen_panel_avx2(const uint8_t* const* p, const TileLayout& l, int64_t g0,
                                                           int64_t g1, int16_t* wide, float* scales) {
  const TileView a{p[0], l}, b{p[1], l};
  const TileScales<S> ts[2] = {{p[0], l}, {p[1], l}};
  for (int64_t g = g0; g < g1; ++g)
    _mm256_storeu_ps(scales + 8 * (g - g0),
                     row_lanes(_mm256_set_m128(ts[1].values(b.scales(g), g), ts[0].values(a.scales(g), g))));
  // group by group, its blocks block_row_bytes apart (groups of 16: two to a block)
  const int64_t group_step = l.bpg == 0 ? 2 : 1, blocks_per_step = l.bpg == 0 ? 1 : l.bpg;
  for (int64_t g = g0, blk = 0; g < g1; g += group_step)
    for (int64_t e = 0; e < blocks_per_step; ++e, ++blk) {
      const uint8_t* ta = a.block(g, e);
      const uint8_t* tb = b.block(g, e);
      for (const uint8_t* at : {ta, tb})  // the stream TILE_PREFETCH ahead, as the int16 passes
        for (int line = 0; line < RT * l.block_bytes / 64; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(at + TILE_PREFETCH + 64 * line), _MM_HINT_T0);
      __m256i w[16];
      if (!INT4 && l.e2m1) {  // looked up into the int8 block it stands for, then widened as one
        alignas(32) uint8_t va[RT * QB], vb[RT * QB];
        for (int r = 0; r < RT; ++r) {
          e2m1_row_avx2(ta + r * E2m1Block::BYTES, va + r * QB);
          e2m1_row_avx2(tb + r * E2m1Block::BYTES, vb + r * QB);
        }
        widen_block_avx2<false>(va, vb, w);
      } else {
        widen_block_avx2<INT4>(ta, tb, w);
      }
      for (int pair = 0; pair < 16; ++pair)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + 16 * (16 * blk + pair)), w[pair]);
    }
}

// R rows of x's int32 sums over pairs [P0, P1) of a block: per pair and row, a broadcast of x's
// pair, vpmaddwd, vpaddd.
// |128 * 32512 * 32| < 2^31.
template <int R, int P0, int P1>
__attribute__((target("avx2"))) inline void pair_sums_avx2(const int16_t* w, const int16_t* q, __m256i* s) {
  for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int pair = P0; pair < P1; ++pair) {
    const __m256i wp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * pair));
    for (int i = 0; i < R; ++i) {
      int32_t xp;
      std::memcpy(&xp, q + i * QB + 2 * pair, 4);  // row i of the block
      s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(wp, _mm256_set1_epi32(xp)));
      __asm__("" : "+x"(s[i]));  // keeps the sum a running one: GCC's add tree would spill the products
    }
  }
}

// R rows of x (R <= MR_AVX2) against groups [g0, g1) of one panel, widened in `wide`: the running
// sums carry over in `partial` ([R][8], lane order) from one span of groups to the next, so a long
// K is widened a span at a time (the widened span stays in L1 for all the rows of x); the last
// span adds the mins and stores the rows. HALVES 2: int8 in groups of 16, each block's halves
// scaled apart (first, then second).
template <typename S, bool INT4, int R, int HALVES = 1>
__attribute__((target("avx2,fma,f16c"))) void panel_avx2(const Int8X& x, int64_t i0, const uint8_t* const* p,
                                                          const TileLayout& l, const int16_t* wide,
                                                          const float* scales, int64_t g0, int64_t g1, float* partial,
                                                          float* out, int64_t ldo) {
  __m256 acc[R];
  alignas(32) static const float zeros[8] = {};  // loaded, not stored: a spilled zero array costs a rep stos a call
  for (int i = 0; i < R; ++i) acc[i] = _mm256_loadu_ps(g0 == 0 ? zeros : partial + 8 * i);
  for (int64_t g = g0, b = first_block(l, g0); g < g1; g += HALVES) {
    __m256 ws[HALVES];
    for (int h = 0; h < HALVES; ++h) ws[h] = _mm256_loadu_ps(scales + 8 * (g + h - g0));
    for (int64_t e = 0; e < (HALVES == 2 ? 1 : l.bpg); ++e, ++b) {
      const int16_t* w = wide + 256 * (b - first_block(l, g0));
      const int16_t* q = x.q.data() + (b * x.block_rows + i0) * QB;  // the R rows side by side
      const float* block_scale = x.scale.data() + b * x.block_rows + i0;
      __m256 xs[R];
      for (int i = 0; i < R; ++i) xs[i] = _mm256_set1_ps(block_scale[i]);
      __m256i s[R];
      if constexpr (HALVES == 1) {
        pair_sums_avx2<R, 0, 16>(w, q, s);
        for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(ws[0], xs[i]), acc[i]);
      } else {
        pair_sums_avx2<R, 0, 8>(w, q, s);
        for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(ws[0], xs[i]), acc[i]);
        pair_sums_avx2<R, 8, 16>(w, q, s);
        for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(ws[1], xs[i]), acc[i]);
      }
    }
  }
  if (g1 < l.groups) {
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(partial + 8 * i, acc[i]);
    return;
  }
  if (l.mins) {
    const TileScales<S> ts[2] = {{p[0], l}, {p[1], l}};
    const TileView a{p[0], l}, b{p[1], l};
    for (int64_t g = 0; g < l.groups; ++g) {
      const __m256 mn = row_lanes(_mm256_set_m128(ts[1].values(b.mins(g), g, true), ts[0].values(a.mins(g), g, true)));
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.sums[(i0 + i) * x.groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (i0 + i) * ldo, natural_rows(acc[i]));
}

enum class Variant { kScalar, kAvx2, kVnni };

inline Variant variant() {
  if (g_isa_cap.load(std::memory_order_relaxed) == static_cast<int>(llk::Isa::kGeneric)) return Variant::kScalar;
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vnni");
  return vnni && avx512_allowed() ? Variant::kVnni : Variant::kAvx2;
}

using PanelFn = void (*)(const Int8X&, int64_t, const Vec512*, const TileLayout&, float*, int64_t);
using PrepareFn = void (*)(const uint8_t* const*, const TileLayout&, Vec512*);
using WidePanelFn = void (*)(const Int8X&, int64_t, const uint8_t* const*, const TileLayout&, const int16_t*,
                             const float*, int64_t, int64_t, float*, float*, int64_t);

// The panel kernels by rows of x (index R) and the panel's preparation; int8 in groups of 16
// scales each block's halves apart.
template <typename S, bool INT4, int HALVES>
std::pair<std::array<PanelFn, MR + 1>, PrepareFn> vnni_fns_of() {
  return {{nullptr, panel_vnni<INT4, 1, HALVES>, panel_vnni<INT4, 2, HALVES>, panel_vnni<INT4, 3, HALVES>,
           panel_vnni<INT4, 4, HALVES>, panel_vnni<INT4, 5, HALVES>, panel_vnni<INT4, 6, HALVES>,
           panel_vnni<INT4, 7, HALVES>, panel_vnni<INT4, 8, HALVES>},
          prepare_panel512<S, INT4, HALVES>};
}
template <typename S, bool INT4, int HALVES>
std::array<WidePanelFn, MR_AVX2 + 1> avx2_fns_of() {
  return {nullptr,
          panel_avx2<S, INT4, 1, HALVES>,
          panel_avx2<S, INT4, 2, HALVES>,
          panel_avx2<S, INT4, 3, HALVES>,
          panel_avx2<S, INT4, 4, HALVES>,
          panel_avx2<S, INT4, 5, HALVES>,
          panel_avx2<S, INT4, 6, HALVES>,
          panel_avx2<S, INT4, 7, HALVES>,
          panel_avx2<S, INT4, 8, HALVES>};
}
template <typename S, bool INT4>
std::pair<std::array<PanelFn, MR + 1>, PrepareFn> vnni_fns(bool group16) {
  if constexpr (INT4) return vnni_fns_of<S, true, 1>();
  else return group16 ? vnni_fns_of<S, false, 2>() : vnni_fns_of<S, false, 1>();
}
template <typename S, bool INT4>
std::array<WidePanelFn, MR_AVX2 + 1> avx2_fns(bool group16) {
  if constexpr (INT4) return avx2_fns_of<S, true, 1>();
  else return group16 ? avx2_fns_of<S, false, 2>() : avx2_fns_of<S, false, 1>();
}

// At least n elements (grown, never shrunk: a thread's scratch between calls).
template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// kind: kInt4Weights (INT4), or kInt8Weights / kE2m1Weights (int8 values, read as stored).
template <typename S, bool INT4>
void gemm_as(const float* xf, int64_t m, int64_t k, const uint8_t* tiles, int64_t kind, int64_t group, bool mins,
             int64_t n, float* out) {
  const Variant v = variant();
  const TileLayout l = tile_layout(k, group, kind, sizeof(S), mins);
  const Int8X x = quantize(xf, m, k, group, mins, INT4 && v == Variant::kVnni, v == Variant::kVnni ? 256 : 255,
                           v != Variant::kScalar, v == Variant::kAvx2 ? (INT4 ? 8 : 4) : 0);
  const int64_t tiles_n = (n + RT - 1) / RT, tile_bytes = l.tile_bytes();
  if (v == Variant::kScalar) {
    at::parallel_for(0, tiles_n, 4, [&](int64_t t0, int64_t t1) { tiles_ref<S>(x, tiles, l, INT4, t0, t1, n, out); });
    return;
  }
  const bool vnni = v == Variant::kVnni;
  const int64_t per_panel = vnni ? 4 : 2, panels = n / (per_panel * RT);  // whole panels; the rest: scalar
  const auto [vnni_panel, prepare_panel] =
      vnni ? vnni_fns<S, INT4>(group == 16) : std::pair<std::array<PanelFn, MR + 1>, PrepareFn>{};
  const int64_t prepared_size = vnni ? prepared_vectors(l, k, group == 16 && !INT4 ? 2 : 1) : 0;
  const std::array<WidePanelFn, MR_AVX2 + 1> avx2_panel =
      vnni ? std::array<WidePanelFn, MR_AVX2 + 1>{} : avx2_fns<S, INT4>(group == 16);
  // AVX2: a panel is widened SPAN blocks at a time (16 KiB), whole groups
  constexpr int64_t SPAN = 32;
  const int64_t span_groups = l.bpg == 0 ? 2 * SPAN : std::max<int64_t>(1, SPAN / l.bpg);
  // AVX2: rows of x in blocks of about X_BLOCK_BYTES (a multiple of MR_AVX2 rows), each run past
  // all of a thread's panels, so that the block stays in L2 while the panels stream by
  const int64_t row_block = vnni ? m : std::max<int64_t>(MR_AVX2, X_BLOCK_BYTES / (2 * k) / MR_AVX2 * MR_AVX2);
  at::parallel_for(0, panels + 1, 1, [&](int64_t begin, int64_t end) {
    // each thread's widened span, its scales and the running sums, kept between calls (an MoE
    // step makes thousands of small calls; fresh vectors were zeroed and freed each time)
    thread_local std::vector<int16_t> wide_buffer;
    thread_local std::vector<float> scales_buffer, partial_buffer;
    thread_local std::vector<Vec512> prepared_buffer;
    if (vnni) grow(prepared_buffer, prepared_size);
    if (!vnni) {
      grow(wide_buffer, 256 * first_block(l, span_groups));
      grow(scales_buffer, 8 * span_groups);
      grow(partial_buffer, 8 * m);
    }
    int16_t* const wide = wide_buffer.data();
    float* const scales = scales_buffer.data();
    float* const partial = partial_buffer.data();
    if (end > panels) {  // the last tiles that make no whole panel
      if (panels * per_panel < tiles_n) tiles_ref<S>(x, tiles, l, INT4, panels * per_panel, tiles_n, n, out);
      end = panels;
    }
    for (int64_t r0 = 0; r0 < m; r0 += row_block) {
      const int64_t r1 = std::min(m, r0 + row_block);
      for (int64_t pi = begin; pi < end; ++pi) {
        const int64_t t0 = pi * per_panel;
        const uint8_t* p[4];
        for (int t = 0; t < per_panel; ++t) p[t] = tiles + (t0 + t) * tile_bytes;
        if (vnni) {
          Vec512* prepared = prepared_buffer.data();
          prepare_panel(p, l, prepared);
          for (int64_t i0 = 0; i0 < m; i0 += MR)
            vnni_panel[std::min<int64_t>(MR, m - i0)](x, i0, prepared, l, out + t0 * RT, n);
          continue;
        }
        for (int64_t g0 = 0; g0 < l.groups; g0 += span_groups) {
          const int64_t g1 = std::min(l.groups, g0 + span_groups);
          widen_panel_avx2<S, INT4>(p, l, g0, g1, wide, scales);
          for (int64_t i0 = r0; i0 < r1; i0 += MR_AVX2)
            avx2_panel[std::min<int64_t>(MR_AVX2, r1 - i0)](x, i0, p, l, wide, scales, g0, g1, partial + 8 * i0,
                                                            out + t0 * RT, n);
        }
      }
    }
  });
}

template <bool INT4>
void gemm_of(const float* x, int64_t m, int64_t k, const uint8_t* tiles, int64_t kind, int64_t scale_bytes,
             int64_t group, bool mins, int64_t n, float* out) {
  if (scale_bytes == 2) gemm_as<uint16_t, INT4>(x, m, k, tiles, kind, group, mins, n, out);
  else if (scale_bytes == 1) gemm_as<int8_t, INT4>(x, m, k, tiles, kind, group, mins, n, out);
  else gemm_as<float, INT4>(x, m, k, tiles, kind, group, mins, n, out);
}

inline void gemm(const float* x, int64_t m, int64_t k, const uint8_t* tiles, int64_t kind, int64_t scale_bytes,
                 int64_t group, bool mins, int64_t n, float* out) {
  if (kind == kInt4Weights) gemm_of<true>(x, m, k, tiles, kind, scale_bytes, group, mins, n, out);
  else gemm_of<false>(x, m, k, tiles, kind, scale_bytes, group, mins, n, out);
}

}  // namespace qgemm
