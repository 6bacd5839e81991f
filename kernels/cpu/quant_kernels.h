// What quant_kernels.cpp offers the decode loop and the bindings: the int16 activations, the
// tile-interleaved layout and the integer GEMMs of packed int4/int8 weights, and the tensor-level
// quantized linear kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace llk::quant {

constexpr int64_t QB = 32;  // activation quantization block (inputs)
constexpr int64_t RT = 4;   // weight rows per tile of the integer path

// What the blocks of a packed weight's tiles hold (the `kind` of tile_layout, interleaved_gemm and
// the callers': a bool `int4` converts to the first two): int8 values, int4 nibbles, or int8
// values that are all MXFP4's (E2M1 doubled: llama.cpp's kvalues_mxfp4) stored as 4-bit codes
// into kE2m1Values, byte i of a block holding input i's (low nibble) and input i + 16's (high).
// The kernels look such codes up into the very int8 values, so they compute int8's products and
// bits from half its bytes (MXFP4 experts, kept packed as int8 groups, at MXFP4's own 4.5 bits).
// The values run from the least, so code 0 is -12: value + 12 is a byte that is 0 for code 0 (what
// the AVX2 one-row unpack's lookup needs of a zero high byte; 0 has two codes, as in MXFP4).
constexpr int64_t kInt8Weights = 0, kInt4Weights = 1, kE2m1Weights = 2;
inline constexpr int8_t kE2m1Values[16] = {-12, -8, -6, -4, -3, -2, -1, 0, 0, 1, 2, 3, 4, 6, 8, 12};

// x rounded to int16 per row and per block of QB inputs (scale = max|x| / 32767).
struct QuantizedX {
  int64_t m, k;
  std::vector<int16_t> q;    // [M, K]; for int4 each 32-block is permuted to int4_tile_avx2's lane order
  std::vector<float> scale;  // [M, K / 32]
  std::vector<float> sum16;  // [M, K / 16] exact float sums of x (natural order), for the mins
  const float* x = nullptr;  // the float rows themselves (interleaved_gemm's int8 path at many rows)
};

// One tile of RT weight rows in interleave_tiles' layout (quant_kernels.cpp describes it). bpg 0:
// int8 in groups of 16 (GGUF's Q6_K), two groups to a 32-input block. scale_bytes: 4 float32
// scales and mins, 2 float16, 1 stepped (an int8 per group times a float32 step per STEP inputs
// and row, GGUF's K-quant super-block: step_scales factors them exactly).
constexpr int64_t STEP = 256;
struct TileLayout {
  int64_t groups, bpg, block_bytes, scale_bytes;
  bool mins;
  bool e2m1 = false;  // int8 blocks held as kE2m1Values codes (16 bytes a block)
  // set once by tile_layout: the kernels ask per tile, and dividing there costs as much as a block
  int64_t step_groups = 0, step_count = 0;
  int64_t group_bytes() const {
    return RT * scale_bytes + (bpg == 0 ? RT * block_bytes / 2 : bpg * RT * block_bytes);
  }
  bool stepped() const { return scale_bytes == 1; }
  int64_t groups_per_step() const { return step_groups; }
  int64_t steps() const { return step_count; }
  // stepped: a tile starts with the RT rows' float32 scale steps of each step, then their min steps
  int64_t groups_offset() const { return steps() * RT * 4 * (mins ? 2 : 1); }
  int64_t mins_offset() const { return groups_offset() + groups * group_bytes(); }
  int64_t tile_bytes() const { return mins_offset() + (mins ? groups * RT * scale_bytes : 0); }
};

// ---- pointer-level kernels (x86-64 with AVX2+FMA+F16C) ----
QuantizedX quantize_x(const float* x, int64_t m, int64_t k, bool nibble_order);
TileLayout tile_layout(int64_t k, int64_t group, int64_t kind, int64_t scale_bytes, bool mins);
void packed_gemm(const QuantizedX& xq, const uint8_t* w, bool int4, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t group, int64_t n, float* out);
// From qgemm_min_rows rows of x (and xq.x set), qgemm.h's many-row GEMM instead.
// kind: kInt8Weights, kInt4Weights or kE2m1Weights (xq quantized in nibble order for int4 only).
void interleaved_gemm(const QuantizedX& xq, const uint8_t* tiles, int64_t kind, int64_t scale_bytes, int64_t group,
                      bool mins, int64_t n, float* out);
// Whether a packed int8 weight takes the per-token path: per output channel (group == K), symmetric.
inline bool int8_per_channel(int64_t group, int64_t k, bool has_mins) { return group == k && !has_mins; }
void int8_per_channel_linear(const float* x, int64_t m, int64_t k, const int8_t* w, const at::Tensor& scales,
                             int64_t n, float* out);

// ---- tensor-level kernels (the Python module `llmctl_kernels._C.quant`) ----
std::string set_isa(const std::string& name);  // caps the variants: avx2 (no AVX-512), generic (scalar int8)
std::string isa();
// qgemm.h's many-row GEMM from this many rows on (0: the measured default per CPU and weight kind);
// returns the old value.
int64_t set_qgemm_min_rows(int64_t rows);
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group, bool int_path);
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, int64_t group, bool int_path);
// Scales [n, k / group] float32 as an int8 per group times a float32 step per STEP inputs and row,
// exactly (steps * ints == scales bit for bit), or None where some step's values do not factor so.
c10::optional<std::tuple<at::Tensor, at::Tensor>> step_scales(const at::Tensor& scales, int64_t group);
// e2m1: an int8 weight's blocks as kE2m1Values codes (e2m1_codes must hold for it).
at::Tensor interleave_tiles(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t group, const c10::optional<at::Tensor>& scale_steps,
                            const c10::optional<at::Tensor>& min_steps, bool e2m1);
// Whether every value of an int8 weight is one of kE2m1Values (MXFP4's, doubled).
bool e2m1_codes(const at::Tensor& qweight);
at::Tensor interleaved_linear(const at::Tensor& x_in, const at::Tensor& tiles, int64_t kind, int64_t n, int64_t group,
                              int64_t scale_bytes, bool mins);
at::Tensor fp8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales, bool direct);

}  // namespace llk::quant
