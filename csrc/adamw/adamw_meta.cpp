// Host-side packing of the AdamW metadata (see adamw_meta.h). Builds without CUDA.
#include "adamw/adamw_meta.h"

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace fuseforge::adamw {

BlockPlan plan_blocks(const std::vector<int64_t>& numels, const PlanOptions& options) {
  if (options.chunk_elems <= 0 || options.chunk_elems % 8 != 0)
    throw std::invalid_argument("chunk_elems must be a positive multiple of 8, got " +
                                std::to_string(options.chunk_elems));
  if (options.max_blocks_per_launch <= 0 || options.max_blocks_per_launch > kMaxBlocksPerLaunch)
    throw std::invalid_argument("max_blocks_per_launch must be in [1, 2^31 - 1], got " +
                                std::to_string(options.max_blocks_per_launch));
  if (numels.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw std::invalid_argument("too many tensors for int32 indices");
  BlockPlan plan;
  plan.chunk_elems = options.chunk_elems;
  plan.num_chunks.resize(numels.size());
  int64_t total = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    if (numels[t] < 0) throw std::invalid_argument("tensor " + std::to_string(t) + " has a negative numel");
    // An empty tensor still gets one block: it advances the tensor's step and touches no element.
    const int64_t chunks = numels[t] == 0 ? 1 : (numels[t] + options.chunk_elems - 1) / options.chunk_elems;
    if (chunks > std::numeric_limits<int32_t>::max())
      throw std::invalid_argument("tensor " + std::to_string(t) + " needs more than 2^31 chunks");
    plan.num_chunks[t] = static_cast<int32_t>(chunks);
    total += chunks;
  }
  plan.blocks.reserve(static_cast<size_t>(total));
  for (size_t t = 0; t < numels.size(); ++t)
    for (int32_t c = 0; c < plan.num_chunks[t]; ++c) plan.blocks.push_back({static_cast<int32_t>(t), c});
  for (int64_t first = 0; first < total; first += options.max_blocks_per_launch)
    plan.launches.push_back({first, std::min(options.max_blocks_per_launch, total - first)});
  return plan;
}

size_t pack_step_data(const std::vector<GroupHyper>& groups, const std::vector<const void*>& grads,
                      std::vector<uint8_t>& out) {
  const size_t grads_at = step_data_grads_offset(groups.size());
  const size_t bytes = grads_at + grads.size() * sizeof(void*);
  out.resize(bytes);
  if (!groups.empty()) std::memcpy(out.data(), groups.data(), groups.size() * sizeof(GroupHyper));
  if (!grads.empty()) std::memcpy(out.data() + grads_at, grads.data(), grads.size() * sizeof(void*));
  return bytes;
}

size_t pack_table(const std::vector<TensorMeta>& table, const std::vector<BlockWork>& blocks,
                  std::vector<uint8_t>& out) {
  const size_t blocks_at = table_blocks_offset(table.size());
  const size_t bytes = blocks_at + blocks.size() * sizeof(BlockWork);
  out.resize(bytes);
  if (!table.empty()) std::memcpy(out.data(), table.data(), table.size() * sizeof(TensorMeta));
  if (!blocks.empty()) std::memcpy(out.data() + blocks_at, blocks.data(), blocks.size() * sizeof(BlockWork));
  return bytes;
}

}  // namespace fuseforge::adamw
