// The one run-time ISA scheme of the native kernels: no -march flag, so one build runs on any
// x86-64 CPU. A kernel's loops are compiled once per instruction set inside a
// `#pragma GCC target` region (or a function's target attribute), each in a namespace of its own
// (generic, avx2, avx512, avx512bf16), and `set_isa` (called from kernels/cpu_features.py's level,
// read from /proc/cpuinfo and capped by `set_isa_cap`) picks the variant at run time. Which kernel
// has which variants: docs/kernels.md, "Native build and ISA variants".
#pragma once

#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LLK_X86_VARIANTS 1
#endif

namespace llk {

// Ordered: a level runs every variant of the levels below it.
enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The level named as kernels/cpu_features.py names it; false for an unknown name, or an x86 level
// on a build without the x86 variants.
inline bool parse_isa(const std::string& name, Isa* isa) {
  if (name == "generic") *isa = Isa::kGeneric;
#ifdef LLK_X86_VARIANTS
  else if (name == "avx2") *isa = Isa::kAvx2;
  else if (name == "avx512") *isa = Isa::kAvx512;
  else if (name == "avx512bf16") *isa = Isa::kAvx512Bf16;
#endif
  else return false;
  return true;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
    default: return "generic";
  }
}

}  // namespace llk
