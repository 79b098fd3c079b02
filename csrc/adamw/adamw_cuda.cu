// fused AdamW CUDA backend: keeps the packed metadata in device memory (uploaded only when it
// changes), launches the one update kernel, and registers the CUDA ops. No host synchronization.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "adamw/adamw.h"
#include "adamw/adamw_kernel.cuh"
#include "common/launch.cuh"

namespace fuseforge::adamw {
namespace {

struct CudaCache : BackendCache {
  at::Tensor table_buf;  // device: TensorMeta[T], then BlockWork[B]
  at::Tensor step_buf;   // device: GroupHyper[G], then grad addresses[T]
  at::Tensor done;       // device: int32 arrival counters, one per tensor
  std::vector<uint8_t> table_host, step_host, step_on_device;
  bool step_on_device_known = false;
};

constexpr int kSmallPatchWords = 256;   // 2 KB of parameters
constexpr int kLargePatchWords = 4000;  // just under the 32 KB kernel-parameter limit

template <int kWords>
void patch_launch(uint64_t* dst, const uint64_t* words, int64_t count) {
  PatchArgs<kWords> args;
  args.dst = dst;
  args.count = count;
  std::memcpy(args.words, words, static_cast<size_t>(count) * sizeof(uint64_t));
  launch_kernel(patch_words_kernel<kWords>, dim3(1), dim3(kThreads), 0, args);
}

void upload_words(void* dst, const std::vector<uint8_t>& bytes) {
  const auto* words = reinterpret_cast<const uint64_t*>(bytes.data());
  const int64_t total = static_cast<int64_t>(bytes.size() / sizeof(uint64_t));
  auto* out = static_cast<uint64_t*>(dst);
  for (int64_t at = 0; at < total;) {
    const int64_t left = total - at;
    if (left <= kSmallPatchWords) {
      patch_launch<kSmallPatchWords>(out + at, words + at, left);
      at += left;
    } else {
      const int64_t count = std::min<int64_t>(left, kLargePatchWords);
      patch_launch<kLargePatchWords>(out + at, words + at, count);
      at += count;
    }
  }
}

using UpdateKernel = void (*)(KernelArgs);

// The update kernel's shape (adamw_kernel.cuh). A tuning build (-DFUSEFORGE_ADAMW_TUNING) carries
// several, picked by FUSEFORGE_ADAMW_VARIANT=u<unroll>b<min blocks per SM> (u0b4: the default), for side-by-side timing
// in one process; a normal build compiles the default only.
UpdateKernel update_kernel() {
#ifdef FUSEFORGE_ADAMW_TUNING
  static const UpdateKernel chosen = [] {
    const char* env = std::getenv("FUSEFORGE_ADAMW_VARIANT");
    const std::string v = env ? env : "";
    if (v == "u1b4") return &adamw_multi_tensor_kernel<1, 4>;
    if (v == "u2b4") return &adamw_multi_tensor_kernel<2, 4>;
    if (v == "u2b3") return &adamw_multi_tensor_kernel<2, 3>;
    if (v == "u4b2") return &adamw_multi_tensor_kernel<4, 2>;
    if (v == "u2b2") return &adamw_multi_tensor_kernel<2, 2>;
    TORCH_CHECK(v.empty() || v == "u0b4", "FUSEFORGE_ADAMW_VARIANT: unknown variant '", v,
                "' (u0b4, u1b4, u2b4, u2b3, u4b2, u2b2)");
    return &adamw_multi_tensor_kernel<kDefaultShape.unroll, kDefaultShape.min_blocks_per_sm>;
  }();
  return chosen;
#else
  return &adamw_multi_tensor_kernel<kDefaultShape.unroll, kDefaultShape.min_blocks_per_sm>;
#endif
}

}  // namespace

void cuda_step(std::shared_ptr<BackendCache>& cache_ptr, const StepWork& work) {
  const auto& table = *work.table;
  const auto& plan = *work.plan;
  if (plan.blocks.empty()) return;
  const c10::cuda::CUDAGuard guard(work.device);
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  if (!cache_ptr) cache_ptr = std::make_shared<CudaCache>();
  auto& c = static_cast<CudaCache&>(*cache_ptr);
  const auto byte_opts = at::TensorOptions().dtype(at::kByte);

  if (work.table_changed || !c.table_buf.defined()) {
    TORCH_CHECK(!capturing,
                "AdamW: the parameters, their addresses or their optimizer states changed during CUDA graph capture "
                "(state is created at a parameter's first grad); run one step() before capturing");
    const size_t bytes = pack_table(table, plan.blocks, c.table_host);
    at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, byte_opts.pinned_memory(true));
    std::memcpy(host.data_ptr(), c.table_host.data(), bytes);
    c.table_buf = at::empty({static_cast<int64_t>(bytes)}, byte_opts.device(work.device));
    c.table_buf.copy_(host, /*non_blocking=*/true);  // the caching host allocator keeps `host` until copied
    c.done = at::zeros({static_cast<int64_t>(table.size())}, at::TensorOptions().dtype(at::kInt).device(work.device));
    c.step_on_device_known = false;
  }
  const size_t step_bytes = pack_step_data(*work.groups, *work.grads, c.step_host);
  if (!c.step_buf.defined() || c.step_buf.numel() < static_cast<int64_t>(step_bytes)) {
    TORCH_CHECK(!capturing, "AdamW: the optimizer's metadata grew during CUDA graph capture; run one step() first");
    c.step_buf = at::empty({static_cast<int64_t>(step_bytes)}, byte_opts.device(work.device));
    c.step_on_device_known = false;
  }
  if (!c.step_on_device_known || c.step_host != c.step_on_device) {
    upload_words(c.step_buf.data_ptr(), c.step_host);
    // A captured upload runs at replay, not now: what the device holds afterwards is unknown.
    c.step_on_device_known = !capturing;
    if (!capturing) c.step_on_device = c.step_host;
  }

