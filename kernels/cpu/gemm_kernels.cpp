// Python bindings of the fp32 panel GEMM in gemm_kernels.h (built by kernels/gemm_native.py).
#include "gemm_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_isa", &llmctl_gemm::set_isa, "Select the kernel variant: generic, avx2 or avx512");
  m.def("compiled_isas", &llmctl_gemm::compiled_isas, "The kernel variants compiled into this module");
  m.def("linear", &llmctl_gemm::linear, "x @ w^T (+ bias) with w packed in 16-column panels (fp32, CPU)");
}
