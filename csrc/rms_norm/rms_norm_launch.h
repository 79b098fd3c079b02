// rms_norm's launch interface, shared by the host code (rms_norm_cuda.cpp, compiled by the C++
// compiler) and the kernels (*.cu): kernel parameters, the row shapes kept in registers, the
// launch plan, the planners and launchers.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fuseforge::rms_norm {

// The dtype of a tensor whose type is chosen at run time (the weight: x's or float32; out and
// grad_out: x's, or bf16/fp16 beside a float32 x), so that it costs no kernel instantiations.
enum class Dtype : int { kFloat, kHalf, kBFloat16 };

inline Dtype dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Dtype::kFloat;
    case at::kHalf: return Dtype::kHalf;
    case at::kBFloat16: return Dtype::kBFloat16;
    default: TORCH_CHECK(false, "rms_norm CUDA kernels take float32, float16 or bfloat16, got ", t);
  }
}

template <typename T>
struct ForwardParams {
  const T* x;
  const T* residual;   // nullable
  const void* weight;  // nullable: no scale
  const void* bias;    // LayerNorm's; nullable: no shift
  T* residual_out;     // h = x + residual; set exactly when residual is
  void* out;
  float* mean;         // LayerNorm's row means; nullable: not stored
  float* rstd;         // nullable: not stored (no gradient wanted)
  int64_t rows, cols;
  float eps, weight_offset;
  Dtype weight_dtype, bias_dtype, out_dtype;
};

template <typename T>
struct BackwardParams {
  const void* grad_out;          // the forward's out dtype
  const T* grad_residual_out;    // nullable
  const T* h;
  const void* weight;            // nullable
  const float* mean;             // LayerNorm's (the centered kernels read it)
  const float* rstd;
  T* grad_input;
  float* weight_partials;        // nullable: (grid, cols) fp32 partial sums of grad_out * xhat
  float* bias_partials;          // LayerNorm's, nullable: (grid, cols) fp32 partial sums of grad_out
  int64_t rows, cols;
  float weight_offset;
  Dtype weight_dtype, bias_dtype, out_dtype;  // bias_dtype: LayerNorm's grad_bias (the bias's dtype)
};

// A row kept in registers: threads_per_row threads, each holding vecs 16-byte vectors of it (a
// row of up to threads_per_row * vecs vectors). Up to 32 threads a row reduce with warp shuffles
// only, and a 256-thread block takes several rows at once, so a small row (Qwen3's q/k norm: 128)
// does not leave a block idle; larger rows reduce across warps through shared memory.
struct RowShape {
  int threads_per_row;
  int vecs;
};
inline constexpr RowShape kForwardRowShapes[] = {{8, 2},  {16, 2},  {32, 2},  {32, 4},
                                                 {64, 4}, {128, 4}, {256, 4}, {512, 4}};
// The backward holds two or three tensors of a row (h, grad_out, grad_residual_out) and its weight
// gradient's sums: two vectors a thread keep the 16-bit kernels under 128 registers (four took 162
// for bf16 with ptxas 13: one 256-thread block an SM).
inline constexpr RowShape kBackwardRowShapes[] = {{8, 2},  {16, 2},  {32, 2},  {64, 2},
                                                  {128, 2}, {256, 2}, {512, 2}, {1024, 2}};
inline constexpr int kNumRowShapes = sizeof(kForwardRowShapes) / sizeof(kForwardRowShapes[0]);

constexpr int64_t row_shape_capacity(const RowShape& s) { return static_cast<int64_t>(s.threads_per_row) * s.vecs; }

constexpr bool same_capacities() {
  if (sizeof(kBackwardRowShapes) != sizeof(kForwardRowShapes)) return false;
  for (int i = 0; i < kNumRowShapes; ++i)
    if (row_shape_capacity(kForwardRowShapes[i]) != row_shape_capacity(kBackwardRowShapes[i])) return false;
  return true;
}
static_assert(same_capacities(), "a row takes the same shape index in both directions");

// RMSNorm's forward without a residual on wide rows takes the reread kernel: its threads read the
// row into registers for the sum of squares, then again from L1 for the output, as torch.compile's
// norm does. Only the sum lives across the row's reduction, so it runs at 32 registers: four
// 512-thread blocks an SM where the rows kernel's 512 x 4 row in registers (40) allows three, two of
// 1024 where a 1024 x 4 row (44) would allow one, and the two-pass kernel leaves the DRAM idle between
// its loop trips. H200: 8192 x 16384 bf16 0.132 ms against 0.137 (rows kernel), 4096 x 32768 bf16
// 0.133 against 0.151 (two-pass), 16384 x 8192 fp32 in / bf16 out 0.190 against 0.192 (rows kernel).
inline constexpr RowShape kRereadRowShapes[] = {{512, 4}, {1024, 4}};
inline constexpr int kNumRereadShapes = sizeof(kRereadRowShapes) / sizeof(kRereadRowShapes[0]);

// The reread shape for a row of `vectors` 16-byte vectors, or -1: rows of 1025-4096 vectors (bf16 /
// fp16 8200-32768 elements, float32 4100-16384). Narrower rows keep the rows kernel (16 KB rows:
// the reread shapes were slower there, Tried). any_width: every row that a shape holds (a
// development knob's).
inline int pick_reread_shape(int64_t vectors, bool any_width = false) {
  if (!any_width && vectors <= 1024) return -1;
  for (int i = 0; i < kNumRereadShapes; ++i)
    if (row_shape_capacity(kRereadRowShapes[i]) >= vectors) return i;
  return -1;
}

