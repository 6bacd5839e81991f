// The decode step of a Llama-family model in one native call: every decoder layer, for a batch in
// which each row is one token of its own sequence (decode rows, speculative verify rows). At batch
// 1 each kernel runs for a few microseconds, and the Python around ~30 x 9 kernel calls a step
// (module calls, argument conversion, tensor allocations) cost as much as the kernels themselves.
//
// Same kernels, same order, same rounding as the Python module path: this file calls the very
// functions the module path runs (cpu_kernels.h: RMSNorm, rotary, KV store, decode attention,
// SiLU-and-mul, as row kernels of the selected ISA variant; quant_kernels.h: the packed int4/int8
// tiles; kv_quant_attention.h: the KIVI store and decode; gemm_kernels.h: the fp32 panels), linked
// from their own translation units. Result: logits bit-identical to the module path
// (tests/models/test_decode_loop.py).
//
// bf16 models (the dtype --dtype auto picks on CPUs with AVX512-BF16 or AMX) run the same loop over
// the module path's own tensor-level functions (cpu_kernels.cpp's rms_norm, rotate,
// reshape_and_cache, paged_decode_attention, silu_and_mul) and oneDNN's prepacked linear op, called
// with the same arguments in the same order: what the loop saves is the Python around them.
//
// Weights are bound once (DecodeLoop::add_layer), so a step passes only the step's tensors.
// Threading: the GEMVs, attention and (for larger batches) the row-wise kernels split their work
// with at::parallel_for exactly as the standalone kernels do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "gemm_kernels.h"
#include "isa.h"
#include "kv_quant_attention.h"
#include "lora_kernels.h"
#include "moe_experts.h"
#include "quant_kernels.h"

// The loop's own arithmetic is that of the quantized kernels' baseline: AVX2+FMA+F16C (the loader
// checks the CPU for it before binding a loop).
#pragma GCC target("avx2,fma,f16c")

namespace cpuk = llk::cpu;
namespace gemmk = llk::gemm;
namespace kvqk = llk::kvq;
namespace quantk = llk::quant;

namespace {

// One linear layer: a plain fp32 weight (at::linear, as F.linear), a panel-packed fp32 weight (the
// native fp32 GEMM, gemm_kernels.h), a packed int4/int8 weight (the integer tiles with int16
// activations, as kernels/quant_native.py binds them) or a weight prepacked for oneDNN (its
// _linear_pointwise op, as llmctl.layers.linear.linear calls it: the bf16 models' layers), or
// parts of those side by side (a merged projection whose packed parts keep their own formats:
// llmctl.layers.quantization.methods.SplitPackedMethod).
struct Linear {
  enum Kind { kDense = 0, kInt4 = 1, kInt8 = 2, kPanel = 3, kMkldnn = 4, kSplit = 5 };
  Kind kind = kDense;
  at::Tensor weight, qweight, scales, mins, bias;
  at::Tensor tiles;  // packed int4/int8: the same weight in quant_kernels.cpp's tile-interleaved layout, if bound
  int64_t tile_scale_bytes = 0;  // the tiles' scales: 4 float32, 2 float16, 1 stepped
  int64_t tile_kind = 0;  // what their blocks hold: quant_kernels.h's kInt8Weights, kInt4Weights or kE2m1Weights
  int64_t n = 0, k = 0, k_packed = 0, group = 0;
  bool bias_in_gemm = false;  // a column-parallel dense layer passes its bias to F.linear
  std::vector<Linear> parts;  // kSplit: the parts, in output order
};

Linear make_split_linear(std::vector<Linear> parts, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(!parts.empty(), "a split linear needs parts");
  Linear l;
  l.kind = Linear::kSplit;
  l.k = parts.front().k;
  for (const Linear& part : parts) {
    TORCH_CHECK(part.k == l.k && part.kind != Linear::kSplit && part.kind != Linear::kMkldnn && !part.bias.defined(),
                "split linear parts: float32 or packed, one input width, no bias of their own");
    l.n += part.n;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == l.n && bias->scalar_type() == at::kFloat, "float32 bias [n]");
    l.bias = bias->contiguous();
  }
  l.parts = std::move(parts);
  return l;
}

Linear make_linear(const std::string& kind, int64_t in_features, c10::optional<at::Tensor> weight,
                   c10::optional<at::Tensor> qweight, c10::optional<at::Tensor> scales,
                   c10::optional<at::Tensor> mins, int64_t group, c10::optional<at::Tensor> bias,
                   bool bias_in_gemm, int64_t out_features, c10::optional<at::Tensor> tiles,
                   int64_t tile_scale_bytes, int64_t tile_kind) {
  Linear l;
  l.k = in_features;
  l.group = group;
  l.bias_in_gemm = bias_in_gemm;
  if (kind == "mkldnn") {  // the module path's oneDNN call; its bias in the layer's own dtype
    TORCH_CHECK(weight.has_value() && weight->is_mkldnn() && out_features > 0, "mkldnn linear: a prepacked weight");
    l.kind = Linear::kMkldnn;
    l.weight = *weight;
    l.n = out_features;
    l.k_packed = in_features;
    if (bias.has_value()) l.bias = *bias;
    return l;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous(), "bias must be contiguous float32");
    l.bias = *bias;
  }
  if (kind == "panel") {  // fp32 panels [ceil(n / 16), k, 16], gemmk::linear as in the module path
    TORCH_CHECK(weight.has_value() && weight->scalar_type() == at::kFloat && weight->dim() == 3 &&
                weight->size(1) == in_features && out_features > 0, "panel linear: a panel-packed float32 weight");
    l.kind = Linear::kPanel;
    l.weight = *weight;
    l.n = out_features;
    l.k_packed = in_features;
    return l;
  }
  if (kind == "dense") {
    TORCH_CHECK(weight.has_value() && weight->scalar_type() == at::kFloat && weight->layout() == at::kStrided,
                "dense linear: a plain float32 weight");
    l.weight = *weight;
    l.n = weight->size(0);
    l.k_packed = in_features;
    return l;
  }
  TORCH_CHECK(qweight.has_value() && scales.has_value(), "packed linear: qweight and scales");
  TORCH_CHECK(qweight->is_contiguous() && scales->is_contiguous() &&
                  (scales->scalar_type() == at::kFloat || scales->scalar_type() == at::kHalf),
              "packed linear: contiguous qweight and float32 (or exact float16) scales");
  l.qweight = *qweight;
  l.scales = *scales;
  if (mins.has_value()) l.mins = *mins;
  l.n = qweight->size(0);
  if (kind == "int4") {
    TORCH_CHECK(qweight->scalar_type() == at::kByte && mins.has_value(), "int4: uint8 qweight and mins");
    l.kind = Linear::kInt4;
    l.k_packed = qweight->size(1) * 2;
    TORCH_CHECK(group % quantk::QB == 0 && l.k_packed % group == 0, "int4 group must be a multiple of 32");
  } else if (kind == "int8") {
    TORCH_CHECK(qweight->scalar_type() == at::kChar, "int8: int8 qweight");
    l.kind = Linear::kInt8;
    l.k_packed = qweight->size(1);
    TORCH_CHECK(l.k_packed % quantk::QB == 0 && (group == 16 || group % quantk::QB == 0) && l.k_packed % group == 0,
                "int8 group must be 16 or a multiple of 32");
  } else {
    TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  TORCH_CHECK(l.k_packed >= in_features, "packed weight narrower than the layer input");
  if (l.mins.defined())
    TORCH_CHECK(l.mins.is_contiguous() && l.mins.scalar_type() == l.scales.scalar_type(), "mins of the scales' dtype");
  if (tiles.has_value()) {
    l.tile_kind = l.kind == Linear::kInt4 ? quantk::kInt4Weights : tile_kind;
    TORCH_CHECK(l.tile_kind != quantk::kInt4Weights || l.kind == Linear::kInt4, "int4 tiles of an int4 weight");
    const quantk::TileLayout layout =  // checks tile_scale_bytes and the kind
        quantk::tile_layout(l.k_packed, group, l.tile_kind, tile_scale_bytes, l.mins.defined());
    TORCH_CHECK((group % quantk::QB == 0 || group == 16) && tiles->scalar_type() == at::kByte && tiles->is_contiguous() &&
                    tiles->numel() == (l.n + quantk::RT - 1) / quantk::RT * layout.tile_bytes(),
                "packed linear: interleaved tiles that do not match the weight");
    l.tiles = *tiles;
    l.tile_scale_bytes = tile_scale_bytes;
  }
  return l;
}

// torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], ""): what llmctl.layers.linear.linear
// calls for a prepacked weight, through the dispatcher (the op has no C++ API of its own).
at::Tensor mkldnn_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x.contiguous(), weight, bias.defined() ? c10::IValue(bias) : c10::IValue(),
                                 std::string("none"), c10::List<c10::optional<c10::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [m, k] contiguous float32 (bf16 for a prepacked layer) -> [m, n], as PackedLinearMethod.apply /
// UnquantizedLinearMethod.apply.
at::Tensor run_linear(const Linear& l, const at::Tensor& x) {
  if (l.kind == Linear::kSplit) {  // as SplitPackedMethod: the parts' outputs side by side, then the bias
    std::vector<at::Tensor> outs;
    for (const Linear& part : l.parts) outs.push_back(run_linear(part, x));
    auto out = at::cat(outs, -1);
    return l.bias.defined() ? out.add_(l.bias) : out;
  }
  if (l.kind == Linear::kMkldnn) {  // a row-parallel layer adds its bias after the (here absent) reduce
    if (l.bias_in_gemm || !l.bias.defined()) return mkldnn_linear(x, l.weight, l.bias);
    return mkldnn_linear(x, l.weight, at::Tensor()) + l.bias;
  }
  if (l.kind == Linear::kPanel)  // the bias is one add after the sum, in the kernel or after it alike
    return gemmk::linear(x, l.weight, l.n, l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt);
  if (l.kind == Linear::kDense) {
    if (l.bias_in_gemm) return at::linear(x, l.weight, l.bias);
    auto out = at::linear(x, l.weight);
    return l.bias.defined() ? out.add_(l.bias) : out;
  }
  const int64_t m = x.size(0);
  // Zero inputs meet the zero-padded weight columns (F.pad in the module path).
  const at::Tensor xp = l.k_packed == l.k ? x : at::constant_pad_nd(x, {0, l.k_packed - l.k});
  const bool int4 = l.kind == Linear::kInt4;
  auto out = at::empty({m, l.n}, x.options());
  if (!int4 && quantk::int8_per_channel(l.group, l.k_packed, l.mins.defined())) {  // per-token int16 (int8_gemm.h)
    quantk::int8_per_channel_linear(xp.data_ptr<float>(), m, l.k_packed, l.qweight.data_ptr<int8_t>(), l.scales, l.n,
                          out.data_ptr<float>());
    return l.bias.defined() ? out.add_(l.bias) : out;
  }
  const quantk::QuantizedX xq = quantk::quantize_x(xp.data_ptr<float>(), m, l.k_packed, /*nibble_order=*/int4);
  if (l.tiles.defined())  // the layout the module path's bound kernel reads (kernels/quant_native.py): same bits
    quantk::interleaved_gemm(xq, l.tiles.data_ptr<uint8_t>(), l.tile_kind, l.tile_scale_bytes, l.group,
                             l.mins.defined(), l.n, out.data_ptr<float>());
  else
    quantk::packed_gemm(xq, static_cast<const uint8_t*>(l.qweight.data_ptr()), int4, l.scales, l.mins, l.group, l.n,
                        out.data_ptr<float>());
  return l.bias.defined() ? out.add_(l.bias) : out;
}

// A mixture-of-experts MLP: the router's softmax top-k (renormalized or not), or the softmax of
// its top-k logits (gpt-oss), picks each row's experts, whose packed weights run in
// moe_experts.cpp's one call, the object the Python layer calls (llmctl/layers/moe.py,
// StackedExperts.bind_native).
struct MoeMlp {
  Linear router;
  int64_t top_k = 0;
  bool renormalize = false;
  bool softmax_of_top_k = false;  // route()'s "topk_softmax" scoring; else "softmax"
  const llk::moe::Experts* experts = nullptr;
  pybind11::object owner;  // the Python object holding `experts`
  // A shared expert every row runs (Qwen2-MoE): a dense gated MLP, its output times
  // sigmoid(shared_gate(x)) when that gate is given; undefined kinds (n == 0): none.
  Linear shared_gate_up, shared_down, shared_gate;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;             // gate_up, down: a dense MLP's
  at::Tensor q_norm, k_norm;  // per-head RMSNorm weights [head_dim] before rotary (Qwen3); undefined: none
  std::shared_ptr<MoeMlp> moe;  // set: a mixture-of-experts MLP instead of gate_up / down
  // Its attention as the pool holds it (DecodeLoop::set_attention): the KV-cache group whose slot
  // mapping and block tables it reads, its layer slot of the pool, a sliding window (0: the whole
  // context) and float32 sink logits [Hq] (undefined: none).
  int64_t group = 0, pool_slot = 0, window = 0;
  at::Tensor sinks;
};

enum Projection { kQkvProj, kOProj, kGateUpProj, kDownProj, kNumProjections };

using cpuk::DecodeArgs;
using IsaKernels = cpuk::Fp32Kernels;

IsaKernels kernels_for(const std::string& isa) {
#ifdef LLK_X86_VARIANTS
  if (isa == "avx512" || isa == "avx512bf16")  // fp32: AVX512-BF16 changes nothing (bf16 attention only)
    return cpuk::fp32_kernels(/*avx512=*/true);
  if (isa == "avx2") return cpuk::fp32_kernels(/*avx512=*/false);
#endif
  // The loop is bound only where the quantized kernels' AVX2 baseline runs: the Python path
  // serves the generic level.
  TORCH_CHECK(false, "the native decode loop runs the avx2 or avx512 kernel variants, not ", isa);
}

// The KV pool's storage: float32, or 8-bit codes with a float32 scale per (token, KV head)
// (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2, llmctl/engine/kv_cache.py), stored and read by the
// same cpu_kernels.cpp functions the module path calls.
// KIVI (kivi2 / kivi4): packed 2/4-bit codes with float16 scales and zeros, and the residual
// window in float32, stored and read by kv_quant_attention.cpp's functions, with the step's plan
// from the host (set_kivi_plan).
enum class KvStorage { kFloat, kInt8, kFp8E4m3, kFp8E5m2, kKivi };

