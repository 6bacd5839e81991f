// One mixture-of-experts layer's packed experts in one native call: every active expert's
// gate_up (+ bias) -> activation -> down (+ bias) chain as one work item of a single parallel
// region, instead of
// ~3 short parallel regions per active expert from Python (llmctl/layers/moe.py's loop, which
// stays the reference). Each projection runs the pointer-level kernel its bound Python kernel
// runs (quant_kernels.h), over the same rows, so every product has the same bits; the biases, the
// activation (SiLU-and-mul, or gpt-oss's clamped SwiGLU) and the weighted sum over the top-k slots
// are the same operations as the Python path's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include "moe_experts.h"

#include "cpu_kernels.h"
#include "quant_kernels.h"

namespace llk::moe {

using llk::quant::QuantizedX;

// How a projection's bound kernel reads its weight: interleave_tiles' layout, the row layout
// (int4_linear / int8_linear's integer path) or per-output-channel int8.
enum class Layout : int64_t { kTiles = 0, kRows = 1, kPerChannel = 2 };

struct Projection {
  Layout layout;
  int64_t kind;  // quant_kernels.h's kInt8Weights, kInt4Weights or kE2m1Weights (tiles only)
  int64_t scale_bytes;  // the tiles' scales: 4 float32, 2 float16, 1 stepped
  bool has_mins;
  int64_t n, k, group, in_features;  // k: the weight's input columns (in_features + zero padding)
  at::Tensor weight, scales, mins;   // weight: the tiles, or qweight; scales / mins: the row layout's

  // out [m, n] = x [m, in_features] @ W^T, as the Python path's bound kernel computes it.
  void run(const float* x, int64_t m, float* out) const {
    std::vector<float> padded;
    if (k != in_features) {  // zero input columns up to the weight's (as F.pad in _packed_call)
      padded.assign(m * k, 0.f);
      for (int64_t i = 0; i < m; ++i) std::memcpy(padded.data() + i * k, x + i * in_features, in_features * 4);
      x = padded.data();
    }
    const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
    const bool int4 = kind == llk::quant::kInt4Weights;
    switch (layout) {
      case Layout::kTiles:
        llk::quant::interleaved_gemm(llk::quant::quantize_x(x, m, k, int4), w, kind, scale_bytes, group, has_mins, n,
                                     out);
        return;
      case Layout::kRows:
        llk::quant::packed_gemm(llk::quant::quantize_x(x, m, k, int4), w, int4, scales, mins, group, n, out);
        return;
      case Layout::kPerChannel:
        llk::quant::int8_per_channel_linear(x, m, k, reinterpret_cast<const int8_t*>(w), scales, n, out);
        return;
    }
  }
};

Projection make_projection(int64_t layout, int64_t kind, int64_t n, int64_t k, int64_t group, int64_t in_features,
                           int64_t scale_bytes, bool has_mins, at::Tensor weight, c10::optional<at::Tensor> scales,
                           c10::optional<at::Tensor> mins) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "layout: 0 tiles, 1 rows, 2 per-channel int8");
  TORCH_CHECK(weight.is_contiguous() && weight.device().is_cpu(), "weight: contiguous, on the CPU");
  TORCH_CHECK(in_features <= k && k % llk::quant::QB == 0, "k: a multiple of 32, at least in_features");
  const auto lay = static_cast<Layout>(layout);
  TORCH_CHECK(lay == Layout::kTiles || scales.has_value(), "the row layouts need their scales");
  TORCH_CHECK(lay == Layout::kTiles || has_mins == mins.has_value(), "has_mins: whether the mins are given");
  TORCH_CHECK(kind == llk::quant::kInt8Weights || kind == llk::quant::kInt4Weights ||
                  (kind == llk::quant::kE2m1Weights && lay == Layout::kTiles),
              "kind: 0 int8, 1 int4, 2 E2M1 codes (tiles only)");
  return Projection{lay,   kind,        scale_bytes, has_mins, n, k, group, in_features, weight,
                    scales.value_or(at::Tensor()), mins.value_or(at::Tensor())};
}

// The activation between gate_up and down: llmctl/layers/moe.py's act.
enum class Activation : int64_t { kSiluAndMul = 0, kClampedSwiglu = 1 };

class Experts {
 public:
  // activation 1: gpt-oss's clamped SwiGLU with `alpha` and `limit` (moe.clamped_swiglu).
  Experts(int64_t hidden, int64_t inner, int64_t activation = 0, double alpha = 0.0, double limit = 0.0)
      : hidden_(hidden), inner_(inner), activation_(static_cast<Activation>(activation)), alpha_(alpha), limit_(limit) {
    TORCH_CHECK(activation == 0 || activation == 1, "activation: 0 SiLU-and-mul, 1 clamped SwiGLU");
  }

