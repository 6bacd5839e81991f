// Included inside each ISA namespace that uses it (attention_tiles.h, and the AVX512-BF16 decode
// kernel of cpu_kernels.cpp), so that it inlines under that namespace's target options.

// Software prefetch over a task's rows of the cache, a few lines at a time, so that a tile's
// prefetches can be spread over its compute (blocks sit anywhere in the pool, so the hardware
// prefetcher loses the stream at every block boundary). Issued all at once they fill the line fill
// buffers, the core stalls on them, and memory then idles while it computes (on a 2-core AMX Xeon
// the times of the two added up; docs/benchmarks.md, "Decode attention"). The next line is line l of the row
// of token t (t < end), a row being lines_per_row lines from cache + offset[t] elements.
template <typename C>
struct PrefetchCursor {
  PrefetchCursor(const C* cache, const int64_t* offset, int64_t t, int64_t end, int64_t lines_per_row)
      : cache(cache), offset(offset), t(t), end(end), lines_per_row(lines_per_row) {}

  template <_mm_hint kHint = _MM_HINT_T0>
  void issue(int64_t n) {
    for (; n > 0 && t < end; --n) {
      _mm_prefetch(reinterpret_cast<const char*>(cache + offset[t]) + l * 64, kHint);
      if (++l == lines_per_row) l = 0, ++t;
    }
  }
  // lines per step that finish the cursor in `steps` steps
  int64_t share(int64_t steps) const {
    const int64_t left = std::max<int64_t>(end - t, 0) * lines_per_row - (t < end ? l : 0);
    return (left + steps - 1) / steps;
  }

  const C* cache;
  const int64_t* offset;
  int64_t t, end, lines_per_row, l = 0;
};