KvStorage kv_storage(const std::string& kind) {
  if (kind == "auto") return KvStorage::kFloat;
  if (kind == "int8") return KvStorage::kInt8;
  if (kind == "fp8_e4m3") return KvStorage::kFp8E4m3;
  if (kind == "fp8_e5m2") return KvStorage::kFp8E5m2;
  if (kind == "kivi2" || kind == "kivi4") return KvStorage::kKivi;
  TORCH_CHECK(false, "the native decode loop takes KV dtypes auto (float32), int8, fp8_e4m3, fp8_e5m2, kivi2 and "
              "kivi4, not ", kind);
}

// The KIVI pool of every layer, and one step's plan (kv_cache.StepPlan's tensors).
struct KiviPool {
  int bits = 0;
  int64_t value_group = 0;
  at::Tensor k_zero, v_zero, residual_k, residual_v;  // [layers, NB, H, D] f16; [layers, slots, BS, H, D] f32
  bool planned = false;
  at::Tensor residual_tokens, residual_rows, staging_tokens, staging_rows, staged_from, finalize_blocks,
      residual_table;
};

class DecodeLoop {
 public:
  // k_pool / v_pool: [layers, blocks, block_size, kv_heads, head_dim], of the activations' dtype
  // (kv_kind "auto": float32 or bf16) or the codes as bytes, then k_scale / v_scale [layers, blocks,
  // block_size, kv_heads].
  // KIVI: k_pool / v_pool [layers, blocks, block_size, kv_heads, head_dim * bits / 8] packed codes,
  // k_scale / k_zero [layers, blocks, kv_heads, head_dim] and v_scale / v_zero [layers, blocks,
  // block_size, kv_heads, head_dim / value_group] float16, residual_k / residual_v [layers, slots,
  // block_size, kv_heads, head_dim] float32.
  DecodeLoop(const std::string& isa, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
             double scale, at::Tensor cos_sin_cache, at::Tensor final_norm, const std::string& kv_kind,
             at::Tensor k_pool, at::Tensor v_pool, c10::optional<at::Tensor> k_scale,
             c10::optional<at::Tensor> v_scale, c10::optional<at::Tensor> k_zero, c10::optional<at::Tensor> v_zero,
             c10::optional<at::Tensor> residual_k, c10::optional<at::Tensor> residual_v, int64_t value_group)
      : k_(kernels_for(isa)), avx512_(isa != "avx2"), hq_(num_q_heads), hkv_(num_kv_heads), d_(head_dim),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)),
        cos_sin_(cos_sin_cache.to(at::kFloat).contiguous()), final_norm_(final_norm.contiguous()),
        storage_(kv_storage(kv_kind)), kv_kind_(kv_kind), k_pool_(k_pool), v_pool_(v_pool) {
    TORCH_CHECK(hq_ % hkv_ == 0, "query heads must be a multiple of KV heads");
    if (final_norm_.scalar_type() == at::kBFloat16) {  // bf16 activations: the tensor-level path
      TORCH_CHECK(storage_ != KvStorage::kKivi, "bf16 activations in the loop: a bf16 or 8-bit KV pool");
      take_pools(at::kBFloat16, k_scale, v_scale);
      bf16_ = true;
      cpuk::set_isa(isa);  // the variant kernels/cpu_native.py selects: the module path's bits
      return;
    }
    if (storage_ == KvStorage::kKivi) {
      init_kivi(kv_kind == "kivi2" ? 2 : 4, k_scale, v_scale, k_zero, v_zero, residual_k, residual_v, value_group);
      TORCH_CHECK(final_norm_.scalar_type() == at::kFloat, "float32 final norm");
      gemmk::set_isa(isa);
      return;
    }
    take_pools(at::kFloat, k_scale, v_scale);
    TORCH_CHECK(final_norm_.scalar_type() == at::kFloat, "float32 final norm");
    gemmk::set_isa(isa);  // the variant kernels/gemm_native.py selects: same bits as the module path
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Linear o, Linear gate_up, Linear down,
                 c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm) {
    const int64_t hidden = final_norm_.size(0);
    TORCH_CHECK(gate_up.k == hidden && gate_up.n % 2 == 0 && down.k == gate_up.n / 2 && down.n == hidden,
                "MLP shapes disagree");
    if (bf16_)
      for (const Linear* l : {&gate_up, &down})
        TORCH_CHECK(l->kind == Linear::kMkldnn, "bf16 activations in the loop: oneDNN-prepacked weights only");
    Layer layer = attention_layer(std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                                  std::move(q_norm), std::move(k_norm));
    layer.gate_up = std::move(gate_up);
    layer.down = std::move(down);
    layers_.push_back(std::move(layer));
  }

  // A mixture-of-experts layer: attention as add_layer's, then the router (a float linear over the
  // experts), softmax top-k and the packed experts of `experts` (a `_C.moe.Experts`). fp32 only.
  // scoring: route()'s "softmax" (softmax, then top-k) or "topk_softmax" (top-k logits, their softmax).
  void add_moe_layer(at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Linear o, Linear router, int64_t top_k,
                     bool renormalize, pybind11::object experts, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, c10::optional<Linear> shared_gate_up,
                     c10::optional<Linear> shared_down, c10::optional<Linear> shared_gate,
                     const std::string& scoring) {
    TORCH_CHECK(!bf16_, "mixture-of-experts layers in the loop: fp32 activations only");
    TORCH_CHECK(scoring == "softmax" || scoring == "topk_softmax", "router scoring: softmax or topk_softmax");
    TORCH_CHECK(scoring == "softmax" || !renormalize, "topk_softmax weights are not renormalized");
    auto moe = std::make_shared<MoeMlp>();
    moe->softmax_of_top_k = scoring == "topk_softmax";
    moe->experts = llk::moe::experts_of(experts);
    moe->owner = std::move(experts);
    const int64_t hidden = final_norm_.size(0), num_experts = llk::moe::num_experts(*moe->experts);
    TORCH_CHECK(router.k == hidden && router.n == num_experts && 0 < top_k && top_k <= num_experts,
                "router [experts, hidden] and 0 < top_k <= experts");
    moe->router = std::move(router);
    moe->top_k = top_k;
    moe->renormalize = renormalize;
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() && (shared_gate_up || !shared_gate),
                "a shared expert: gate_up and down (and optionally its gate)");
    if (shared_gate_up) {
      TORCH_CHECK(shared_gate_up->k == hidden && shared_gate_up->n % 2 == 0 && shared_down->k == shared_gate_up->n / 2 &&
                      shared_down->n == hidden && (!shared_gate || (shared_gate->k == hidden && shared_gate->n == 1)),
                  "shared expert shapes disagree");
      moe->shared_gate_up = std::move(*shared_gate_up);
      moe->shared_down = std::move(*shared_down);
      if (shared_gate) moe->shared_gate = std::move(*shared_gate);
    }
    Layer layer = attention_layer(std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                                  std::move(q_norm), std::move(k_norm));
    layer.moe = std::move(moe);
    layers_.push_back(std::move(layer));
  }

  // Layer ``layer``'s attention when it is not the plain one (llmctl/engine/model_runner.py's KV-cache
  // groups): it stores and reads through group ``group``'s slot mapping and block tables (forward's
  // group_slots / group_tables for groups > 0) in layer slot ``pool_slot`` of the pool, over the last
  // ``window`` tokens (0: all), with ``sinks`` [Hq] joining each softmax's denominator. The float
  // fp32 pool only: the 8-bit and KIVI pools' loop kernels take neither windows nor sinks.
  void set_attention(int64_t layer, int64_t group, int64_t pool_slot, int64_t window, c10::optional<at::Tensor> sinks) {
    TORCH_CHECK(0 <= layer && layer < num_layers(), "no such layer");
    TORCH_CHECK(0 <= group && 0 <= pool_slot && pool_slot < k_pool_.size(0) && window >= 0,
                "a KV-cache group, a slot of the pool and a window of at least 0 tokens");
    const bool plain = group == 0 && pool_slot == layer && window == 0 && !sinks.has_value();
    TORCH_CHECK(plain || (storage_ == KvStorage::kFloat && !bf16_),
                "windows, sinks and KV-cache groups in the loop: float32 activations and KV pool only");
    Layer& l = layers_[layer];
    l.group = group;
    l.pool_slot = pool_slot;
    l.window = window;
    if (sinks.has_value()) {
      TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == hq_, "sinks: [num_q_heads]");
      l.sinks = sinks->to(at::kFloat).contiguous();  // as the module path's kernel reads them
    }
  }

  // Per mixture-of-experts layer, in layer order: the tokens each expert took in the last forward
  // (int64 [experts]; torch.bincount of the ids, as StackedExperts.forward records them).
  std::vector<at::Tensor> expert_counts() const { return expert_counts_; }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The LoRA stacks of one projection of one layer (projection: 0 qkv, 1 o, 2 gate_up, 3 down), in
  // the order the module path adds them; an empty list: no adapter targets it. The stacks are
  // llmctl/lora/slots.py's transposed ones (lora_kernels.h), bound by reference: loading an
  // adapter into a slot writes into these very tensors.
  void set_lora(int64_t layer, int64_t projection, std::vector<llk::lora::Stack> stacks) {
    TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= projection && projection < kNumProjections,
                "LoRA: no such layer or projection");
    if (lora_.empty()) lora_.resize(layers_.size());
    for (const auto& stack : stacks) llk::lora::check_stack(stack, std::get<2>(stack).size(1));
    lora_[layer][projection] = std::move(stacks);
  }

  // The next step's LoRA rows by slot: (slot, start, end, row indices or None), as
  // llmctl_kernels.lora.LoRABatchPlan.spans; used by one forward, then dropped (a step without a
  // plan adds no delta).
  void set_lora_plan(std::vector<llk::lora::Group> groups) { lora_plan_ = std::move(groups); }

  // KIVI: the next step's plan (kv_cache.QuantizedKVCache.begin_step, shared by every layer); a
  // KIVI forward without one is refused, and the plan is used once.
  void set_kivi_plan(at::Tensor residual_tokens, at::Tensor residual_rows, at::Tensor staging_tokens,
                     at::Tensor staging_rows, at::Tensor staged_from, at::Tensor finalize_blocks,
                     at::Tensor residual_table) {
    TORCH_CHECK(storage_ == KvStorage::kKivi, "not a KIVI pool");
    for (const at::Tensor* t : {&residual_tokens, &residual_rows, &staging_tokens, &staging_rows, &staged_from,
                                &finalize_blocks, &residual_table})
      TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(), "KIVI plan: int64 vectors");
    TORCH_CHECK(residual_table.numel() >= k_pool_.size(1), "KIVI plan: a residual slot (or -1) for every block");
    const int64_t slots = kivi_.residual_k.size(1), block_size = k_pool_.size(2);
    using kvqk::all_within;
    TORCH_CHECK(all_within(residual_rows, 0, slots * block_size) &&
                    all_within(staging_rows, 0, finalize_blocks.numel() * block_size) &&
                    all_within(staged_from, -1, slots) && all_within(finalize_blocks, 0, k_pool_.size(1)) &&
                    all_within(residual_table, -1, slots) && residual_rows.numel() == residual_tokens.numel() &&
                    staging_rows.numel() == staging_tokens.numel() && staged_from.numel() == finalize_blocks.numel(),
                "KIVI plan out of range");
    kivi_.residual_tokens = residual_tokens;
    kivi_.residual_rows = residual_rows;
    kivi_.staging_tokens = staging_tokens;
    kivi_.staging_rows = staging_rows;
    kivi_.staged_from = staged_from;
    kivi_.finalize_blocks = finalize_blocks;
    kivi_.residual_table = residual_table;
    kivi_.planned = true;
  }

  // hidden [B, H] (the embeddings), positions / slot_mapping [B] int64, block_tables [B, W] int32,
  // seq_lens [B] int32 -> the final-normed hidden states [B, H]. With KV-cache groups, group g > 0's
  // slot mapping and block tables are group_slots[g - 1] and group_tables[g - 1].
  at::Tensor forward(const at::Tensor& embeddings, const at::Tensor& positions_in, const at::Tensor& slots_in,
                     const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                     const std::vector<at::Tensor>& group_slots, const std::vector<at::Tensor>& group_tables) {
    TORCH_CHECK(embeddings.dim() == 2 && embeddings.scalar_type() == final_norm_.scalar_type(),
                "hidden [B, H] of the model's dtype");
    const int64_t rows = embeddings.size(0);
    const auto positions = positions_in.to(at::kLong).contiguous();
    const auto lens = seq_lens_in.contiguous();
    TORCH_CHECK(lens.scalar_type() == at::kInt && positions.size(0) == rows && lens.size(0) == rows,
                "one position and int32 length per row");
    TORCH_CHECK(group_slots.size() == group_tables.size(), "a slot mapping and block tables per group");
    std::vector<at::Tensor> slots{slots_in.to(at::kLong).contiguous()}, tables{block_tables_in.contiguous()};
    for (size_t g = 0; g < group_slots.size(); ++g) {
      slots.push_back(group_slots[g].to(at::kLong).contiguous());
      tables.push_back(group_tables[g].contiguous());
    }
    for (size_t g = 0; g < slots.size(); ++g)
      TORCH_CHECK(tables[g].scalar_type() == at::kInt && slots[g].size(0) == rows && tables[g].size(0) == rows,
                  "one slot and int32 table row per row, in every group");
    for (const Layer& layer : layers_)
      TORCH_CHECK(layer.group < static_cast<int64_t>(slots.size()) && layer.pool_slot < k_pool_.size(0),
                  "a layer without its KV-cache group's tables or a slot of the pool (set_attention)");
    TORCH_CHECK(num_layers() >= k_pool_.size(0), "not every layer was added");
    if (bf16_) return forward_tensors(embeddings, positions, slots[0], tables[0], lens);
    if (storage_ == KvStorage::kKivi) {
      TORCH_CHECK(kivi_.planned, "a KIVI step needs its plan (set_kivi_plan) first");
      TORCH_CHECK(kvqk::all_within(kivi_.residual_tokens, 0, rows) && kvqk::all_within(kivi_.staging_tokens, 0, rows),
                  "KIVI plan: a token past the batch");
      kivi_.planned = false;
    }
    expert_counts_.clear();
    auto x = embeddings.contiguous();
    auto residual = at::empty_like(x);
    auto normed = at::empty_like(x);
    auto q = at::empty({rows, hq_, d_}, x.options());
    auto k = at::empty({rows, hkv_, d_}, x.options());
    auto attn = at::empty({rows, hq_ * d_}, x.options());
    bool first = true;
    Clock clock(profile_ ? &op_ns_ : nullptr);
    const std::vector<llk::lora::Group> plan = std::exchange(lora_plan_, {});
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& layer = layers_[i];
      rms_norm(x, first ? nullptr : &residual, layer.input_norm, normed, residual);
      first = false;
      clock.lap(kNorm);
      const at::Tensor qkv = add_lora(plan, i, kQkvProj, normed, run_linear(layer.qkv, normed));
      clock.lap(kQkv);
      const int64_t width = qkv.size(1);
      if (layer.q_norm.defined()) {
        head_norm(qkv, 0, hq_, layer.q_norm);
        head_norm(qkv, hq_ * d_, hkv_, layer.k_norm);
      }
      rotate(qkv.data_ptr<float>(), width, hq_, positions, q);
      rotate(qkv.data_ptr<float>() + hq_ * d_, width, hkv_, positions, k);
      store_kv(layer.pool_slot, k.data_ptr<float>(), hkv_ * d_, qkv.data_ptr<float>() + (hq_ + hkv_) * d_, width,
               slots[layer.group]);
      clock.lap(kRotaryStore);
      attention(layer, q, tables[layer.group], lens, attn);
      clock.lap(kAttention);
      x = add_lora(plan, i, kOProj, attn, run_linear(layer.o, attn));
      clock.lap(kO);
      rms_norm(x, &residual, layer.post_norm, normed, residual);
      clock.lap(kNorm);
      if (layer.moe) {
        x = experts(*layer.moe, normed);
        clock.lap(kExperts);
        continue;
      }
      const at::Tensor gate_up = add_lora(plan, i, kGateUpProj, normed, run_linear(layer.gate_up, normed));
      clock.lap(kGateUp);
      const at::Tensor act = silu_and_mul(gate_up);
      clock.lap(kSilu);
      x = add_lora(plan, i, kDownProj, act, run_linear(layer.down, act));
      clock.lap(kDown);
    }
    rms_norm(x, &residual, final_norm_, normed, residual);
    clock.lap(kNorm);
    if (profile_) ++profiled_steps_;
    return normed;
  }

  // Per-op wall time of the steps run since profiling was switched on (benchmarks/features/decode_breakdown.py):
  // {op: total seconds, "steps": n}. Off by default: two clock reads per op otherwise.
  void set_profile(bool on) {
    profile_ = on;
    op_ns_.fill(0);
    profiled_steps_ = 0;
  }

  pybind11::dict profile() const {
    pybind11::dict d;
    for (int i = 0; i < kNumOps; ++i) d[kOpNames[i]] = op_ns_[i] * 1e-9;
    d["steps"] = profiled_steps_;
    return d;
  }

 private:
  // The module path's decode step (LlamaModel.forward over LlamaDecoderLayer, llmctl/models/llama.py)
  // call for call: the same functions on the same tensors, views and strides included.
  at::Tensor forward_tensors(const at::Tensor& embeddings, const at::Tensor& positions, const at::Tensor& slots,
                             const at::Tensor& tables, const at::Tensor& lens) {
    const int64_t rows = embeddings.size(0);
    at::Tensor x = embeddings, residual, normed;
    Clock clock(profile_ ? &op_ns_ : nullptr);
    const std::vector<llk::lora::Group> plan = std::exchange(lora_plan_, {});
    auto norm = [&](const at::Tensor& weight) {  // RMSNorm(x + residual); the first layer's residual is x
      const c10::optional<at::Tensor> before = residual.defined() ? c10::optional<at::Tensor>(residual) : c10::nullopt;
      std::tie(normed, residual) = cpuk::rms_norm(x, weight, eps_, before);
      clock.lap(kNorm);
    };
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& layer = layers_[i];
      norm(layer.input_norm);
      const std::vector<at::Tensor> qkv = add_lora(plan, i, kQkvProj, normed, run_linear(layer.qkv, normed))
                                              .split_with_sizes({hq_ * d_, hkv_ * d_, hkv_ * d_}, -1);
      clock.lap(kQkv);
      at::Tensor q = qkv[0].reshape({rows, hq_, d_}), k = qkv[1].reshape({rows, hkv_, d_});
      if (layer.q_norm.defined()) {  // as LlamaAttention: RMSNorm over heads flattened into rows
        q = std::get<0>(cpuk::rms_norm(q.flatten(0, 1), layer.q_norm, eps_, c10::nullopt)).view_as(q);
        k = std::get<0>(cpuk::rms_norm(k.flatten(0, 1), layer.k_norm, eps_, c10::nullopt)).view_as(k);
      }
      q = cpuk::rotate(q, positions, cos_sin_);
      k = cpuk::rotate(k, positions, cos_sin_);
      const at::Tensor k_cache = k_pool_.select(0, i), v_cache = v_pool_.select(0, i);
      at::Tensor attn;
      if (storage_ == KvStorage::kFloat) {
        cpuk::reshape_and_cache(k, qkv[2].reshape({rows, hkv_, d_}), k_cache, v_cache, slots);
        clock.lap(kRotaryStore);
        attn = cpuk::paged_decode_attention(q, k_cache, v_cache, tables, lens, scale_).flatten(1);
      } else {  // an 8-bit pool: the module path's store quantizes K/V as float32, then attends over codes
        const at::Tensor k_scale = k_scale_.select(0, i), v_scale = v_scale_.select(0, i);
        cpuk::store_kv_codes(k.to(at::kFloat), qkv[2].reshape({rows, hkv_, d_}).to(at::kFloat), kv_kind_, k_cache,
                             v_cache, k_scale, v_scale, slots);
        clock.lap(kRotaryStore);
        attn = cpuk::paged_decode_attention_codes(q, kv_kind_, k_cache, v_cache, k_scale, v_scale, tables, lens,
                                                  scale_, 0, 0.0)
                   .flatten(1);
      }
      clock.lap(kAttention);
      x = add_lora(plan, i, kOProj, attn, run_linear(layer.o, attn));
      clock.lap(kO);
      norm(layer.post_norm);
      const at::Tensor gate_up = add_lora(plan, i, kGateUpProj, normed, run_linear(layer.gate_up, normed));
      clock.lap(kGateUp);
      const at::Tensor act = cpuk::silu_and_mul(gate_up);
      clock.lap(kSilu);
      x = add_lora(plan, i, kDownProj, act, run_linear(layer.down, act));
      clock.lap(kDown);
    }
    norm(final_norm_);
    if (profile_) ++profiled_steps_;
    return normed;
  }

  // RMSNorm(x [+ residual]) -> out; residual <- x (+ residual). In place is safe: each element is
  // read before it is written, as the kernel's own rows are.
  void rms_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
                at::Tensor& new_residual) {
    const int64_t rows = x.size(0), hidden = x.size(1);
    const float* xp = x.data_ptr<float>();
    if (residual == nullptr) new_residual.copy_(x);  // the module path's new residual is x itself
    const float* rp = residual == nullptr ? nullptr : residual->data_ptr<float>();
    float* res_out = new_residual.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      k_.rms_norm(xp, rp, weight.data_ptr<float>(), out.data_ptr<float>(), res_out, begin, end, hidden, eps_);
    });
  }

  // A layer's norms and attention, checked against the loop's shapes and dtype.
  Layer attention_layer(at::Tensor input_norm, at::Tensor post_norm, Linear qkv, Linear o,
                        c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm) const {
    const int64_t hidden = final_norm_.size(0);
    TORCH_CHECK(qkv.k == hidden && qkv.n == (hq_ + 2 * hkv_) * d_ && o.k == hq_ * d_ && o.n == hidden,
                "attention shapes disagree");
    const at::ScalarType act = bf16_ ? at::kBFloat16 : at::kFloat;
    TORCH_CHECK(input_norm.scalar_type() == act && post_norm.scalar_type() == act,
                "norm weights of the activation dtype");
    if (bf16_)
      for (const Linear* l : {&qkv, &o})
        TORCH_CHECK(l->kind == Linear::kMkldnn, "bf16 activations in the loop: oneDNN-prepacked weights only");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    Layer layer{input_norm.contiguous(), post_norm.contiguous(), std::move(qkv), std::move(o)};
    layer.pool_slot = static_cast<int64_t>(layers_.size());  // one group: layer i in slot i
    if (q_norm.has_value()) {
      layer.q_norm = q_norm->contiguous();
      layer.k_norm = k_norm->contiguous();
      for (const at::Tensor* w : {&layer.q_norm, &layer.k_norm})
        TORCH_CHECK(w->dim() == 1 && w->size(0) == d_ && w->scalar_type() == act,
                    "q/k norm weights [head_dim] of the activation dtype");
    }
    return layer;
  }

  // The MoE MLP of one layer, op for op as SparseMoeBlock.forward at tensor parallel size 1: the
  // router's logits, route()'s softmax in fp32, top-k and renormalization, the experts' call, then
  // a shared expert's gated MLP, scaled by the sigmoid of its gate, added.
  at::Tensor experts(const MoeMlp& moe, const at::Tensor& normed) {
    const at::Tensor logits = run_linear(moe.router, normed);
    at::Tensor weights, ids;
    if (moe.softmax_of_top_k) {
      at::Tensor top;
      std::tie(top, ids) = at::topk(logits, moe.top_k, -1);
      weights = at::softmax(top, -1, at::kFloat);
    } else {
      std::tie(weights, ids) = at::topk(at::softmax(logits, -1, at::kFloat), moe.top_k, -1);
    }
    if (moe.renormalize) weights = weights / weights.sum(-1, true);
    expert_counts_.push_back(at::bincount(ids.reshape(-1), {}, moe.router.n));
    at::Tensor out = llk::moe::run_experts(*moe.experts, normed, weights, ids);
    if (moe.shared_down.n == 0) return out;
    at::Tensor shared = run_linear(moe.shared_down, silu_and_mul(run_linear(moe.shared_gate_up, normed)));
    if (moe.shared_gate.n != 0) shared = at::sigmoid(run_linear(moe.shared_gate, normed)) * shared;
    return out + shared;
  }

  // RMSNorm of each of ``heads`` heads (head_dim wide, from column ``offset`` of every row of
  // ``qkv``) in place: the row kernel the module path's q/k norm runs, one head a row.
  void head_norm(const at::Tensor& qkv, int64_t offset, int64_t heads, const at::Tensor& weight) {
    const int64_t width = qkv.size(1);
    float* base = qkv.data_ptr<float>() + offset;
    const float* w = weight.data_ptr<float>();
    at::parallel_for(0, qkv.size(0), 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = base + r * width;
        k_.rms_norm(row, nullptr, w, row, nullptr, 0, heads, d_, eps_);
      }
    });
  }

  // Rotary of ``heads`` heads starting at ``src`` in rows of ``row_stride`` floats -> out [B, heads, D].
  void rotate(const float* src, int64_t row_stride, int64_t heads, const at::Tensor& positions, at::Tensor& out) {
    const int64_t rows = out.size(0), rot = cos_sin_.size(1);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      k_.rotate(src, row_stride, d_, positions.data_ptr<int64_t>(), cos_sin_.data_ptr<float>(), out.data_ptr<float>(),
                begin, end, heads, d_, rot);
    });
  }

  // Calls f(code tag) with the code type of an 8-bit pool.
  template <typename F>
  void with_code_type(F&& f) const {
    switch (storage_) {
      case KvStorage::kInt8: f(cpuk::Int8Code{}); break;
      case KvStorage::kFp8E4m3: f(cpuk::Fp8E4m3Code{}); break;
      case KvStorage::kFp8E5m2: f(cpuk::Fp8E5m2Code{}); break;
      case KvStorage::kFloat:
      case KvStorage::kKivi: TORCH_CHECK(false, "not an 8-bit pool");
    }
  }

  // Elements of one layer's slice of a pool (and of its scales: per_layer / head_dim).
  int64_t per_layer() const { return k_pool_.size(1) * k_pool_.size(2) * hkv_ * d_; }

  void store_kv(int64_t layer, const float* key, int64_t key_stride, const float* value, int64_t value_stride,
                const at::Tensor& slots) {
    const int64_t row = hkv_ * d_, rows = slots.size(0);
    const int64_t* slot = slots.data_ptr<int64_t>();
    if (storage_ == KvStorage::kKivi) {
      store_kivi(layer, key, key_stride, value, value_stride);
      return;
    }
    if (storage_ == KvStorage::kFloat) {
      float* k_cache = k_pool_.data_ptr<float>() + layer * per_layer();
      float* v_cache = v_pool_.data_ptr<float>() + layer * per_layer();
      for (int64_t t = 0; t < rows; ++t) {
        if (slot[t] < 0) continue;
        std::memcpy(k_cache + slot[t] * row, key + t * key_stride, row * sizeof(float));
        std::memcpy(v_cache + slot[t] * row, value + t * value_stride, row * sizeof(float));
      }
      return;
    }
    // As cpu_kernels.cpp's store_kv_codes (the module path's store), rows spread over the threads.
    with_code_type([&](auto tag) {
      using C = decltype(tag);
      const float qmax = cpuk::kCodeMax<C>;
      C* k_codes = static_cast<C*>(k_pool_.data_ptr()) + layer * per_layer();
      C* v_codes = static_cast<C*>(v_pool_.data_ptr()) + layer * per_layer();
      float* k_scales = k_scale_.data_ptr<float>() + layer * per_layer() / d_;
      float* v_scales = v_scale_.data_ptr<float>() + layer * per_layer() / d_;
      const auto quantize = cpuk::quantize_rows_fn<C>(avx512_);
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        quantize(key, key_stride, hkv_, d_, slot, qmax, k_codes, k_scales, begin, end);
        quantize(value, value_stride, hkv_, d_, slot, qmax, v_codes, v_scales, begin, end);
      });
    });
  }

  // As cpu_kernels.cpp's paged_decode_attention (paged_decode_attention_codes for 8-bit pools), on
  // this layer's slice of the pool.
  void attention(const Layer& l, const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                 at::Tensor& out) {
    const int64_t num_seqs = q.size(0), block_size = k_pool_.size(2), layer = l.pool_slot;
    if (storage_ == KvStorage::kKivi) {
      attention_kivi(layer, q, tables, lens, out);
      return;
    }
    const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? hkv_ : 1;
    const int64_t tasks = num_seqs * (hkv_ / heads_per_task);
    if (storage_ == KvStorage::kFloat) {
      DecodeArgs<float> args{q.data_ptr<float>(), k_pool_.data_ptr<float>() + layer * per_layer(),
                             v_pool_.data_ptr<float>() + layer * per_layer(), tables.data_ptr<int32_t>(),
                             lens.data_ptr<int32_t>(), out.data_ptr<float>(), hq_, hkv_, d_, block_size, tables.size(1),
                             heads_per_task, scale_};
      args.window = l.window;
      args.sinks = l.sinks.defined() ? l.sinks.data_ptr<float>() : nullptr;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { k_.decode(args, begin, end); });
      return;
    }
    with_code_type([&](auto tag) {
      using C = decltype(tag);
      const C* k_codes = static_cast<const C*>(k_pool_.data_ptr()) + layer * per_layer();
      const C* v_codes = static_cast<const C*>(v_pool_.data_ptr()) + layer * per_layer();
      const DecodeArgs<float, C> args{q.data_ptr<float>(), k_codes, v_codes,
                                      tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), hq_,
                                      hkv_, d_, block_size, tables.size(1), heads_per_task, scale_,
                                      k_scale_.data_ptr<float>() + layer * per_layer() / d_,
                                      v_scale_.data_ptr<float>() + layer * per_layer() / d_};
      const auto decode = cpuk::decode_codes_fn<C>(avx512_);
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) { decode(args, begin, end); });
    });
  }

  // Checks the pools (of the activations' `dtype`, or byte codes) and, for codes, takes their scales.
  void take_pools(at::ScalarType dtype, const c10::optional<at::Tensor>& k_scale,
                  const c10::optional<at::Tensor>& v_scale) {
    const bool codes = storage_ != KvStorage::kFloat;
    for (const at::Tensor* pool : {&k_pool_, &v_pool_})
      TORCH_CHECK(pool->dim() == 5 && pool->is_contiguous() && pool->sizes() == k_pool_.sizes() &&
                      pool->scalar_type() == (codes ? at::kByte : dtype),
                  "KV pools: contiguous [layers, blocks, block_size, kv_heads, head_dim], of the activations' dtype "
                  "or byte codes");
    TORCH_CHECK(k_pool_.size(3) == hkv_ && k_pool_.size(4) == d_, "KV cache shape");
    if (!codes) return;
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "8-bit KV codes need their scales");
    k_scale_ = *k_scale;
    v_scale_ = *v_scale;
    for (const at::Tensor* s : {&k_scale_, &v_scale_})
      TORCH_CHECK(s->is_contiguous() && s->scalar_type() == at::kFloat && s->sizes() == k_pool_.sizes().slice(0, 4),
                  "KV scales: contiguous float32 [layers, blocks, block_size, kv_heads]");
    TORCH_CHECK(d_ == 64 || d_ == 128, "8-bit KV codes in the loop: head_dim 64 or 128");
  }

  void init_kivi(int bits, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                 const c10::optional<at::Tensor>& k_zero, const c10::optional<at::Tensor>& v_zero,
                 const c10::optional<at::Tensor>& residual_k, const c10::optional<at::Tensor>& residual_v,
                 int64_t value_group) {
    TORCH_CHECK(k_scale && v_scale && k_zero && v_zero && residual_k && residual_v,
                "a KIVI pool needs its scales, zeros and residual slots");
    kivi_.bits = bits;
    kivi_.value_group = value_group;
    k_scale_ = *k_scale;
    v_scale_ = *v_scale;
    kivi_.k_zero = *k_zero;
    kivi_.v_zero = *v_zero;
    kivi_.residual_k = *residual_k;
    kivi_.residual_v = *residual_v;
    const int64_t layers = k_pool_.size(0), blocks = k_pool_.size(1), block_size = k_pool_.size(2);
    TORCH_CHECK(value_group > 0 && d_ % value_group == 0 && d_ % (8 / bits) == 0, "KIVI value groups");
    const std::vector<int64_t> codes{layers, blocks, block_size, hkv_, d_ * bits / 8};
    const std::vector<int64_t> key_params{layers, blocks, hkv_, d_};
    const std::vector<int64_t> value_params{layers, blocks, block_size, hkv_, d_ / value_group};
    for (const at::Tensor* t : {&k_pool_, &v_pool_})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kByte && t->sizes() == codes,
                  "KIVI codes: contiguous uint8 [layers, blocks, block_size, kv_heads, head_dim * bits / 8]");
    for (const at::Tensor* t : {&k_scale_, &kivi_.k_zero})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kHalf && t->sizes() == key_params,
                  "KIVI key scales and zeros: contiguous float16 [layers, blocks, kv_heads, head_dim]");
    for (const at::Tensor* t : {&v_scale_, &kivi_.v_zero})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kHalf && t->sizes() == value_params,
                  "KIVI value scales and zeros: contiguous float16 [layers, blocks, block_size, kv_heads, groups]");
    for (const at::Tensor* t : {&kivi_.residual_k, &kivi_.residual_v})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->dim() == 5 && t->size(0) == layers &&
                      t->size(2) == block_size && t->size(3) == hkv_ && t->size(4) == d_ &&
                      t->sizes() == kivi_.residual_k.sizes(),
                  "KIVI residual slots: contiguous float32 [layers, slots, block_size, kv_heads, head_dim]");
  }

  // One layer's slices of the KIVI pool.
  struct KiviLayer {
    uint8_t *k_codes, *v_codes;
    at::Half *k_scale, *k_zero, *v_scale, *v_zero;
    float *residual_k, *residual_v;
  };

  KiviLayer kivi_layer(int64_t layer) {
    const int64_t blocks = k_pool_.size(1), block_size = k_pool_.size(2), row = hkv_ * d_;
    const int64_t codes = blocks * block_size * row * kivi_.bits / 8;
    const int64_t value_groups = blocks * block_size * row / kivi_.value_group;
    const int64_t residual = kivi_.residual_k.size(1) * block_size * row;
    return {static_cast<uint8_t*>(k_pool_.data_ptr()) + layer * codes,
            static_cast<uint8_t*>(v_pool_.data_ptr()) + layer * codes,
            k_scale_.data_ptr<at::Half>() + layer * blocks * row, kivi_.k_zero.data_ptr<at::Half>() + layer * blocks * row,
            v_scale_.data_ptr<at::Half>() + layer * value_groups, kivi_.v_zero.data_ptr<at::Half>() + layer * value_groups,
            kivi_.residual_k.data_ptr<float>() + layer * residual, kivi_.residual_v.data_ptr<float>() + layer * residual};
  }

  // As the module path's QuantizedLayerKV.store with the native KIVI store: kv_quant_attention.cpp's
  // kivi_store_run on this layer's slices, staging in a scratch buffer.
  void store_kivi(int64_t layer, const float* key, int64_t key_stride, const float* value, int64_t value_stride) {
    const int64_t block_size = k_pool_.size(2), row = hkv_ * d_, finalize = kivi_.finalize_blocks.numel();
    const KiviLayer l = kivi_layer(layer);
    kivi_staging_.resize(2 * finalize * block_size * row);
    const kvqk::KiviStoreArgs a{
        kivi_.bits, hkv_, d_, block_size, kivi_.value_group, key, key_stride, value, value_stride,
        l.residual_k, l.residual_v, kivi_.residual_tokens.data_ptr<int64_t>(), kivi_.residual_rows.data_ptr<int64_t>(),
        kivi_.residual_tokens.numel(), kivi_.staging_tokens.data_ptr<int64_t>(), kivi_.staging_rows.data_ptr<int64_t>(),
        kivi_.staging_tokens.numel(), kivi_.staged_from.data_ptr<int64_t>(), kivi_.finalize_blocks.data_ptr<int64_t>(),
        finalize, kivi_staging_.data(), kivi_staging_.data() + finalize * block_size * row,
        l.k_codes, l.k_scale, l.k_zero, l.v_codes, l.v_scale, l.v_zero};
    kvqk::kivi_store_run(a);
  }

  // As kv_quant_attention.cpp's quantized_decode_attention (the module path's KIVI decode) on this
  // layer's slices; its AVX2 variant, which kernels/kv_quant_native.py selects on every CPU the
  // loop runs on.
  void attention_kivi(int64_t layer, const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                      at::Tensor& out) {
    const KiviLayer l = kivi_layer(layer);
    const kvqk::KvqArgs<float> a{kvqk::kKivi, kivi_.bits, q.data_ptr<float>(), l.k_codes, l.v_codes, nullptr, nullptr,
                                 l.k_scale, l.k_zero, l.v_scale, l.v_zero, l.residual_k, l.residual_v,
                                 kivi_.residual_table.data_ptr<int64_t>(), nullptr,
                                 tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(),
                                 hq_, hkv_, d_, k_pool_.size(2), tables.size(1), kivi_.value_group, scale_};
    at::parallel_for(0, q.size(0) * hkv_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; ++task) kvqk::decode_task_avx2(a, task, scratch);
    });
  }

  // out += the step's LoRA deltas of this projection: the kernel the module path calls
  // (llmctl_kernels.lora.lora_add_native), so both give the same bits.
  at::Tensor add_lora(const std::vector<llk::lora::Group>& plan, int64_t layer, Projection projection,
                      const at::Tensor& x, at::Tensor out) const {
    if (plan.empty() || lora_.empty() || lora_[layer][projection].empty()) return out;
    llk::lora::lora_add(out, x, lora_[layer][projection], plan);
    return out;
  }

  at::Tensor silu_and_mul(const at::Tensor& x) {
    const int64_t rows = x.size(0), d = x.size(1) / 2;
    auto out = at::empty({rows, d}, x.options());
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      k_.silu_and_mul(x.data_ptr<float>(), out.data_ptr<float>(), begin, end, d);
    });
    return out;
  }

  enum Op { kNorm, kQkv, kRotaryStore, kAttention, kO, kGateUp, kSilu, kDown, kExperts, kNumOps };
  static constexpr const char* kOpNames[kNumOps] = {"norm", "qkv", "rotary_store", "attention",
                                                    "o", "gate_up", "silu", "down", "experts"};
  using OpTimes = std::array<int64_t, kNumOps>;
  // Adds the time since the previous lap to an op's total (nothing when profiling is off).
  struct Clock {
    OpTimes* times;
    std::chrono::steady_clock::time_point last;
    explicit Clock(OpTimes* t) : times(t), last(t ? std::chrono::steady_clock::now() : last) {}
    void lap(Op op) {
      if (times == nullptr) return;
      const auto now = std::chrono::steady_clock::now();
      (*times)[op] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
      last = now;
    }
  };
  bool profile_ = false;
  OpTimes op_ns_{};
  int64_t profiled_steps_ = 0;

  IsaKernels k_;
  bool avx512_;  // the avx512 variants (else avx2), as kernels_for picked
  bool bf16_ = false;  // bf16 activations: forward_tensors
  int64_t hq_, hkv_, d_;
  float eps_, scale_;
  at::Tensor cos_sin_, final_norm_;
  KvStorage storage_;
  std::string kv_kind_;  // as kernels/kv_quant.py names it: the module path's kernels take the name
  at::Tensor k_pool_, v_pool_, k_scale_, v_scale_;
  KiviPool kivi_;
  std::vector<float> kivi_staging_;  // a KIVI step's staging rows (K then V), reused from step to step
  std::vector<Layer> layers_;
  std::vector<std::array<std::vector<llk::lora::Stack>, kNumProjections>> lora_;  // per layer; empty: none
  std::vector<llk::lora::Group> lora_plan_;  // the next forward's (set_lora_plan)
  std::vector<at::Tensor> expert_counts_;    // the last forward's, per MoE layer (expert_counts)
};

}  // namespace