  // gate_up: one projection (gate rows, then up) or two (gate, up); down; optional float32 biases
  // [2 * inner] (gate, then up) and [hidden], added after each product.
  void add_expert(std::vector<Projection> gate_up, Projection down, c10::optional<at::Tensor> gate_up_bias,
                  c10::optional<at::Tensor> down_bias) {
    TORCH_CHECK(gate_up.size() == 1 || gate_up.size() == 2, "gate_up: one merged projection or gate and up");
    const int64_t width = gate_up.size() == 1 ? 2 * inner_ : inner_;
    for (const auto& p : gate_up) TORCH_CHECK(p.n == width && p.in_features == hidden_, "gate/up shape");
    TORCH_CHECK(down.n == hidden_ && down.in_features == inner_, "down shape");
    auto bias = [](const c10::optional<at::Tensor>& b, int64_t n) {
      if (!b.has_value()) return at::Tensor();
      TORCH_CHECK(b->scalar_type() == at::kFloat && b->numel() == n, "expert biases: float32 [", n, "]");
      return b->contiguous();
    };
    experts_.push_back({std::move(gate_up), std::move(down), bias(gate_up_bias, 2 * inner_), bias(down_bias, hidden_)});
  }

  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }

  // x [T, H] fp32, weights [T, k] fp32, ids [T, k] int64 -> [T, H].
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& weights, const at::Tensor& ids_in) const {
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden_ && x_in.scalar_type() == at::kFloat, "x: fp32 [T, H]");
    TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0), "ids: [T, k]");
    const auto x = x_in.contiguous();
    const auto ids = ids_in.to(at::kLong).contiguous();
    const int64_t tokens = x.size(0), top_k = ids.size(1), pairs = tokens * top_k, E = num_experts();
    // (token, slot) pairs grouped by expert in token order: a stable sort by expert id, as the Python path's
    const int64_t* id = ids.data_ptr<int64_t>();
    std::vector<int64_t> start(E + 1, 0), order(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id out of range");
      ++start[id[p] + 1];
    }
    std::partial_sum(start.begin(), start.end(), start.begin());
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[fill[id[p]]++] = p;
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) active.push_back(e);
    // the largest first: a thread that takes the next item as it finishes balances uneven experts
    std::stable_sort(active.begin(), active.end(),
                     [&](int64_t a, int64_t b) { return start[a + 1] - start[a] > start[b + 1] - start[b]; });

    // each pair's expert output times its weight, (token, slot) order: one buffer per calling thread
    // (the engine's), kept between calls and layers, as a prefill chunk's (64 MB at 2,048 tokens of
    // 8 slots) would be mapped and faulted in afresh every layer
    thread_local at::Tensor scratch = at::empty({0}, at::kFloat);
    if (scratch.numel() < pairs * hidden_) scratch = at::empty({pairs * hidden_}, at::kFloat);
    auto scaled = scratch.narrow(0, 0, pairs * hidden_).view({tokens, top_k, hidden_});
    const auto w = weights.to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == pairs, "weights: [T, k]");
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* dst = scaled.data_ptr<float>();
    auto run_item = [&](int64_t e) {
      const int64_t* rows = order.data() + start[e];
      run_expert(experts_[e], xp, rows, start[e + 1] - start[e], top_k, wp, dst);
    };
    // An expert with more than a thread's share of the rows (or every expert, when there are fewer
    // than threads) runs alone, its kernels parallel over their output columns; the rest are work
    // items of one parallel region. Which rows meet in one kernel call, and so its bits, is the same.
    const int64_t threads = at::get_num_threads(), items = static_cast<int64_t>(active.size());
    size_t alone = 0;
    if (threads == 1 || items < threads) {
      alone = active.size();
    } else {
      while (alone < active.size() && (start[active[alone] + 1] - start[active[alone]]) * threads > pairs) ++alone;
    }
    for (size_t i = 0; i < alone; ++i) run_item(active[i]);
    if (alone < active.size()) {
      std::atomic<size_t> next{alone};
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (size_t i; (i = next.fetch_add(1)) < active.size();) run_item(active[i]);
      });
    }
    // the Python path's arithmetic: out * weights (run_expert), summed over the slots in slot order
    return scaled.sum(1).to(x_in.scalar_type());
  }

 private:
  struct Expert {
    std::vector<Projection> gate_up;
    Projection down;
    at::Tensor gate_up_bias, down_bias;  // undefined: none
  };

  // gate_up [m, 2 * inner] -> [m, inner], each operation rounded as the Python path's act rounds it.
  at::Tensor activate(const at::Tensor& gate_up) const {
    if (activation_ == Activation::kSiluAndMul) return llk::cpu::silu_and_mul(gate_up);
    return clamped_swiglu(gate_up);
  }

  // moe.clamped_swiglu op for op: the clamps, products and sum as single float operations in loops
  // and the sigmoid ATen's own (in place, over the same contiguous [m, inner] it gets there), so
  // one ATen call an expert instead of eight (8 us of a 58 us expert at one row on a Zen 5).
  at::Tensor clamped_swiglu(const at::Tensor& gate_up) const {
    const int64_t m = gate_up.size(0);
    const float limit = static_cast<float>(limit_), alpha = static_cast<float>(alpha_);
    const auto clamp_max = [limit](float v) { return v > limit ? limit : v; };  // NaN passes, as clamp's
    const auto clamp = [limit](float v) { return v < -limit ? -limit : v > limit ? limit : v; };
    const float* gu = gate_up.data_ptr<float>();
    auto sig = at::empty({m, inner_}, at::kFloat);
    float* s = sig.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < inner_; ++j) s[i * inner_ + j] = clamp_max(gu[i * 2 * inner_ + j]) * alpha;
    sig.sigmoid_();
    for (int64_t i = 0; i < m; ++i) {
      const float* gate = gu + i * 2 * inner_;
      const float* up = gate + inner_;
      float* row = s + i * inner_;
      for (int64_t j = 0; j < inner_; ++j) row[j] = (clamp(up[j]) + 1.f) * (clamp_max(gate[j]) * row[j]);
    }
    return sig;
  }

  // One expert's gated MLP over its rows (pair indices ``pairs``, rows x[p / top_k]), each output
  // row times its weight w[p] written to dst[p].
  void run_expert(const Expert& ex, const float* x, const int64_t* pairs, int64_t m, int64_t top_k, const float* w,
                  float* dst) const {
    std::vector<float> rows(m * hidden_);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(rows.data() + i * hidden_, x + (pairs[i] / top_k) * hidden_, hidden_ * 4);
    auto gate_up = at::empty({m, 2 * inner_}, at::kFloat);
    float* gu = gate_up.data_ptr<float>();
    if (ex.gate_up.size() == 1) {
      ex.gate_up[0].run(rows.data(), m, gu);
    } else {  // gate and up side by side in each row, as torch.cat([gate, up], dim=-1)
      std::vector<float> part(m * inner_);
      for (int64_t h = 0; h < 2; ++h) {
        ex.gate_up[h].run(rows.data(), m, part.data());
        for (int64_t i = 0; i < m; ++i)
          std::memcpy(gu + i * 2 * inner_ + h * inner_, part.data() + i * inner_, inner_ * 4);
      }
    }
    if (ex.gate_up_bias.defined()) {  // gate_up + bias, as the Python path adds it
      const float* b = ex.gate_up_bias.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < 2 * inner_; ++j) gu[i * 2 * inner_ + j] += b[j];
    }
    const auto act = activate(gate_up);
    std::vector<float> out(m * hidden_);
    ex.down.run(act.data_ptr<float>(), m, out.data());
    const float* down_bias = ex.down_bias.defined() ? ex.down_bias.data_ptr<float>() : nullptr;
    for (int64_t i = 0; i < m; ++i) {
      float* row = dst + pairs[i] * hidden_;
      const float* y = out.data() + i * hidden_;
      const float weight = w[pairs[i]];
      if (down_bias != nullptr) {  // (down + bias) * weight: two roundings, as the Python path's
        for (int64_t j = 0; j < hidden_; ++j) row[j] = (y[j] + down_bias[j]) * weight;
      } else {
        for (int64_t j = 0; j < hidden_; ++j) row[j] = y[j] * weight;
      }
    }
  }

  int64_t hidden_, inner_;
  Activation activation_;
  double alpha_, limit_;
  std::vector<Expert> experts_;
};

