// AdamW multi-tensor metadata: the plain structs the CUDA kernel reads from device memory and the
// host-side packing that builds them. No CUDA and no ATen here, so the packing is unit-tested by
// GoogleTest (tests/cpp/test_adamw.cpp) in the CPU-only build.
//
// Layout of one step's work:
//   - a tensor table (TensorMeta per tensor: addresses of the param and its states, numel, dtype,
//     group, chunk count), rebuilt only when an address or a size changes;
//   - a block map (BlockWork per CUDA block: which tensor, which chunk of it), built with the table;
//   - the per-step data (GroupHyper per param group, then one grad address per tensor), uploaded only
//     when it differs from what the device already holds.
// Every tensor gets max(1, ceil(numel / chunk)) blocks: an empty tensor gets one block that does no
// element work but still advances its step count (torch.optim.AdamW counts steps of empty params).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fuseforge::adamw {

// Element type of a parameter (grads have the param's type; states are float32, float64 for float64,
// or a compact format: adamw_lowbit.h).
enum class ParamDtype : int32_t { kFloat = 0, kHalf = 1, kBFloat16 = 2, kDouble = 3 };

inline int64_t param_dtype_bytes(ParamDtype d) {
  return d == ParamDtype::kFloat ? 4 : d == ParamDtype::kDouble ? 8 : 2;
}

// One tensor of the table. Addresses are raw device (or host, for the CPU backend) pointers.
struct TensorMeta {
  void* param = nullptr;           // ParamDtype elements
  void* exp_avg = nullptr;         // float32 (float64 for float64 params), bfloat16 or 8-bit codes: state_format
  void* exp_avg_sq = nullptr;      // same
  void* max_exp_avg_sq = nullptr;  // amsgrad only (float32, float64 or bfloat16), else nullptr
  void* master = nullptr;          // float32 master copy of a float16/bfloat16 param, else nullptr
  float* exp_avg_absmax = nullptr;     // int8 states: one float32 scale per 256 elements, else nullptr
  float* exp_avg_sq_absmax = nullptr;  // same
  float* step = nullptr;           // the tensor's step count (float32, like torch's state["step"])
  int64_t numel = 0;
  int32_t group = 0;               // index into the GroupHyper array
  int32_t num_chunks = 0;          // blocks this tensor owns (>= 1)
  int32_t dtype = 0;               // ParamDtype
  int32_t state_format = 0;        // StateFormat (adamw_lowbit.h)
};
static_assert(sizeof(TensorMeta) == 88, "TensorMeta layout is shared by host and device");

// One CUDA block's work: elements [chunk * chunk_elems, min(numel, (chunk + 1) * chunk_elems)).
struct BlockWork {
  int32_t tensor;
  int32_t chunk;
};
static_assert(sizeof(BlockWork) == 8, "BlockWork layout is shared by host and device");

// Hyperparameters of one param group, as the kernel reads them every step.
struct GroupHyper {
  double lr = 0;                 // used when lr_ptr is null
  const void* lr_ptr = nullptr;  // a 0-dim lr tensor on the device (float32 or float64), read at run time
  double beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  int32_t lr_is_double = 0;
  int32_t maximize = 0;
};
static_assert(sizeof(GroupHyper) == 56, "GroupHyper layout is shared by host and device");

// Elements a CUDA block updates. 16-byte vectors of 8 float16 / 4 float32 elements: chunks must
// keep 16-byte alignment, and int8 states whole 256-element quantization blocks (the optimizer's
// chunks are multiples of 256). 16K was the fastest of 16K-512K on the H100 (llama1b fp32: 16K
// 9.17 ms, 64K 9.35, 512K 9.61): smaller blocks even out the last wave.
constexpr int64_t kDefaultChunkElems = int64_t{1} << 14;
constexpr int64_t kMaxBlocksPerLaunch = (int64_t{1} << 31) - 1;  // CUDA gridDim.x limit

struct PlanOptions {
  int64_t chunk_elems = kDefaultChunkElems;           // multiple of 8
  int64_t max_blocks_per_launch = kMaxBlocksPerLaunch;  // one "table" launch holds at most this many blocks
};

// A launch covers blocks [first_block, first_block + num_blocks) of the block map.
struct LaunchRange {
  int64_t first_block = 0;
  int64_t num_blocks = 0;
};

struct BlockPlan {
  int64_t chunk_elems = 0;          // the chunk size the blocks were cut with
  std::vector<BlockWork> blocks;
  std::vector<int32_t> num_chunks;  // per tensor
  std::vector<LaunchRange> launches;
};

// Chunks every tensor (numels[i] >= 0) and splits the block map into launches. Throws
// std::invalid_argument on a bad option, a negative numel, or more chunks than int32 indices hold.
BlockPlan plan_blocks(const std::vector<int64_t>& numels, const PlanOptions& options = {});

// The per-step buffer: groups.size() GroupHyper records, then grads.size() addresses (8-byte
// aligned). Returns the byte size; `out` is resized to it.
size_t pack_step_data(const std::vector<GroupHyper>& groups, const std::vector<const void*>& grads,
                      std::vector<uint8_t>& out);
inline size_t step_data_grads_offset(size_t num_groups) { return num_groups * sizeof(GroupHyper); }

// The static buffer: the tensor table, then the block map. Returns the byte size.
size_t pack_table(const std::vector<TensorMeta>& table, const std::vector<BlockWork>& blocks,
                  std::vector<uint8_t>& out);
inline size_t table_blocks_offset(size_t num_tensors) { return num_tensors * sizeof(TensorMeta); }

}  // namespace fuseforge::adamw