namespace llk::decode_loop {

// The Python module `llmctl_kernels._C.decode_loop` (called by bindings.cpp): its classes live here.
void bind(pybind11::module_& m) {
  pybind11::class_<Linear>(m, "Linear", "One bound linear layer (dense or panel float32, packed int4/int8, oneDNN)");
  m.def("make_linear", &make_linear, "Bind a linear layer's weights", pybind11::arg("kind"),
        pybind11::arg("in_features"), pybind11::arg("weight") = pybind11::none(),
        pybind11::arg("qweight") = pybind11::none(), pybind11::arg("scales") = pybind11::none(),
        pybind11::arg("mins") = pybind11::none(), pybind11::arg("group") = 0, pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("bias_in_gemm") = false, pybind11::arg("out_features") = 0,
        pybind11::arg("tiles") = pybind11::none(), pybind11::arg("tile_scale_bytes") = 0,
        pybind11::arg("tile_kind") = 0);
  m.def("make_split_linear", &make_split_linear, "Bind a merged projection's parts, side by side",
        pybind11::arg("parts"), pybind11::arg("bias") = pybind11::none());
  pybind11::class_<DecodeLoop>(m, "DecodeLoop", "Every decoder layer of a decode step in one call")
      .def(pybind11::init<const std::string&, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                          const std::string&, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t>(),
           pybind11::arg("isa"), pybind11::arg("num_q_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("cos_sin_cache"), pybind11::arg("final_norm"),
           pybind11::arg("kv_kind"), pybind11::arg("k_pool"), pybind11::arg("v_pool"),
           pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none(),
           pybind11::arg("k_zero") = pybind11::none(), pybind11::arg("v_zero") = pybind11::none(),
           pybind11::arg("residual_k") = pybind11::none(), pybind11::arg("residual_v") = pybind11::none(),
           pybind11::arg("value_group") = 0)
      .def("add_layer", &DecodeLoop::add_layer)
      .def("add_moe_layer", &DecodeLoop::add_moe_layer)
      .def("expert_counts", &DecodeLoop::expert_counts)
      .def("set_kivi_plan", &DecodeLoop::set_kivi_plan)
      .def("set_lora", &DecodeLoop::set_lora)
      .def("set_lora_plan", &DecodeLoop::set_lora_plan)
      .def("num_layers", &DecodeLoop::num_layers)
      .def("set_profile", &DecodeLoop::set_profile)
      .def("profile", &DecodeLoop::profile)
      .def("set_attention", &DecodeLoop::set_attention, pybind11::arg("layer"), pybind11::arg("group"),
           pybind11::arg("pool_slot"), pybind11::arg("window") = 0, pybind11::arg("sinks") = pybind11::none())
      .def("forward", &DecodeLoop::forward, pybind11::arg("embeddings"), pybind11::arg("positions"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("group_slots") = std::vector<at::Tensor>{},
           pybind11::arg("group_tables") = std::vector<at::Tensor>{},
           pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace llk::decode_loop