// The first shape whose row holds `vectors` vectors, or -1: rows longer than the last one (bf16
// 16384, fp32 8192) take the two-pass kernel, which reads each row twice.
inline int pick_row_shape(int64_t vectors) {
  for (int i = 0; i < kNumRowShapes; ++i)
    if (row_shape_capacity(kForwardRowShapes[i]) >= vectors) return i;
  return -1;
}

// The residual form's forward at rows of 256+ vectors runs at the backward's shapes, two vectors a
// thread (twice the threads a row) instead of four. LayerNorm's at 256-512 vectors (bf16 2048-4096:
// 0.0700 against 0.0761 ms, 0.131 against 0.142; the plain form was slower so, 2048 0.0489 against
// 0.0450); RMSNorm's at 256-2048 (0.3-1.5% on each bf16 and fp32-in row of 2048-8192).
// FUSEFORGE_RMS_NORM_RESIDUAL_TWO_VECTOR_SHAPES is RMSNorm's set, a bit a shape (a compile-time knob,
// so scripts/tune_variants.sh can build variants side by side).
#ifndef FUSEFORGE_RMS_NORM_RESIDUAL_TWO_VECTOR_SHAPES
#define FUSEFORGE_RMS_NORM_RESIDUAL_TWO_VECTOR_SHAPES 0xF0
#endif
constexpr bool residual_takes_two_vectors(bool centered, int row_shape) {
  const unsigned shapes = centered ? 0x30u : static_cast<unsigned>(FUSEFORGE_RMS_NORM_RESIDUAL_TWO_VECTOR_SHAPES);
  return row_shape >= 0 && row_shape < kNumRowShapes && ((shapes >> row_shape) & 1u) != 0;
}

// The forward's row shapes whose threads load the weight (and LayerNorm's bias), when of x's dtype,
// ahead of each row's own loads instead of after its reductions: the output step waits on no load.
// 16-bit rows at 64-256 threads x 4 vectors for RMSNorm, 64-128 x 4 for LayerNorm (H200, 16384
// rows, ms: RMSNorm bf16 2048 0.0361 against 0.0370, 8192 0.1280 against 0.1302 in an A/B run;
// LayerNorm bf16 2048 0.0414 against 0.0450, 4096 0.0774 against 0.0800). LayerNorm's 256 x 4 (8192)
// took 86 registers so, 0.175 against 0.150; float32 rows gained nothing (RMSNorm fp32 in / bf16 out
// 2048 / 4096 0.0522 / 0.0993 against 0.0527 / 0.0988, 8 bytes of spill at 64 registers) or lost
// (LayerNorm 1024 / 2048: 0.0348 / 0.0613 against 0.0314 / 0.0538); the narrow rows were level; the
// residual forms' two-vector shapes slower.
constexpr bool preloads_scale(bool centered, int row_shape, int elem_bytes) {
  return elem_bytes == 2 && row_shape >= 4 && row_shape <= (centered ? 5 : 6);
}

// RMSNorm's forward without a residual on 16-bit rows of exactly 16 vectors (128 elements: Qwen3's
// q/k norm over each head) takes the narrow kernel, in torch.compile's layout for these rows: a
// 64-thread block takes 8 rows, 16 threads a row, each thread one vector of each of two rows (4 rows
// apart), the weight's type a template parameter. H200, 262144 x 128 bf16: 0.0349 ms against 0.0373
// for the rows kernel at 8 x 2 (compile 0.0346).
inline constexpr int kNarrowThreadsPerRow = 16;
inline constexpr int kNarrowThreads = 64;
inline constexpr int kNarrowRowsPerThread = 2;
inline constexpr int kNarrowRowsPerBlock = kNarrowThreads / kNarrowThreadsPerRow * kNarrowRowsPerThread;

constexpr bool takes_narrow_rows(bool centered, bool residual, int elem_bytes, int64_t cols, bool vectorized) {
  return !centered && !residual && elem_bytes == 2 && vectorized && cols == kNarrowThreadsPerRow * (16 / elem_bytes);
}

struct LaunchPlan {
  bool narrow = false;      // the narrow kernel (takes_narrow_rows)
  int row_shape = -1;       // index into k{Forward,Backward}RowShapes; -1: the two-pass kernel
  int reread_shape = -1;    // index into kRereadRowShapes (RMSNorm's plain forward); -1: not the reread kernel
  bool backward_shape = false;  // the forward on kBackwardRowShapes[row_shape] (residual_takes_two_vectors)
  bool vectorized = false;  // 16-byte accesses (cols a multiple of a vector, pointers aligned)
  dim3 grid, block;         // grid.x blocks walk the rows in a grid-stride loop: the weight gradient's partials
};

// Defined for float, at::Half, at::BFloat16 in rms_norm_fwd.cu / rms_norm_bwd.cu (kCentered false:
// RMSNorm) and layer_norm_fwd.cu / layer_norm_bwd.cu (true: LayerNorm). The backward's planner asks
// the occupancy calculator (cached per device) for one wave of resident blocks, the forward's plans a
// block for each row group; the launchers run on the current stream and never synchronize.
// launch_backward also sums params.weight_partials / bias_partials (plan.grid.x rows each) into
// grad_weight / grad_bias (in weight_dtype / bias_dtype) when they are set, in one launch.
template <typename T, bool kCentered>
LaunchPlan plan_forward(int64_t rows, int64_t cols, bool aligned, bool residual);
template <typename T, bool kCentered>
void launch_forward(const ForwardParams<T>& params, const LaunchPlan& plan);
template <typename T, bool kCentered>
LaunchPlan plan_backward(int64_t rows, int64_t cols, bool aligned);
template <typename T, bool kCentered>
void launch_backward(const BackwardParams<T>& params, const LaunchPlan& plan, void* grad_weight, void* grad_bias);

}  // namespace fuseforge::rms_norm