  KernelArgs args;
  auto* table_base = static_cast<uint8_t*>(c.table_buf.data_ptr());
  args.table = reinterpret_cast<const TensorMeta*>(table_base);
  args.blocks = reinterpret_cast<const BlockWork*>(table_base + table_blocks_offset(table.size()));
  auto* step_base = static_cast<uint8_t*>(c.step_buf.data_ptr());
  args.groups = reinterpret_cast<const GroupHyper*>(step_base);
  args.grads = reinterpret_cast<const void* const*>(step_base + step_data_grads_offset(work.groups->size()));
  args.done = c.done.mutable_data_ptr<int32_t>();
  args.grad_scale = work.grad_scale;
  args.found_inf = work.found_inf;
  args.chunk_elems = work.chunk_elems;
  for (const LaunchRange& r : plan.launches) {
    args.first_block = r.first_block;
    launch_kernel(update_kernel(), dim3(static_cast<unsigned>(r.num_blocks)), dim3(kThreads), 0, args);
  }
}

namespace {

int64_t handle_step_cuda(int64_t id, at::Tensor& steps, at::ArrayRef<double> hypers,
                         const c10::List<std::optional<at::Tensor>>& lr_tensors,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  auto h = get_handle(id, steps);
  std::vector<std::optional<at::Tensor>> lrs(lr_tensors.begin(), lr_tensors.end());
  return h->step(hypers.vec(), lrs, grad_scale, found_inf, &cuda_step);
}

void fused_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList state_steps, double lr,
                double beta1, double beta2, double weight_decay, double eps, bool maximize,
                const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf) {
  list_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps, lr, beta1, beta2,
            weight_decay, eps, maximize, lr_tensor, grad_scale, found_inf, &cuda_step);
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  m.impl("adamw_handle_step", &handle_step_cuda);
  m.impl("adamw_fused_", &fused_cuda);
}

}  // namespace fuseforge::adamw
