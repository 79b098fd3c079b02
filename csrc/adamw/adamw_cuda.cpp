// fused AdamW CUDA backend, host side: keeps the packed metadata in device memory (uploaded only when
// it changes), launches the update kernel over the block map, and registers the CUDA ops. No host
// synchronization. Compiled by the C++ compiler, not nvcc (CONTRIBUTING.md, Layout); the launchers
// are in adamw_launch.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "adamw/adamw.h"
#include "adamw/adamw_launch.h"
#include "common/cuda_utils.h"
#include "common/env.h"

namespace fuseforge::adamw {
namespace {

// ---- managed memory for paged states ----------------------------------------------------------------
// CUDA 13 takes a cudaMemLocation in cudaMemAdvise and cudaMemPrefetchAsync where CUDA 12 took a device
// ordinal.

cudaError_t advise(const void* ptr, size_t bytes, cudaMemoryAdvise advice, int device) {
#if CUDART_VERSION >= 13000
  cudaMemLocation location{};
  location.type = cudaMemLocationTypeDevice;
  location.id = device;
  return cudaMemAdvise(ptr, bytes, advice, location);
#else
  return cudaMemAdvise(ptr, bytes, advice, device);
#endif
}

cudaError_t prefetch(const void* ptr, size_t bytes, int device, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  cudaMemLocation location{};
  location.type = cudaMemLocationTypeDevice;
  location.id = device;
  return cudaMemPrefetchAsync(ptr, bytes, location, /*flags=*/0, stream);
#else
  return cudaMemPrefetchAsync(ptr, bytes, device, stream);
#endif
}

void free_managed(void* ptr) {
  // cudaFree waits for the device; at process exit the runtime may be gone: its error is dropped, and
  // cleared so that no later launch check reports it.
  if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
}

at::DataPtr allocate_managed(size_t bytes, at::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  int concurrent = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, index));
  TORCH_CHECK(concurrent != 0, "AdamW: paged=True needs CUDA managed memory that the GPU and the CPU can access "
              "concurrently (cudaDevAttrConcurrentManagedAccess), which ", device, " lacks (Windows, WSL, or a GPU "
              "older than Pascal); use paged=False");
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMallocManaged(&ptr, bytes, cudaMemAttachGlobal));
  // Pages live on the GPU unless memory runs short; evicted ones stay mapped for it (no fault back).
  const cudaError_t status = advise(ptr, bytes, cudaMemAdviseSetPreferredLocation, index);
  const cudaError_t status2 = status == cudaSuccess ? advise(ptr, bytes, cudaMemAdviseSetAccessedBy, index) : status;
  if (status2 != cudaSuccess) {
    free_managed(ptr);
    C10_CUDA_CHECK(status2);
  }
  return at::DataPtr(ptr, ptr, &free_managed, device);
}

bool pointer_is_managed(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeManaged;
}

struct CudaCache : BackendCache {
  at::Tensor table_buf;  // device: TensorMeta[T], then BlockWork[B]
  at::Tensor step_buf;   // device: GroupHyper[G], then grad addresses[T]
  at::Tensor done;       // device: int32 arrival counters, one per tensor
  bool int8_states = false;  // some tensor of the table has int8 states
  std::vector<uint8_t> table_host, step_host, step_on_device;
  bool step_on_device_known = false;
};

void upload_words(void* dst, const std::vector<uint8_t>& bytes) {
  const auto* words = reinterpret_cast<const uint64_t*>(bytes.data());
  const int64_t total = static_cast<int64_t>(bytes.size() / sizeof(uint64_t));
  auto* out = static_cast<uint64_t*>(dst);
  for (int64_t at = 0; at < total;) {
    const int64_t count = std::min<int64_t>(total - at, kMaxPatchWords);
    launch_patch_words(out + at, words + at, count);
    at += count;
  }
}

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
    c.int8_states = std::any_of(table.begin(), table.end(), [](const TensorMeta& t) {
      return t.state_format == static_cast<int32_t>(StateFormat::kInt8);
    });
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

  if (work.prefetch != nullptr && !capturing) {
    // Paged states back to the GPU ahead of the kernel, in the kernel's stream order (pages already
    // there cost nothing to move). A graph has no prefetch node: captured steps fault pages in.
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(work.device.index());
    for (const MemRange& r : *work.prefetch) C10_CUDA_CHECK(prefetch(r.ptr, r.bytes, work.device.index(), stream));
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
  args.chunk_elems = work.plan->chunk_elems;
  // Development knob (docs/design/adamw.md): FUSEFORGE_ADAMW_BLOCKS_PER_SM=N caps the update kernel at
  // N resident blocks an SM (registers allow 2).
  static const int64_t blocks_cap = dev_positive_int("FUSEFORGE_ADAMW_BLOCKS_PER_SM", 0);
  const size_t smem_bytes = smem_capping_blocks_per_sm(blocks_cap, 0);
  for (const LaunchRange& r : plan.launches) {
    args.first_block = r.first_block;
    launch_update(args, r.num_blocks, smem_bytes, c.int8_states);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  set_managed_memory(ManagedMemory{&allocate_managed, &pointer_is_managed});
  m.impl("adamw_handle_step", &handle_step_op<cuda_step>);
  m.impl("adamw_fused_", &fused_op<cuda_step>);
}

}  // namespace fuseforge::adamw
