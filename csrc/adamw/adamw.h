// fused AdamW, host side: the per-device optimizer handle that keeps the parameter list, the
// optimizer states and the packed metadata between steps, so one step costs one pass of C++ over
// the parameters (reading each param.grad() itself) and one kernel launch, with no Python loop.
//
// A handle is created once per (optimizer, device) by python/fuseforge/optim.py and named by an
// integer id in the ops (torch.ops.fuseforge.adamw_handle_*); its `steps` tensor (float32, one
// count per parameter, on the device) is passed to every op so the dispatcher picks the backend.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "adamw/adamw_lowbit.h"
#include "adamw/adamw_meta.h"

namespace fuseforge::adamw {

// Per-parameter option bits (adamw_handle_create's param_flags). The state bits pick the parameter's
// state format (python/fuseforge/optim.py sets them only where the format applies: 4096 elements or
// more, not float64); neither means float32. kFlagPaged puts a CUDA parameter's states in managed
// memory (ignored on the CPU). Bits kAbsmaxLenShift and up, when set, give the length of the int8
// absmax arrays if longer than the parameter's block count: a DTensor's local shard pads them to one
// length on every rank, so they form an evenly sharded DTensor (docs/design/adamw.md).
enum : int64_t { kFlagAmsgrad = 1, kFlagMaster = 2, kFlagStateBFloat16 = 4, kFlagStateInt8 = 8, kFlagPaged = 16 };
constexpr int kAbsmaxLenShift = 32;
// Values per group in adamw_handle_step's `hypers`: lr, beta1, beta2, eps, weight_decay, maximize.
constexpr int64_t kHypersPerGroup = 6;

// Managed (unified) memory for paged states. The CUDA backend (adamw_cuda.cpp) installs it when the
// library loads; a build without CUDA has none.
struct ManagedMemory {
  // `bytes` of managed memory that prefers `device` (advised: preferred location, accessed by it);
  // the DataPtr frees it. Raises when the device cannot page (no concurrent managed access).
  at::DataPtr (*allocate)(size_t bytes, at::Device device) = nullptr;
  // Whether `ptr` points into managed memory.
  bool (*is_managed)(const void* ptr) = nullptr;
};
void set_managed_memory(const ManagedMemory& memory);
const ManagedMemory* managed_memory();  // nullptr without a CUDA backend

// A byte range of managed memory a step prefetches to its device.
struct MemRange {
  const void* ptr = nullptr;
  size_t bytes = 0;
};

// Backend-owned data kept across steps (device buffers, pinned staging); see adamw_cuda.cpp.
struct BackendCache {
  virtual ~BackendCache() = default;
};

// What a backend needs for one step.
struct StepWork {
  const std::vector<TensorMeta>* table = nullptr;
  const BlockPlan* plan = nullptr;
  bool table_changed = false;            // table/plan differ from the last step's
  const std::vector<GroupHyper>* groups = nullptr;
  const std::vector<const void*>* grads = nullptr;  // per table entry; nullptr = no grad this step
  const float* grad_scale = nullptr;      // device (or host, CPU backend) values
  const float* found_inf = nullptr;
  at::Device device = at::kCPU;
  const std::vector<MemRange>* prefetch = nullptr;  // paged states, prefetched before the launch
};

using BackendStepFn = void (*)(std::shared_ptr<BackendCache>& cache, const StepWork& work);

// CPU backend (adamw.cpp); the CUDA one lives in adamw_cuda.cpp.
void cpu_step(std::shared_ptr<BackendCache>& cache, const StepWork& work);

struct SlotState {
  bool initialized = false;
  StateFormat format = StateFormat::kFull;
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, master;
  at::Tensor exp_avg_absmax, exp_avg_sq_absmax;  // int8 only
};

// The order of a slot's states in adamw_handle_state / adamw_handle_set_state.
enum StateIndex : int { kExpAvg = 0, kExpAvgSq, kMaxExpAvgSq, kMaster, kExpAvgAbsmax, kExpAvgSqAbsmax, kNumStates };

class Handle {
 public:
  Handle(std::vector<at::Tensor> params, const std::vector<int64_t>& groups, const std::vector<int64_t>& flags,
         at::Tensor steps, int64_t num_groups);

  // One optimizer step; returns how many slots got their state created (lazily, at their first grad).
  int64_t step(const std::vector<double>& hypers, const std::vector<std::optional<at::Tensor>>& lr_tensors,
               const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
               BackendStepFn backend);
  std::vector<int64_t> take_new_slots();
  std::vector<at::Tensor> slot_state(int64_t slot) const;
  // Adopts loaded states (copied when dtype, device or strides differ); empty = no state. Returns the
  // tensors the handle keeps.
  std::vector<at::Tensor> set_slot_state(int64_t slot, const std::vector<at::Tensor>& states);
  void zero_grad(bool set_to_none);
  const at::Tensor& steps() const { return steps_; }
  at::Device device() const { return device_; }

