// One instruction set's fp32 panel GEMM, included by gemm_kernels.cpp inside a namespace that
// defines the vector type `V` (VW floats), vzero / vload / vbcast / vfma / vstore / prefetch /
// prefetch_l2, and the tiling constants CHAINS (accumulator vectors a tile may hold), ROWS (rows of
// a full tile) and GROUP (panels processed together). The generic variant is the same code with V = float.
//
// Every output element y[m, n] is ONE accumulator that starts at 0 and takes x[m, k] * w[n, k] for
// k = 0, 1, ..., K-1 by fused multiply-add, then (if there is a bias) one add. Vector lanes, tiles,
// K blocks (the partial sum is stored as fp32 and reloaded, which changes nothing), row tails,
// panel groups and threads only decide which element is computed when, never its arithmetic: a
// row's result is bitwise the same whatever M is, wherever it sits in a tile, whatever the thread
// count, and in every ISA variant (an FMA is exactly rounded in each of them).

constexpr int VPP = 16 / VW;  // vectors per 16-column panel

// Panels a tile of `rows` rows takes at once: enough independent accumulation chains
// to cover the FMA latency when few rows are left (P > 1 only for tails).
constexpr int panels_for(int rows) {
  const int p = CHAINS / (rows * VPP);
  return p < 1 ? 1 : (p > GROUP ? GROUP : p);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool, const float*,
                       int64_t);

// y[r, p*16 + c] (+)= sum_k x[r, k] * w_p[k, c] over k < kc for R rows and P panels; `first`: the
// accumulators start at 0, else at the partial sums already in y (an earlier K block). Every
// AHEAD_EVERY k steps it prefetches the next line of `ahead` (P panels at wstride), `ahead_lines`
// lines in all: a slice of the block read next (prefetches only; 0 lines: none).
template <int R, int P>
void tile(const float* x, int64_t ldx, const float* w, int64_t wstride, float* y, int64_t ldy, int64_t kc,
          bool first, const float* ahead, int64_t ahead_lines) {
  V acc[R][P * VPP];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int j = 0; j < P * VPP; ++j) acc[r][j] = first ? vzero() : vload(y + r * ldy + (j / VPP) * 16 + (j % VPP) * VW);
  for (int64_t k = 0; k < kc; ++k) {
    if (k % AHEAD_EVERY == 0 && k / AHEAD_EVERY < ahead_lines)
#pragma GCC unroll 64
      for (int p = 0; p < P; ++p) prefetch_l2(ahead + p * wstride + (k / AHEAD_EVERY) * 16);
#pragma GCC unroll 64
    for (int p = 0; p < P; ++p) {
      prefetch(w + p * wstride + (k + PREFETCH_K) * 16);  // one 64-byte line of w per k
      V b[VPP];
#pragma GCC unroll 16
      for (int v = 0; v < VPP; ++v) b[v] = vload(w + p * wstride + k * 16 + v * VW);
#pragma GCC unroll 64
      for (int r = 0; r < R; ++r) {
        const V a = vbcast(x + r * ldx + k);
#pragma GCC unroll 16
        for (int v = 0; v < VPP; ++v) acc[r][p * VPP + v] = vfma(a, b[v], acc[r][p * VPP + v]);
      }
    }
  }
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int j = 0; j < P * VPP; ++j) vstore(y + r * ldy + (j / VPP) * 16 + (j % VPP) * VW, acc[r][j]);
}

template <int R, int P>
constexpr TileFn tile_or_null() {
  if constexpr (P <= panels_for(R)) return &tile<R, P>;
  else return nullptr;
}

template <int R, int... Ps>
constexpr std::array<TileFn, GROUP + 1> tile_row(std::integer_sequence<int, Ps...>) {
  return {nullptr, tile_or_null<R, Ps + 1>()...};
}

template <int... Rs>
constexpr std::array<std::array<TileFn, GROUP + 1>, ROWS + 1> tile_table(std::integer_sequence<int, Rs...>) {
  return {std::array<TileFn, GROUP + 1>{}, tile_row<Rs + 1>(std::make_integer_sequence<int, GROUP>())...};
}

// TILES[R][P]: the tile of R rows and P panels (null where P exceeds panels_for(R)).
constexpr auto TILES = tile_table(std::make_integer_sequence<int, ROWS>());

