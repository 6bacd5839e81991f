// The Python module `llmctl_kernels._C`: one submodule per kernel family, each a thin binding of the
// functions its header declares (the kernels themselves compile in their own translation units,
// without pybind11). Loaded by kernels/native_module.py; built by setup.py at install time.
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "gemm_kernels.h"
#include "kv_quant_attention.h"
#include "lora_kernels.h"
#include "quant_kernels.h"

namespace llk::decode_loop {
void bind(pybind11::module_& m);  // decode_loop.cpp
}
namespace llk::moe {
void bind(pybind11::module_& m);  // moe_experts.cpp
}

namespace {

void bind_cpu(pybind11::module_& m) {
  using namespace llk::cpu;
  m.def("set_isa", &set_isa, "Select the kernel variant: generic, avx2, avx512 or avx512bf16");
  m.def("compiled_isas", &compiled_isas, "The kernel variants compiled into this module");
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V into the paged cache through the slot mapping (CPU)");
  namespace py = pybind11;
  // window > 0: a sliding window, softcap > 0: attention-logit soft-capping, sinks: [Hq] sink logits
  // or None (attention_window.h)
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("decode_codes_supported", &decode_codes_supported, "Whether paged_decode_attention_codes takes this head_dim");
  m.def("paged_decode_attention_codes", &paged_decode_attention_codes,
        "Paged decode attention over an 8-bit KV pool (int8, fp8_e4m3, fp8_e5m2; CPU)", py::arg("query"),
        py::arg("kind"), py::arg("k_codes"), py::arg("v_codes"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention_codes", &paged_prefill_attention_codes,
        "Causal paged prefill attention over an 8-bit KV pool (CPU)", py::arg("query"), py::arg("kind"),
        py::arg("k_codes"), py::arg("v_codes"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("store_kv_codes", &store_kv_codes, "Quantize K/V per (token, KV head) into an 8-bit pool (CPU)");
  m.def("prefill_attention_supported", &prefill_attention_supported, "Whether paged_prefill_attention takes these");
  m.def("paged_prefill_attention", &paged_prefill_attention, "Causal paged prefill attention, fp32 or bf16 (CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm with optional fused residual add (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up (CPU)");
  m.def("rotate", &rotate, "Rotary embedding, rotate-half layout (CPU)");
  m.def("lora_add", &llk::lora::lora_add,
        "out += each adapter slot's LoRA deltas over its rows, from transposed fp32 stacks (lora_kernels.cpp)");
}

void bind_quant(pybind11::module_& m) {
  using namespace llk::quant;
  m.def("set_isa", &set_isa, "Cap the kernel variants: avx2 (no AVX-512 code) or generic (scalar int8 too)");
  m.def("isa", &isa, "the instruction set the kernels use");
  m.def("set_qgemm_min_rows", &set_qgemm_min_rows,
        "x rows from which the interleaved layout takes the many-row GEMM (qgemm.h); 0: the default per "
        "CPU and weight kind; returns the old value");
  m.def("int4_linear", &int4_linear, "x @ dequant(int4)^T from the packed nibbles");
  m.def("int8_linear", &int8_linear, "x @ dequant(int8)^T from the packed bytes");
  namespace py = pybind11;
  m.def("step_scales", &step_scales,
        "float32 scales [n, k / group] as (int8 per group, float32 step per 256 inputs), exactly, or None");
  m.def("interleave_tiles", &interleave_tiles, "a packed int4/int8 weight in the tile-interleaved layout",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group"), py::arg("scale_steps") = py::none(),
        py::arg("min_steps") = py::none(), py::arg("e2m1") = false);
  m.def("e2m1_codes", &e2m1_codes, "whether every value of an int8 weight is one of MXFP4's (doubled)");
  m.def("interleaved_linear", &interleaved_linear, "x @ dequant(W)^T from interleave_tiles' layout");
  m.def("fp8_linear", &fp8_linear, "x @ dequant(fp8 e4m3)^T from the packed bytes");
}

void bind_kv_quant(pybind11::module_& m) {
  using namespace llk::kvq;
  m.def("set_isa", &set_isa, "Select the kernel variant: generic, or avx2 for avx2 and above");
  m.def("isa", &isa, "The kernel variant in use");
  namespace py = pybind11;
  m.def("quantized_decode_attention", &quantized_decode_attention,
        "Paged decode attention over a quantized KV pool (fp8, int8, KIVI; CPU)", py::arg("query"), py::arg("kind"),
        py::arg("bits"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("k_zero"),
        py::arg("v_zero"), py::arg("residual_k"), py::arg("residual_v"), py::arg("residual_table"), py::arg("lut"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("value_group"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("kivi_store", &kivi_store, "One layer's KIVI store: residual rows, staging and the completed blocks' codes");
}

void bind_gemm(pybind11::module_& m) {
  using namespace llk::gemm;
  m.def("set_isa", &set_isa, "Select the kernel variant: generic, avx2 or avx512");
  m.def("compiled_isas", &compiled_isas, "The kernel variants compiled into this module");
  m.def("linear", &linear, "x @ w^T (+ bias) with w packed in 16-column panels (fp32, CPU)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto cpu = m.def_submodule("cpu", "attention, RMSNorm, SiLU-and-mul, rotary, KV store (cpu_kernels.cpp)");
  bind_cpu(cpu);
  auto quant = m.def_submodule("quant", "packed int4/int8/fp8 linear layers (quant_kernels.cpp)");
  bind_quant(quant);
  auto kv_quant = m.def_submodule("kv_quant", "attention over a quantized KV pool (kv_quant_attention.cpp)");
  bind_kv_quant(kv_quant);
  auto gemm = m.def_submodule("gemm", "the fp32 panel GEMM (gemm_kernels.cpp)");
  bind_gemm(gemm);
  auto loop = m.def_submodule("decode_loop", "every decoder layer of a decode step in one call (decode_loop.cpp)");
  llk::decode_loop::bind(loop);
  auto moe = m.def_submodule("moe", "one mixture-of-experts layer's packed experts in one call (moe_experts.cpp)");
  llk::moe::bind(moe);
}
