// Sliding-window attention, attention-logit soft-capping and attention sinks, shared by the
// attention kernels, with Hugging Face transformers' semantics (masking_utils.sliding_window_overlay,
// Gemma 2's eager attention, gpt-oss's sinks):
// - a window W > 0: the query at position q sees the keys k with q - W < k <= q (W keys, itself
//   included); W <= 0 is no window;
// - a soft cap c > 0: each score s = q . k * scale becomes c * tanh(s / c) before the mask and the
//   softmax; c <= 0 is none;
// - a sink logit z per query head joins each softmax's denominator without a value:
//   p_t = exp(s_t - m) / (sum_u exp(s_u - m) + exp(z - m)); no sinks is z = -inf (adds exactly 0).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace llk {

// The first key a query at position `pos` sees.
inline int64_t window_first(int64_t pos, int64_t window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

// s[0..n) <- cap * tanh(s / cap).
inline void softcap_scores(float* s, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// Query head `head`'s sink logit; -inf without sinks.
inline float sink_of(const float* sinks, int64_t head) {
  return sinks == nullptr ? -std::numeric_limits<float>::infinity() : sinks[head];
}

// A softmax's sum of exp(s - max) with the sink's share added (exp(-inf) is exactly 0).
inline float plus_sink(float sum, float max, float sink) { return sum + std::exp(sink - max); }

}  // namespace llk