// The last panel when N is not a multiple of 16: computed into a 16-wide scratch tile, then its
// valid columns are copied out (the partial sums go in and out unchanged).
void ragged_panel(const GemmArgs& a, int64_t panel, int64_t m0, int64_t m1, int64_t k0, int64_t kc) {
  const int64_t cols = a.n - panel * 16;
  float scratch[ROWS * 16];
  for (int64_t r0 = m0; r0 < m1; r0 += ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(ROWS, m1 - r0));
    float* y = a.y + r0 * a.ldy + panel * 16;
    if (k0 > 0)
      for (int r = 0; r < rows; ++r) std::memcpy(scratch + r * 16, y + r * a.ldy, cols * sizeof(float));
    TILES[rows][1](a.x + r0 * a.ldx + k0, a.ldx, a.w + panel * a.k * 16 + k0 * 16, a.k * 16, scratch, 16, kc, k0 == 0,
                   nullptr, 0);
    for (int r = 0; r < rows; ++r) std::memcpy(y + r * a.ldy, scratch + r * 16, cols * sizeof(float));
  }
}

// Panels [p0, p1) of the output, all rows. Rows in blocks of MC; in a block, panels in groups of
// GROUP, each group's panels read from k = 0 to K (contiguous streams of the packed weight, which a
// decode step reads from memory once) in blocks of KC: a block of the group's weights stays in
// cache across the row tiles, a block of x (MC x KC) in L2 across the group's panels. While a
// block is computed, its row tiles prefetch the block read next (the group's next K block, else
// the next group's first), each tile a slice of it, AHEAD_EVERY k steps to a line.
void gemm_panels(const GemmArgs& a, int64_t p0, int64_t p1) {
  const int64_t full = std::min(p1, a.n / 16);  // panels with 16 valid columns
  for (int64_t m0 = 0; m0 < a.m; m0 += MC) {
    const int64_t m1 = std::min<int64_t>(a.m, m0 + MC);
    for (int64_t g0 = p0; g0 < full; g0 += GROUP) {
      const int64_t g1 = std::min(g0 + GROUP, full);
      for (int64_t k0 = 0; k0 < a.k; k0 += KC) {
        const int64_t kc = std::min<int64_t>(KC, a.k - k0);
        const bool last_block = k0 + KC >= a.k;  // of this group: the next is the next group's first
        const int64_t next_g0 = last_block ? g1 : g0, next_g1 = last_block ? std::min(g1 + GROUP, full) : g1;
        const int64_t next_k0 = last_block ? 0 : k0 + KC, next_kc = std::min<int64_t>(KC, a.k - next_k0);
        const int64_t lines_per_tile = (kc + AHEAD_EVERY - 1) / AHEAD_EVERY;
        int64_t line = 0;  // k steps of the next block the earlier row tiles asked for, in each panel
        for (int64_t r0 = m0; r0 < m1; r0 += ROWS, line += lines_per_tile) {
          const int rows = static_cast<int>(std::min<int64_t>(ROWS, m1 - r0));
          const int step = panels_for(rows);
          for (int64_t p = g0; p < g1; p += step) {
            const int panels = static_cast<int>(std::min<int64_t>(step, g1 - p));
            const int64_t next_p = next_g0 + (p - g0);  // the panels this tile prefetches: as many as it reads
            const bool ahead = line < next_kc && next_p + panels <= next_g1;
            TILES[rows][panels](a.x + r0 * a.ldx + k0, a.ldx, a.w + p * a.k * 16 + k0 * 16, a.k * 16,
                                a.y + r0 * a.ldy + p * 16, a.ldy, kc, k0 == 0,
                                ahead ? a.w + next_p * a.k * 16 + (next_k0 + line) * 16 : nullptr,
                                ahead ? std::min(lines_per_tile, next_kc - line) : 0);
          }
        }
      }
    }
    if (full < p1 && full * 16 < a.n)  // the ragged last panel is in this range
      for (int64_t k0 = 0; k0 < a.k; k0 += KC) ragged_panel(a, full, m0, m1, k0, std::min<int64_t>(KC, a.k - k0));
  }
  if (a.bias != nullptr) {
    const int64_t n0 = p0 * 16, n1 = std::min(p1 * 16, a.n);
    for (int64_t m = 0; m < a.m; ++m)
      for (int64_t n = n0; n < n1; ++n) a.y[m * a.ldy + n] += a.bias[n];
  }
}
