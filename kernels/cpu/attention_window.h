// Sliding-window attention and attention-logit soft-capping, shared by the attention kernels, with
// Hugging Face transformers' semantics (masking_utils.sliding_window_overlay, Gemma 2's eager
// attention):
// - a window W > 0: the query at position q sees the keys k with q - W < k <= q (W keys, itself
//   included); W <= 0 is no window;
// - a soft cap c > 0: each score s = q . k * scale becomes c * tanh(s / c) before the mask and the
//   softmax; c <= 0 is none.
#pragma once

#include <cmath>
#include <cstdint>

namespace llk {

// The first key a query at position `pos` sees.
inline int64_t window_first(int64_t pos, int64_t window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

// s[0..n) <- cap * tanh(s / cap).
inline void softcap_scores(float* s, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

}  // namespace llk