const Experts* experts_of(pybind11::handle object) {
  TORCH_CHECK(pybind11::isinstance<Experts>(object), "not a llmctl_kernels._C.moe.Experts object");
  return object.cast<const Experts*>();
}

int64_t num_experts(const Experts& experts) { return experts.num_experts(); }

at::Tensor run_experts(const Experts& experts, const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) {
  return experts.forward(x, weights, ids);
}

void bind(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection", "One expert projection's packed weight, as its bound kernel reads it");
  m.def("make_projection", &make_projection, "Bind one expert projection", py::arg("layout"), py::arg("kind"),
        py::arg("n"), py::arg("k"), py::arg("group"), py::arg("in_features"), py::arg("scale_bytes"), py::arg("has_mins"), py::arg("weight"),
        py::arg("scales") = py::none(), py::arg("mins") = py::none());
  py::class_<Experts>(m, "Experts", "One layer's packed experts, run in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("hidden"), py::arg("inner"),
           py::arg("activation") = 0, py::arg("alpha") = 0.0, py::arg("limit") = 0.0)
      .def("add_expert", &Experts::add_expert, py::arg("gate_up"), py::arg("down"),
           py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none())
      .def("num_experts", &Experts::num_experts)
      .def("forward", &Experts::forward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace llk::moe