 private:
  void init_slot(int64_t slot);
  void rebuild_table();
  StateFormat format_of(int64_t slot) const;
  at::Tensor adopt_state(int64_t slot, const at::Tensor& value, at::ScalarType dtype, const char* what) const;
  // Storage for state `which` of `slot` in the parameter's layout (or a 1-d `absmax_len` array for
  // the absmax states): a view into the managed arena for paged slots, else a fresh tensor.
  // Uninitialized.
  at::Tensor state_storage(int64_t slot, int which, at::ScalarType dtype) const;
  // `value` in the slot's state storage: itself unless the slot is paged and it lies elsewhere.
  at::Tensor place(int64_t slot, int which, const at::Tensor& value) const;
  bool paged(int64_t slot) const { return (flags_[slot] & kFlagPaged) != 0 && device_.is_cuda(); }
  int64_t absmax_len(int64_t slot) const;
  void reserve_arena();
  // A loaded moment (float of any precision, or int8 codes with their absmax) in the slot's format;
  // returns (state, absmax), the absmax undefined unless the format is int8.
  std::pair<at::Tensor, at::Tensor> adopt_moment(int64_t slot, StateFormat format, const at::Tensor& value,
                                                 const at::Tensor& absmax, bool squared, const char* what) const;

  std::vector<at::Tensor> params_;
  std::vector<int32_t> group_of_;
  std::vector<int64_t> flags_;
  at::Tensor steps_;
  int64_t num_groups_;
  at::Device device_;
  std::vector<SlotState> slots_;
  // Paged states: one managed allocation for every paged slot's states (reserved at creation:
  // managed pages take physical memory only when first touched), each state a view that keeps it
  // alive; arena_at_[slot][state] is the byte offset of its region (-1: none reserved).
  c10::Storage arena_;
  std::vector<std::array<int64_t, kNumStates>> arena_at_;
  std::vector<std::array<int64_t, kNumStates>> arena_bytes_;
  std::vector<MemRange> prefetch_;  // the initialized paged states, merged into few ranges
  // Change detection (compared every step; a mismatch triggers a rebuild or a re-check).
  std::vector<const void*> param_ptr_;
  std::vector<at::ScalarType> param_dtype_;
  std::vector<const c10::TensorImpl*> grad_impl_;
  std::vector<const void*> grad_ptr_;
  // The packed metadata.
  std::vector<int32_t> table_index_;  // slot -> table entry, or -1 (no state yet)
  std::vector<int32_t> table_slot_;   // table entry -> slot
  std::vector<TensorMeta> table_;
  BlockPlan plan_;
  bool table_dirty_ = true;
  std::vector<GroupHyper> groups_;
  std::vector<const void*> grads_;
  std::vector<int64_t> new_slots_;
  std::vector<std::pair<at::Tensor, at::Tensor>> relaid_;  // (grad, copy in the param's layout), this step
  std::shared_ptr<BackendCache> cache_;
};

// Handle registry (ids are what Python holds).
int64_t register_handle(std::shared_ptr<Handle> handle);
std::shared_ptr<Handle> get_handle(int64_t id, const at::Tensor& steps);
void destroy_handle(int64_t id);

// Checks shared by the handle and the tensor-list op.
void check_param(const at::Tensor& p, const char* what, int64_t index);
void check_grad(const at::Tensor& g, const at::Tensor& p, int64_t index);
ParamDtype param_dtype_of(at::ScalarType t);
GroupHyper make_group_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                            const std::optional<at::Tensor>& lr_tensor, at::Device device);
void check_scale_tensor(const std::optional<at::Tensor>& t, const char* name, at::Device device);

// The tensor-list op (torch._fused_adamw_-like, one group): used under torch.compile and by
// functional callers. Builds its metadata on every call. Each tensor's state format follows its
// exp_avg's dtype (float32/float64, bfloat16, or uint8 codes with their absmax entries).
void list_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList state_steps,
               at::TensorList exp_avg_absmaxs, at::TensorList exp_avg_sq_absmaxs, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool maximize,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, BackendStepFn backend);

// The two ops whose implementation depends on the device, written once over the backend's step
// function: adamw.cpp registers them for the CPU with cpu_step, adamw_cuda.cpp for CUDA.
template <BackendStepFn kStep>
int64_t handle_step_op(int64_t id, at::Tensor& steps, at::ArrayRef<double> hypers,
                       const c10::List<std::optional<at::Tensor>>& lr_tensors,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  auto h = get_handle(id, steps);
  std::vector<std::optional<at::Tensor>> lrs(lr_tensors.begin(), lr_tensors.end());
  return h->step(hypers.vec(), lrs, grad_scale, found_inf, kStep);
}

template <BackendStepFn kStep>
void fused_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList state_steps,
              at::TensorList exp_avg_absmaxs, at::TensorList exp_avg_sq_absmaxs, double lr, double beta1,
              double beta2, double weight_decay, double eps, bool maximize, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  list_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, state_steps, exp_avg_absmaxs,
            exp_avg_sq_absmaxs, lr, beta1, beta2, weight_decay, eps, maximize, lr_tensor, grad_scale, found_inf, kStep);
}

}  // namespace fuseforge::adamw
